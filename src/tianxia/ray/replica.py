"""One Ray Serve replica: a tianxia engine and the server's own FastAPI app, in-process.

The ingress forwards each HTTP request as a ``ForwardedRequest``; the replica runs it through the
same app as ``tianxia serve`` (same routes, validation and error bodies) and streams back a head
(status, headers, replica id) and then the body. A non-streamed body comes whole with its head, so
a replica that dies mid-request never leaves a client with half a JSON body.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from tianxia.ray.metrics import ReplicaMetrics


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    routing_tokens: list[int] | None = None  # the prompt's token ids, for the prefix-aware router


@dataclass
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str
    body: bytes = b""  # the whole body, unless ``streamed``
    streamed: bool = False


def serve_args(model: str, extra: list[str]) -> argparse.Namespace:
    """``tianxia serve``'s arguments for one replica's engine."""
    from tianxia.server.launcher import add_serve_args

    p = argparse.ArgumentParser(prog="tianxia serve")
    add_serve_args(p, model)
    args = p.parse_args([model, *extra])
    # a replica is already a process of its own, whose life Ray manages: its engine runs on a
    # thread of it rather than in a core process of its own
    args.engine_core = "thread"
    return args


def _build_app(args: argparse.Namespace):
    import prometheus_client

    from tianxia.server.api import build_app
    from tianxia.server.launcher import _cors, _single_model
    from tianxia.server.serving_base import ServerState

    prometheus_client.disable_created_metrics()
    state = ServerState()
    dead: list[BaseException] = []
    registry, metrics = _single_model(args, args.model_tag, state, dead.append)
    app = build_app(registry, state=state, metrics=metrics, cors=_cors(args), webui=False)
    return app, dead, metrics


class TianxiaReplica:
    """The deployment class (wrapped by ``serve.deployment`` in ``tianxia.ray.app``)."""

    def __init__(self, model: str, serve_flags: list[str]) -> None:
        self.args = serve_args(model, serve_flags)
        self.app, self._dead, server_metrics = _build_app(self.args)
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self._lifespan: contextlib.AsyncExitStack | None = None
        self._started = asyncio.Lock()
        self._metrics = ReplicaMetrics(
            lambda: {name: src.stats() for name, src in list(server_metrics.engines.items())})
        self._metrics_task: asyncio.Task | None = None  # held: the loop keeps tasks weakly

    async def _ensure_started(self) -> None:
        async with self._started:
            if self._lifespan is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.app.router.lifespan_context(self.app))
                self._lifespan = stack
                self._metrics_task = asyncio.create_task(self._metrics.run())

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        await self._ensure_started()
        queue: asyncio.Queue[dict] = asyncio.Queue()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await asyncio.Event().wait()  # the client never disconnects from inside
            return {"type": "http.disconnect"}

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
            "root_path": "", "query_string": req.query, "headers": req.headers,
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
        }
        task = asyncio.create_task(self.app(scope, receive, queue.put))
        try:
            start = await queue.get()
            headers = start.get("headers", [])
            streamed = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in headers
            )
            head = ResponseHead(start["status"], headers, self.replica_id, streamed=streamed)
            body: list[bytes] = []
            if streamed:
                yield head
            while True:
                msg = await queue.get()
                chunk = msg.get("body", b"")
                if streamed:
                    if chunk:
                        yield chunk
                else:
                    body.append(chunk)
                if not msg.get("more_body", False):
                    break
            if not streamed:
                head.body = b"".join(body)
                yield head
        finally:
            if not task.done():
                task.cancel()

    async def check_health(self) -> None:
        """Ray's health probe: the engine's own ``/health`` semantics (a dead engine fails it,
        and Ray replaces the replica)."""
        if self._dead:
            raise RuntimeError(f"the engine loop died: {self._dead[0]!r}")
        if self._lifespan is None:
            return
        head = None
        async for item in self.forward(ForwardedRequest("GET", "/health", b"", [], b"")):
            head = item
        if not isinstance(head, ResponseHead) or head.status != 200:
            raise RuntimeError(f"/health answered {getattr(head, 'status', None)}")
