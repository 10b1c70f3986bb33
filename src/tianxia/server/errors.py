"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server can foresee maps to a status below; nothing a client sends should end in
a 500 (a 500 means a bug in tianxia).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def _valid_unicode(text: str) -> str:
    """Text that can be sent as UTF-8: messages may quote client input, and JSON lets a client
    send lone surrogates (``"\\ud800"``) that no encoder accepts."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = _valid_unicode(message)
        self.param = _valid_unicode(param) if isinstance(param, str) else param
        self.code = code
        self.type = type or _TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_PARAM_RE = re.compile(
    r"^`?([a-z_]+)`? (?:must|should|is|are|has|have|contains|cannot|can't|may)\b"
)


def from_value_error(exc: Exception, default_param: str | None = None) -> APIError:
    """A ``ValueError`` from ``SamplingParams`` or ``add_request``: a 400 naming the field."""
    message = str(exc) or type(exc).__name__
    m = _PARAM_RE.match(message)
    param = m.group(1) if m else default_param
    code = None
    if "context length" in message or "max_model_len" in message:
        code = "context_length_exceeded"
    return APIError(400, message, param=param, code=code)


def _loc_to_param(loc: tuple | list) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # drop pydantic's union-branch names ("str", "list[int]", ...) so the param stays readable
    parts = [
        p
        for p in parts
        if not re.match(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$", p)
    ]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") in ("json_invalid", "json_type"):
        return bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't "
            "using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
        )
    param = _loc_to_param(first.get("loc", ()))
    msgs = []
    for e in errors[:3]:
        p = _loc_to_param(e.get("loc", ()))
        msgs.append(f"{p}: {e.get('msg')}" if p else str(e.get("msg")))
    if first.get("type") == "missing" and param:
        return bad_request(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    return bad_request("Invalid request: " + "; ".join(msgs), param=param)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, exc: ValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return APIError(exc.status_code, msg, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()
