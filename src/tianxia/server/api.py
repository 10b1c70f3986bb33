"""The FastAPI application: OpenAI routes, vLLM's extra routes, API keys, body limit, metrics."""

from __future__ import annotations

import hmac
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from tianxia import __version__
from tianxia.engine.async_engine import EngineClient
from tianxia.server.errors import APIError, bad_request, install_handlers
from tianxia.server.event_stream import DIRECT_SEND
from tianxia.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tianxia.server.model_registry import ModelRegistry
from tianxia.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tianxia.server.serving_base import ServerState
from tianxia.server.serving_chat import OpenAIServingChat
from tianxia.server.serving_completions import OpenAIServingCompletion
from tianxia.server.serving_embeddings import OpenAIServingEmbedding, PoolerConfig
from tianxia.server.serving_models import ServingModels
from tianxia.server.serving_native import ConcatenateRequest, GenerateRequest, SGLangServing
from tianxia.server.serving_responses import OpenAIServingResponses
from tianxia.server.serving_tokenize import OpenAIServingTokenization
from tianxia.server.tokenization import BatchedEncoder
from tianxia.server.webui import build_router as build_webui_router

_ENDPOINTS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/models",
    "/models",
    "/models/load",
    "/models/unload",
    "/generate",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ping",
    "/version",
    "/metrics",
}


DEFAULT_MAX_REQUEST_BYTES = 4 << 20

# routes that stay open when an API key is set (probes and version); /metrics is configurable
_OPEN_PATHS = {"/health", "/ping", "/version"}


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


class ModelActionRequest(BaseModel):
    """The body of ``POST /models/load`` and ``/models/unload``."""

    model: str


def _json_body(*models: type) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its JSON itself (one of ``models``)."""
    schemas = []
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.pop("$defs", None)  # the referenced models are in the app's components already
        schemas.append(schema)
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _json_object(raw: Request) -> dict[str, Any]:
    try:
        data = json.loads(await raw.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise bad_request("We could not parse the JSON body of your request.") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


@dataclass
class CORSConfig:
    """vLLM's ``--allowed-origins``, ``--allowed-credentials``, ``--allowed-methods`` and
    ``--allowed-headers``; by default, as vLLM, any origin may call the API from a browser."""

    origins: list[str] = field(default_factory=lambda: ["*"])
    credentials: bool = False
    methods: list[str] = field(default_factory=lambda: ["*"])
    headers: list[str] = field(default_factory=lambda: ["*"])


@dataclass
class Servings:
    """One handler object per endpoint family, over one engine."""

    engine: EngineClient
    state: ServerState
    models: ServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    embedding: OpenAIServingEmbedding
    tokenization: OpenAIServingTokenization
    native: SGLangServing


def build_servings(
    engine: EngineClient,
    served_model_names: list[str],
    *,
    chat_template: str | None = None,
    metrics: ServerMetrics | None = None,
    retry_after_s: int = 1,
    tool_call_parser: str | None = "auto",
    pooler: PoolerConfig | None = None,
    state: ServerState | None = None,
) -> Servings:
    """The handlers of one model; the models of one server share its ``state``."""
    state = state or ServerState(metrics=metrics, retry_after_s=retry_after_s)
    models = ServingModels(engine.info, served_model_names)

    encoder = BatchedEncoder(engine.info.tokenizer)

    def make(cls):
        return cls(
            engine, models, state, chat_template=chat_template, tool_call_parser=tool_call_parser,
            encoder=encoder,
        )

    embedding = make(OpenAIServingEmbedding)
    embedding.pooler = pooler or PoolerConfig()
    return Servings(
        engine,
        state,
        models,
        make(OpenAIServingCompletion),
        make(OpenAIServingChat),
        make(OpenAIServingResponses),
        embedding,
        make(OpenAIServingTokenization),
        make(SGLangServing),
    )


def _probe_routes(registry: ModelRegistry, state: ServerState, metrics: ServerMetrics) -> APIRouter:
    """Health, version and metrics: what supervisors and scrapers call."""
    router = APIRouter()

    @router.get("/health")
    @router.get("/ping")  # vLLM's alias, for load balancers that probe /ping
    @router.post("/ping")
    async def health() -> Response:
        if state.draining:
            return APIError(
                503, "The server is shutting down.", code="server_shutting_down"
            ).response()
        if registry.router:  # as llama.cpp's router: up while it takes requests, whatever is loaded
            return Response(status_code=200)
        engine = registry.default.servings.engine  # type: ignore[union-attr]
        if not engine.is_running:
            return APIError(
                503, f"The engine is not running: {engine.errored!r}", code="engine_dead"
            ).response()
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def _openai_routes(registry: ModelRegistry) -> APIRouter:
    """OpenAI's ``/v1`` routes; each request goes to the handlers of the model it names."""
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return registry.list_models()

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        return registry.retrieve(model_id)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        async with registry.use(body.model) as s:
            return await s.completion.create(body, raw)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        async with registry.use(body.model) as s:
            return await s.chat.create(body, raw)

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        async with registry.use(body.model) as s:
            return await s.responses.create_response(body, raw)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        # each model keeps the responses it made; an unloaded model's are gone
        for entry in registry.loaded():
            if entry.servings is not None and response_id in entry.servings.responses.stored:
                return entry.servings.responses.retrieve(response_id)
        raise APIError(404, f"Response with id '{response_id}' not found.",
                       param="response_id", code="not_found")

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        async with registry.use(body.model) as s:
            return await s.embedding.create(body)

    return router


