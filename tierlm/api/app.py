"""The FastAPI application: routes, middleware, and the served model's life cycle."""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tierlm.api.errors import APIError, error_response, install_error_handlers
from tierlm.api.openai_routes import router as openai_router
from tierlm.api.served_model import ServedModel
from tierlm.cache.block_hash import model_fingerprint
from tierlm.config import Settings, total_memory
from tierlm.engine.core import EngineCore
from tierlm.models.loader import load_model, read_model_info
from tierlm.structured.turn import ModelTurns

log = logging.getLogger(__name__)


async def _load_served_model(app: FastAPI, model_path: Path) -> None:
    settings: Settings = app.state.settings
    try:
        settings = settings.for_model(model_path.name)  # its [models."NAME"] section, by folder name
        info = read_model_info(model_path, settings.served_model_name)
        memory = settings.memory_limit_bytes() or total_memory()
        engine = EngineCore(info.name, lambda: load_model(
            model_path, settings.cpu_weights_dtype, memory, use_cpu_kernels=settings.cpu_kernels,
            use_amx=settings.cpu_amx), settings, model_fingerprint(model_path, {}))
        await engine.start()
        turns = await asyncio.to_thread(_model_turns, engine.tokenizer, settings)
        app.state.served = ServedModel(info, engine, aliases=("default",), turns=turns)
        log.info("serving %s (context %d) at http://%s:%d/v1", info.name, info.context_length,
                 settings.host, settings.port)
    except Exception as e:
        log.exception("could not load %s", model_path)
        app.state.load_error = f"{type(e).__name__}: {e}"


def _model_turns(tokenizer, settings: Settings) -> ModelTurns:
    """How the model takes turns (tools, reasoning), its grammars made ready:
    llguidance's view of the tokenizer takes a moment, better at start than on
    the first request that needs it."""
    turns = ModelTurns(tokenizer, None if settings.tool_format == "auto" else settings.tool_format,
                       settings.reasoning, settings.max_thinking_tokens)
    _ = turns.grammars.ll_tokenizer
    return turns


class QuietHealthProbes(logging.Filter):
    """Keeps /health out of uvicorn's access log: a load balancer or a supervisor
    polls it every few seconds, and those lines would bury the requests."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn: (client, method, path, http version, status)
        return not (isinstance(args, tuple) and len(args) > 2 and str(args[2]).startswith("/health"))


def create_app(settings: Settings, model_path: Path) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # here, not at import: uvicorn configures its loggers before it starts the app
        access = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, QuietHealthProbes) for f in access.filters):
            access.addFilter(QuietHealthProbes())
        loading = asyncio.create_task(_load_served_model(app, model_path))
        yield
        await loading
        if app.state.served is not None:
            await app.state.served.engine.close()

    app = FastAPI(title="tierlm", lifespan=lifespan)
    app.state.settings = settings
    app.state.served = None
    app.state.load_error = None
    install_error_handlers(app)
    app.include_router(openai_router)

    app.add_middleware(RequestGate, settings=settings)

    @app.get("/health")
    async def health():
        served: ServedModel | None = app.state.served
        if app.state.load_error:
            return JSONResponse({"status": "error", "detail": app.state.load_error}, status_code=503)
        if served is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        if not served.engine.is_alive:
            return JSONResponse({"status": "error", "detail": "engine loop stopped"}, status_code=503)
        if reason := served.engine.degraded:
            return JSONResponse({"status": "degraded", "detail": reason}, status_code=503)
        return {"status": "ok", "model": served.info.name}

    @app.get("/v1/cache/stats")
    async def cache_stats():
        served = _ready(app)
        return {"model": served.info.name, "prefix_cache": await served.engine.cache_stats()}

    @app.delete("/v1/cache")
    async def clear_cache(ssd: bool = False):
        """Drop the hot tier; with ?ssd=true also this model's files in the SSD folder."""
        served = _ready(app)
        return {"cleared_blocks": await served.engine.clear_cache(ssd)}

    @app.get("/stats")
    async def stats():
        served: ServedModel | None = app.state.served
        return {"engines": [] if served is None else [served.engine.get_stats()]}

    return app


def _ready(app: FastAPI) -> ServedModel:
    served: ServedModel | None = app.state.served
    if served is None or not served.engine.is_alive:
        raise APIError(503, "the model is not ready yet", code="model_loading")
    return served


class RequestGate:
    """Body-size limit, API key, and the last line against a bug: plain ASGI
    middleware, as Starlette's BaseHTTPMiddleware would hide client disconnects
    from the handlers."""

    def __init__(self, app, settings: Settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        rejection = self._check(request)
        if rejection is None and "content-length" not in request.headers:
            # a chunked body has no length to check up front: read it here, up to the limit
            receive, rejection = await self._read_capped(receive)
        if rejection is not None:
            return await rejection(scope, receive, send)
        await self._guarded(scope, receive, send)

    def _check(self, request: Request) -> JSONResponse | None:
        limit = self.settings.max_body_bytes
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > limit:
            return error_response(413, f"request body of {size} bytes is over the {limit}-byte limit",
                                  code="request_too_large")
        key = self.settings.api_key
        if key and request.url.path.startswith("/v1") and not _authorized(request, key):
            return error_response(401, "invalid or missing API key", code="invalid_api_key")
        return None

    async def _read_capped(self, receive):
        """(a receive that replays the body, then passes through; or a 413)."""
        limit, parts, size = self.settings.max_body_bytes, [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                parts = None  # the client left: let the app see it
                break
            size += len(message.get("body", b""))
            if size > limit:
                return receive, error_response(413, f"request body is over the {limit}-byte limit",
                                               code="request_too_large")
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = [message] if parts is None else [{"type": "http.request", "body": b"".join(parts)}]

        async def replaying():
            return replay.pop() if replay else await receive()

        return replaying, None

    async def _guarded(self, scope, receive, send):
        """A bug answers 500 in the error shape, on a connection that stays usable:
        Starlette's catch-all handler re-raises, and the server then drops the
        keep-alive connection under the client's next request."""
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            log.exception("unhandled error")
            if not started:
                response = error_response(500, f"internal error: {type(e).__name__}", code="internal_error")
                await response(scope, receive, send)
            else:  # mid-response: end it whole, at least
                await send({"type": "http.response.body", "body": b"", "more_body": False})


def _authorized(request: Request, key: str) -> bool:
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())
