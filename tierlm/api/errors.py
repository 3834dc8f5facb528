"""Errors in each API's own shape: the OpenAI routes answer
{"error": {"message", "type", "param", "code"}}, the Anthropic routes
(/v1/messages) {"type": "error", "error": {"type", "message"}}, Ollama's
(/api/...) {"error": "message"}."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierlm.serving.errors import APIError

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    507: "insufficient_storage",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


# Anthropic's error types (its docs' list; 507 has no type of its own there)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)
OLLAMA_PATHS = ("/api/",)


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error can quote any text a client sent,
    even a lone surrogate that UTF-8 cannot encode, and must still go out."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def is_ollama(path: str) -> bool:
    return path.startswith(OLLAMA_PATHS)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   path: str = "") -> JSONResponse:
    """The error in the shape of the API that `path` belongs to."""
    if is_anthropic(path):
        body = anthropic_error_body(status, message)
    elif is_ollama(path):
        body = {"error": message}  # Ollama's shape: its clients read `error` as the message
    else:
        body = error_body(status, message, param, code)
    return ErrorResponse(body, status_code=status)


def validation_message(exc, names: dict[str, str] | None = None) -> tuple[str, str | None]:
    """The message and the field of a validation error (FastAPI's, or pydantic's
    own); `names`: a field's name as the client sent it, where it differs."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    param = (names or {}).get(param, param)
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    where = f"'{param}': " if param else ""
    return f"{where}{first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, param, "invalid_value", request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), path=request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error",
                              path=request.url.path)
