"""The FastAPI application: OpenAI routes, vLLM's extra routes, API keys, body limit, metrics."""

from __future__ import annotations

import hmac
import json
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tianxia import __version__
from tianxia.server.errors import APIError, bad_request, install_handlers
from tianxia.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tianxia.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tianxia.server.serving import OpenAIServing
from tianxia.server.webui import build_router as build_webui_router

_ENDPOINTS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/version",
    "/metrics",
}


DEFAULT_MAX_REQUEST_BYTES = 4 << 20

# routes that stay open when an API key is set (probes and version); /metrics is configurable
_OPEN_PATHS = {"/health", "/version"}


class _APIKeyAndStats:
    """Pure ASGI middleware (streams pass through untouched): refuses request bodies over
    ``max_body_bytes`` (413), checks ``Authorization: Bearer`` on every route but ``/health``,
    ``/version`` (and ``/metrics`` unless ``metrics_require_auth``) when an API key is set, and
    counts answered requests by endpoint and status."""

    def __init__(
        self,
        app,
        api_key: str | None,
        metrics: ServerMetrics | None,
        max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        metrics_require_auth: bool = False,
        page_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        open_paths = _OPEN_PATHS if metrics_require_auth else _OPEN_PATHS | {"/metrics"}
        self.open_paths = open_paths | page_paths  # the web page's static files need no key

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"The request body is larger than this server's limit of {self.max_body_bytes} bytes "
            "(--max-request-bytes).",
            code="request_too_large",
        )

    async def _read_body(self, scope, receive, send) -> tuple[bytes, bool] | None:
        """The whole body, or None once a 413 is sent (Content-Length or bytes over the limit)."""
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_body_bytes:
                await self._too_large().response()(scope, receive, send)
                return None
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return bytes(body), True
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large().response()(scope, receive, send)
                return None
            if not message.get("more_body", False):
                return bytes(body), False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = (
            path
            if path in _ENDPOINTS
            else ("/v1/models" if path.startswith("/v1/models/") else "other")
        )
        status_box: list[int] = []

        async def send_with_status(message) -> None:
            if message["type"] == "http.response.start":
                status_box.append(message["status"])
            await send(message)

        if scope.get("method") == "POST":
            # a JSON body sent without `Content-Type: application/json` (curl -d) is still JSON
            headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
            ctype = next((v for k, v in scope.get("headers", []) if k == b"content-type"), b"")
            if b"json" not in ctype.lower():
                scope = dict(scope, headers=headers + [(b"content-type", b"application/json")])
        try:
            if (
                self.api_key is not None
                and path not in self.open_paths
                and scope.get("method") != "OPTIONS"
            ):
                auth = ""
                for k, v in scope.get("headers", []):
                    if k == b"authorization":
                        auth = v.decode("latin-1")
                        break
                scheme, _, token = auth.partition(" ")
                if scheme.lower() != "bearer" or not token.strip():
                    err = APIError(
                        401,
                        "You didn't provide an API key. You need to provide your API key "
                        "in an Authorization header using Bearer auth (i.e. "
                        "Authorization: Bearer YOUR_KEY).",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                    await err.response()(scope, receive, send_with_status)
                    return
                if not hmac.compare_digest(token.strip().encode("latin-1"), self.api_key):
                    err = APIError(
                        401,
                        "Incorrect API key provided.",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                    await err.response()(scope, receive, send_with_status)
                    return
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                # read (and bound) the body here; the app then gets it in one piece, and its later
                # receive() calls (disconnect detection) go to the client's stream
                read = await self._read_body(scope, receive, send_with_status)
                if read is None:
                    return
                body, disconnected = read
                replayed = False

                async def receive_replayed():
                    nonlocal replayed
                    if not replayed:
                        replayed = True
                        return {"type": "http.request", "body": body, "more_body": False}
                    if disconnected:
                        return {"type": "http.disconnect"}
                    return await receive()

                await self.app(scope, receive_replayed, send_with_status)
                return
            await self.app(scope, receive, send_with_status)
        finally:
            if self.metrics is not None and status_box:
                self.metrics.http_requests.labels(
                    self.metrics.model_name, endpoint, str(status_box[0])
                ).inc()


def _json_body(*models: type) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its JSON itself (one of ``models``)."""
    schemas = []
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.pop("$defs", None)  # the referenced models are in the app's components already
        schemas.append(schema)
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def build_app(
    serving: OpenAIServing,
    *,
    metrics: ServerMetrics,
    api_key: str | None = None,
    root_path: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics_require_auth: bool = False,
    webui: bool = True,
) -> FastAPI:
    engine = serving.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(
        title="tianxia", version=__version__, lifespan=lifespan, root_path=root_path or ""
    )
    app.state.serving = serving
    app.state.metrics = metrics
    install_handlers(app)
    page_paths: frozenset[str] = frozenset()
    if webui:
        page_router, page_paths = build_webui_router()
        app.include_router(page_router)
    app.add_middleware(
        _APIKeyAndStats,
        api_key=api_key,
        metrics=metrics,
        max_body_bytes=max_request_bytes,
        metrics_require_auth=metrics_require_auth,
        page_paths=page_paths,
    )

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": serving.created,
            "owned_by": "tianxia",
            "root": str(serving.llm.model_path),
            "parent": None,
            "max_model_len": serving.max_model_len,
        }

    @app.get("/health")
    async def health() -> Response:
        if serving.draining:
            return APIError(
                503, "The server is shutting down.", code="server_shutting_down"
            ).response()
        if not engine.is_running:
            return APIError(
                503, f"The engine is not running: {engine.errored!r}", code="engine_dead"
            ).response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in serving.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id not in serving.model_names:
            raise APIError(
                404,
                f"The model `{model_id}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(body, raw)

    async def json_object(raw: Request) -> dict[str, Any]:
        try:
            data = json.loads(await raw.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise bad_request("We could not parse the JSON body of your request.") from None
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        return data

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(raw: Request) -> JSONResponse:
        data = await json_object(raw)
        tok = serving.tokenizer
        if "messages" in data:
            req = TokenizeChatRequest.model_validate(data)
            serving.check_model(req.model)
            _, ids = serving.render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
                tools=req.tools,
                add_special_tokens=req.add_special_tokens,
            )
        else:
            req = TokenizeCompletionRequest.model_validate(data)
            serving.check_model(req.model)
            ids = serving.encode(req.prompt, req.add_special_tokens, "prompt")
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": serving.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> JSONResponse:
        req = DetokenizeRequest.model_validate(await json_object(raw))
        serving.check_model(req.model)
        serving._check_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": serving.tokenizer.decode(req.tokens)})

    app.state.started = time.time()
    return app
