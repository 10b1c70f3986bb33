"""The one HTTP entry of the Ray application: forwards every route to a replica, unchanged.

It parses only what the router needs (the prompt's token ids, ``RoutingTokenizer``); validation,
errors and streaming are the replica's (``tianxia serve``'s own app). A replica lost before its
answer gives a 503 in OpenAI's error shape; one lost mid-stream ends the stream with an error
event, never a hang.
"""


# no `from __future__ import annotations`: FastAPI reads the route signature at run time
import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from tianxia.ray.replica import ForwardedRequest, ResponseHead, serve_args
from tianxia.ray.tokens import RoutingTokenizer
from tianxia.server.errors import APIError

logger = logging.getLogger(__name__)

app = FastAPI(title="tianxia (Ray Serve)")

# the replica sets these itself; hop-by-hop ones must not be copied
_DROP = {b"content-length", b"transfer-encoding", b"connection"}


def _error(status: int, message: str) -> Response:
    return APIError(status, message).response()


def _sse_error(message: str) -> bytes:
    body = APIError(503, message).body()
    return f"data: {json.dumps(body)}\n\n".encode()


# no CPU reserved: it only forwards, and must not wait for cores the replicas hold
@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, model: str, serve_flags: list[str]) -> None:
        from tianxia.server.launcher import _read_chat_template

        self.replicas = replicas.options(stream=True)
        template = _read_chat_template(serve_args(model, serve_flags).chat_template)
        self.tokenizer = RoutingTokenizer(model, template)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "OPTIONS"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _DROP]
        tokens = None
        if request.method == "POST" and body:
            # off the event loop: streams of other requests pass through it
            tokens = await asyncio.to_thread(self.tokenizer.prompt_tokens, body)
        req = ForwardedRequest(
            request.method, "/" + path, request.url.query.encode(), headers, body, tokens,
        )
        gen = self.replicas.forward.remote(req)
        try:
            head: ResponseHead = await gen.__anext__()
        except Exception as exc:  # noqa: BLE001 - any loss of the replica is a 503 to the client
            logger.warning("request to %s failed on its replica: %r", path, exc)
            return _error(503, f"the replica serving this request failed: {type(exc).__name__}")
        headers_out = {
            k.decode(): v.decode() for k, v in head.headers if k.lower() not in _DROP
        }
        headers_out["x-tianxia-replica"] = head.replica
        if not head.streamed:
            return Response(head.body, status_code=head.status, headers=headers_out)

        async def chunks() -> Any:
            try:
                async for chunk in gen:
                    yield chunk
            except Exception as exc:  # noqa: BLE001
                logger.warning("stream of %s broke off: %r", path, exc)
                yield _sse_error(f"the replica serving this stream failed: {type(exc).__name__}")

        return StreamingResponse(chunks(), status_code=head.status, headers=headers_out)
