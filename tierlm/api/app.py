"""The FastAPI application: routes, middleware, and the served model's life cycle."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tierlm.admin.access import Access, check_bind, redact_query
from tierlm.admin.dashboard import Dashboard
from tierlm.admin.dashboard import api as dashboard_api
from tierlm.admin.dashboard import router as dashboard_router
from tierlm.admin.logbuffer import QuietDashboardPolls
from tierlm.admin.metrics import ServerMetrics, make_registry
from tierlm.admin.metrics import router as metrics_router
from tierlm.admin.session import Sessions
from tierlm.api.anthropic.routes import router as anthropic_router
from tierlm.api.errors import error_response, install_error_handlers
from tierlm.api.model_routes import router as model_router
from tierlm.api.ollama.embed import router as ollama_embed_router
from tierlm.api.ollama.routes import router as ollama_router
from tierlm.api.openai.embeddings import router as embeddings_router
from tierlm.api.openai.routes import router as openai_router
from tierlm.api.rerank.routes import router as rerank_router
from tierlm.api.responses.routes import router as responses_router
from tierlm.config import Settings
from tierlm.engine import stages as request_stages
from tierlm.pool.enforcer import MemoryEnforcer
from tierlm.pool.pool import ModelPool
from tierlm.serving import prompt_pieces
from tierlm.serving.assembly import apply_settings, make_pool
from tierlm.serving.errors import APIError
from tierlm.serving.served_model import ServedModel
from tierlm.settings_watch import SettingsWatcher

log = logging.getLogger(__name__)


async def _load_default(app: FastAPI) -> None:
    """Load the default model (`--model`) at start; /health says loading until then."""
    pool: ModelPool = app.state.pool
    if pool.default is None:
        return
    try:
        slot = await pool.load(pool.default)
        settings: Settings = app.state.settings
        log.info("serving %s (context %d) at http://%s:%d/v1", slot.entry.name, slot.entry.context_length,
                 settings.host, settings.port)
    except Exception as e:
        log.exception("could not load %s", pool.default)
        app.state.load_error = f"{type(e).__name__}: {e}"


def _default_served(app: FastAPI) -> ServedModel | None:
    pool: ModelPool = app.state.pool
    return None if pool.default is None else pool.slots[pool.default].served


class QuietHealthProbes(logging.Filter):
    """Keeps /health out of uvicorn's access log: a load balancer or a supervisor
    polls it every few seconds, and those lines would bury the requests. Hides
    the values of key-like query parameters in the others."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn: (client, method, path, http version, status)
        if not (isinstance(args, tuple) and len(args) > 2):
            return True
        if str(args[2]).startswith("/health"):
            return False
        if "?" in str(args[2]):
            record.args = (*args[:2], redact_query(str(args[2])), *args[3:])
        return True


def create_app(settings: Settings, model_path: Path | None, watch: SettingsWatcher | None = None,
               lockstep=None) -> FastAPI:
    """The app serving `model_path` by default and every model the pool finds;
    `watch`: the settings file, whose changes apply while it runs; `lockstep`:
    rank 0's place when `model_path` runs over several ranks (tierlm.distributed)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # here, not at import: uvicorn configures its loggers before it starts the app
        access = logging.getLogger("uvicorn.access")
        if not any(isinstance(f, QuietHealthProbes) for f in access.filters):
            access.addFilter(QuietHealthProbes())
        if not any(isinstance(f, QuietDashboardPolls) for f in access.filters):
            access.addFilter(QuietDashboardPolls())
        app.state.dashboard.logs.attach()
        app.state.pool.start()
        enforcer = app.state.enforcer = MemoryEnforcer(
            app.state.pool, lambda: app.state.pool.current.settings.memory_marks_bytes())
        app.state.metrics.enforcer = enforcer
        enforcer.start()
        loading = asyncio.create_task(_load_default(app))
        # anyio loads its event-loop backend at its first use, a streamed
        # answer's (Starlette's StreamingResponse): ~8 ms of a process's first
        # request on the 2-core Xeon, an SSD hit's after a restart among them
        await anyio.sleep(0)
        await asyncio.to_thread(int)  # and the loop's thread pool, which renders and tokenizes prompts
        if watch is not None:
            watch.on_change = lambda new: _settings_changed(app, new)
            watch.start()
        yield
        if watch is not None:
            await watch.stop()
        await loading
        await enforcer.stop()
        await app.state.pool.close()
        await asyncio.to_thread(prompt_pieces.save_all)  # a restart tokenizes only what is new
        app.state.dashboard.logs.detach()

    app = FastAPI(title="tierlm", lifespan=lifespan)
    app.state.settings = settings
    app.state.pool = make_pool(settings, model_path, lockstep)
    app.state.load_error = None
    app.state.metrics = ServerMetrics(app.state.pool)
    app.state.metrics.watch()
    app.state.metrics_registry = make_registry(app.state.metrics)
    access = app.state.access = Access(settings.api_key, settings.admin_key, Sessions())
    log.info("access: %s", access.describe())
    app.state.dashboard = Dashboard(access, settings, watch)
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(embeddings_router)
    app.include_router(rerank_router)
    app.include_router(responses_router)
    app.include_router(anthropic_router)
    app.include_router(model_router)
    app.include_router(ollama_router)
    app.include_router(ollama_embed_router)
    app.include_router(metrics_router)
    app.include_router(dashboard_router)
    app.include_router(dashboard_api)

    app.add_middleware(RequestGate, settings=settings, access=access)

    @app.get("/health")
    async def health():
        served = _default_served(app)
        if app.state.load_error:
            return JSONResponse({"status": "error", "detail": app.state.load_error}, status_code=503)
        if served is None:
            if app.state.pool.default is None:  # no default model: models load when asked for
                return {"status": "ok", "model": None}
            return JSONResponse({"status": "loading"}, status_code=503)
        if not served.engine.is_alive:
            return JSONResponse({"status": "error", "detail": "engine loop stopped"}, status_code=503)
        if reason := served.engine.degraded:
            return JSONResponse({"status": "degraded", "detail": reason}, status_code=503)
        # ready; "warming": batch shapes are still being run once in the background;
        # "preloading": blocks are still being read back from the SSD tier (`ssd_preload`)
        return {"status": "ok", "model": served.info.name, "warming": served.engine.warming,
                "preloading": served.engine.preloading}

    @app.get("/v1/cache/stats")
    async def cache_stats():
        served = _ready(app)
        return {"model": served.info.name, "prefix_cache": await served.engine.cache_stats()}

    @app.delete("/v1/cache")
    async def clear_cache(ssd: bool = False):
        """Drop the hot tier; with ?ssd=true also this model's files in the SSD folder and its prompt pieces."""
        served = _ready(app)
        cleared = await served.engine.clear_cache(ssd)
        turns = getattr(served, "turns", None)  # an encoder's has none
        if ssd and turns is not None:  # the prompt pieces kept beside the blocks go too: they are the prompts' text
            await asyncio.to_thread(prompt_pieces.forget, turns.tokenizer)
        return {"cleared_blocks": cleared}

    @app.get("/stats")
    async def stats():
        pool: ModelPool = app.state.pool
        pool.refresh()  # a model pulled, copied in or deleted since
        loaded = [slot.served for slot in pool.slots.values() if slot.served is not None]
        return {"engines": [{**s.engine.get_stats(), "prompt_pieces": _pieces_stats(s)} for s in loaded],
                "models": pool.listing(),
                "budget_bytes": pool.budget_bytes, "used_bytes": pool.used_bytes()}

    return app