def _lora_routes(registry: ModelRegistry) -> APIRouter:
    """vLLM's runtime adapter updates, ``POST /v1/load_lora_adapter`` (``{"lora_name",
    "lora_path"}``) and ``/v1/unload_lora_adapter`` (``{"lora_name"}``): a 404, as vLLM's absent
    routes, unless the server runs with ``--allow-runtime-lora-updating``."""
    router = APIRouter()

    async def update(raw: Request, load: bool) -> Response:
        data = await _json_object(raw)
        async with registry.use(data.get("model") if isinstance(data.get("model"), str) else None) as s:
            if not s.state.allow_runtime_lora_updating:
                raise APIError(404, "runtime LoRA updates are off: start the server with "
                                    "--allow-runtime-lora-updating", code="not_found")
            if load:
                text = await s.models.load_lora_adapter(s.engine, data)
            else:
                text = await s.models.unload_lora_adapter(s.engine, data)
        return Response(text, media_type="text/plain")

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> Response:
        return await update(raw, load=True)

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> Response:
        return await update(raw, load=False)

    return router


def _router_routes(registry: ModelRegistry) -> APIRouter:
    """llama.cpp's router routes: ``GET /models``, ``POST /models/load`` and ``/models/unload``
    (``{"model": NAME}``, answered ``{"success": true}``)."""
    router = APIRouter()

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        return registry.list_models()

    async def model_name(raw: Request) -> str:
        name = (await _json_object(raw)).get("model")
        if not isinstance(name, str) or not name:
            raise bad_request("`model` (a model name) is required", param="model")
        return name

    @router.post("/models/load", openapi_extra=_json_body(ModelActionRequest))
    async def load(raw: Request) -> dict[str, Any]:
        # unlike llama.cpp's (which answers at once), this answers once the model is loaded, so
        # a failure to load or to find room comes back to the caller; /v1/models shows the rest
        await registry.load(await model_name(raw))
        return {"success": True}

    @router.post("/models/unload", openapi_extra=_json_body(ModelActionRequest))
    async def unload(raw: Request) -> dict[str, Any]:
        await registry.unload(await model_name(raw))
        return {"success": True}

    return router


def _sglang_routes(registry: ModelRegistry) -> APIRouter:
    """SGLang's native routes, for ``sgl.RuntimeEndpoint`` and SGLang's scripts (a ``model``
    field or query parameter picks the model where a server has several)."""
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateRequest, raw: Request) -> Response:
        async with registry.use(body.model) as s:
            return await s.native.generate_native(body, raw)

    @router.get("/get_model_info")
    async def get_model_info(model: str | None = None) -> dict[str, Any]:
        async with registry.use(model) as s:
            return s.native.model_info()

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def server_info(model: str | None = None) -> dict[str, Any]:
        async with registry.use(model) as s:
            return s.native.server_info()

    @router.get("/flush_cache")
    @router.post("/flush_cache")
    async def flush_cache(model: str | None = None) -> Response:
        async with registry.use(model) as s:
            return await s.native.flush_cache()

    @router.post("/concate_and_append_request")
    async def concate_and_append(body: ConcatenateRequest) -> dict[str, Any]:
        # the frontend's fork join ("concate_and_append"): it asks for the forks' KV caches to
        # be joined into the parent's; here the next /generate sends the parent's whole text,
        # and the prefix cache serves what it already holds, so there is nothing to join
        return {"success": True, "dst_rid": body.dst_rid}

    return router


def _tokenize_routes(registry: ModelRegistry) -> APIRouter:
    """vLLM's ``/tokenize`` and ``/detokenize``."""
    router = APIRouter()

    async def named(raw: Request) -> tuple[dict[str, Any], str | None]:
        data = await _json_object(raw)
        name = data.get("model")
        return data, name if isinstance(name, str) else None

    @router.post(
        "/tokenize", openapi_extra=_json_body(TokenizeCompletionRequest, TokenizeChatRequest)
    )
    async def tokenize(raw: Request) -> JSONResponse:
        data, name = await named(raw)
        async with registry.use(name) as s:
            return JSONResponse(await s.tokenization.tokenize(data))

    @router.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> JSONResponse:
        data, name = await named(raw)
        async with registry.use(name) as s:
            return JSONResponse(s.tokenization.detokenize(data))

    return router


class _App(FastAPI):
    """Records the HTTP server's own ``send`` for :class:`EventStreamResponse` (its chunks skip
    the middlewares, which act on a response's start only)."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[DIRECT_SEND] = send
        await super().__call__(scope, receive, send)


def build_app(
    registry: ModelRegistry,
    *,
    state: ServerState,
    metrics: ServerMetrics,
    api_key: str | None = None,
    root_path: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics_require_auth: bool = False,
    cors: CORSConfig | None = None,
    webui: bool = True,
) -> FastAPI:
    """The server's app over ``registry`` (``ModelRegistry.single(servings)`` for one model)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        registry.start()
        try:
            yield
        finally:
            await registry.shutdown()

    app = _App(
        title="tianxia", version=__version__, lifespan=lifespan, root_path=root_path or ""
    )
    app.state.registry = registry
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
    cors = cors or CORSConfig()
    # outermost (added last), so that refusals (401, 413) carry the CORS headers too and a
    # browser's preflight OPTIONS is answered before the key is checked
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.origins,
        allow_credentials=cors.credentials,
        allow_methods=cors.methods,
        allow_headers=cors.headers,
    )
    app.include_router(_probe_routes(registry, state, metrics))
    app.include_router(_openai_routes(registry))
    app.include_router(_lora_routes(registry))
    if registry.router:
        app.include_router(_router_routes(registry))
    app.include_router(_tokenize_routes(registry))
    app.include_router(_sglang_routes(registry))
    app.state.started = time.time()
    return app