def _pieces_stats(served) -> dict | None:
    """A chat model's prompt pieces (prompt_pieces); None for an encoder's, which has no chat."""
    turns = getattr(served, "turns", None)
    return None if turns is None else prompt_pieces.stats_of(turns.tokenizer)


def _ready(app: FastAPI) -> ServedModel:
    served = _default_served(app)
    if served is None or not served.engine.is_alive:
        raise APIError(503, "the model is not ready yet", code="model_loading")
    return served


def _settings_changed(app: FastAPI, new: Settings) -> None:
    """The settings file changed: the models' settings (serving.assembly.apply_settings)
    and the keys take effect now. Keys that could not start a server (a key both
    an API and an admin key; no API key left on an address other than loopback,
    unless the server was started with --insecure-no-auth) are refused with an
    error in the log, and the keys in force stay."""
    apply_settings(app.state.pool, new)
    access: Access = app.state.access
    if (new.api_key, new.admin_key) == (access.api_entries, access.admin_entries):
        return
    started = app.state.settings  # where it listens was settled at start
    try:
        check_bind(started.host, new.api_key, started.insecure_no_auth)
        access.replace(new.api_key, new.admin_key)
    except ValueError as e:
        log.error("settings: the keys were not changed: %s", e)
        return
    log.info("access changed: %s", access.describe())


class RequestGate:
    """Keys (admin.access: who may call which route), body-size limit, and the
    last line against a bug: plain ASGI middleware, as Starlette's
    BaseHTTPMiddleware would hide client disconnects from the handlers."""

    def __init__(self, app, settings: Settings, access: Access | None = None):
        self.app, self.settings = app, settings
        self.access = access or Access(settings.api_key, settings.admin_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_stages.begin()
        request = Request(scope)
        rejection = self._check(request)
        if rejection is None and "content-length" not in request.headers:
            # a chunked body has no length to check up front: read it here, up to the limit
            receive, rejection = await self._read_capped(receive, request.url.path)
        if rejection is not None:
            return await rejection(scope, receive, send)
        await self._guarded(scope, receive, send)

    def _check(self, request: Request) -> JSONResponse | None:
        denied, key_name = self.access.check(request.method, request.url.path, request.headers)
        if key_name is not None:
            request.scope.setdefault("state", {})["key_name"] = key_name  # for whoever shows who asked
        if denied is not None:
            response = error_response(denied.status, denied.message, code=denied.code, path=request.url.path)
            if denied.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            return response
        limit = self.settings.max_body_bytes
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > limit:
            return error_response(413, f"request body of {size} bytes is over the {limit}-byte limit",
                                  code="request_too_large", path=request.url.path)
        return None

    async def _read_capped(self, receive, path: str):
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
                                               code="request_too_large", path=path)
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
        stages = request_stages.current()

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if stages.ends:  # a model's request: where its time went (a stream's: to the engine)
                    message["headers"] = [*message.get("headers", []),
                                          (b"server-timing", stages.server_timing().encode())]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            log.exception("unhandled error")
            if not started:
                response = error_response(500, f"internal error: {type(e).__name__}", code="internal_error",
                                          path=scope.get("path", ""))
                await response(scope, receive, send)
            else:  # mid-response: end it whole, at least
                await send({"type": "http.response.body", "body": b"", "more_body": False})

