"""/admin: the web dashboard (status, models, chat, benchmark, logs) and the JSON
endpoints under /admin/api it reads.

Every asset is a file of tierlm/admin/static, served here: no CDN, no build step.
Who may come in (admin.access): the admin key, or the session cookie the login
page opens with it (admin.session). With no key set at all the dashboard is
open, as every route then is, but only on a server listening on loopback; with
API keys and no admin key it is refused, as the other admin routes are.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import tempfile
import threading
import time
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response

from tierlm.admin.access import Access, _match, is_loopback, secret_of
from tierlm.admin.logbuffer import LogBuffer
from tierlm.admin.session import COOKIE, Sessions, cookie_value
from tierlm.admin.settings_file import EDITABLE, edit_model_section
from tierlm.pool.pool import ModelPool, PoolError, Slot
from tierlm.serving.errors import APIError
from tierlm.serving.leases import load_slot, slot_of, unload_slot

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
_SECURITY_HEADERS = {
    # everything comes from here; inline scripts are not used
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                               "script-src 'self'; connect-src 'self'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
BENCH_LIMITS = {"concurrency": 8, "max_tokens": 256, "requests": 16}


class Dashboard:
    """What the dashboard keeps in the server: logins, the log's tail, import and
    benchmark jobs."""

    def __init__(self, access: Access, settings, watch=None):
        self.access, self.settings, self.watch = access, settings, watch
        self.sessions: Sessions = access.sessions
        self.logs = LogBuffer()
        self.jobs: dict[str, dict] = {}
        self._ids = itertools.count(1)
        self._settings_lock = asyncio.Lock()
        self.bench_running = False

    def job(self, kind: str, **fields) -> dict:
        job_id = f"{kind}-{next(self._ids)}"
        self.jobs[job_id] = job = {"id": job_id, "kind": kind, "state": "running", "error": None,
                                   "started": time.time(), **fields}
        while len(self.jobs) > 20:  # the oldest finished ones go
            done = [k for k, j in self.jobs.items() if j["state"] != "running"]
            if not done:
                break
            del self.jobs[done[0]]
        return job


def _dash(http: HTTPRequest) -> Dashboard:
    return http.app.state.dashboard


def _pool(http: HTTPRequest) -> ModelPool:
    return http.app.state.pool


def allowed(http: HTTPRequest) -> None:
    """No key at all and a server open beyond loopback (--insecure-no-auth): no dashboard."""
    dash = _dash(http)
    if not dash.access.enabled and not is_loopback(dash.settings.host):
        raise APIError(403, "the dashboard needs an admin key on a server that listens beyond loopback: "
                            "start it with --admin-key", code="admin_key_not_set")


router = APIRouter(prefix="/admin", dependencies=[Depends(allowed)])
api = APIRouter(prefix="/admin/api", dependencies=[Depends(allowed)])


# ---- pages, login ---------------------------------------------------------------

def _page(name: str) -> Response:
    return FileResponse(STATIC / name, media_type=_TYPES[Path(name).suffix], headers=_SECURITY_HEADERS)


@router.get("")
@router.get("/")
async def dashboard_page(http: HTTPRequest):
    denied, _ = _dash(http).access.check("GET", "/admin/api/status", http.headers)
    if denied is not None:
        return RedirectResponse("/admin/login", status_code=303)
    return _page("index.html")


@router.get("/login")
async def login_page():
    return _page("login.html")


@router.get("/static/{name}")
async def static_file(name: str):
    path = STATIC / name
    if Path(name).suffix not in _TYPES or not path.is_file() or path.parent != STATIC:
        raise APIError(404, "no such file", code="not_found")
    return _page(name)


@router.post("/login")
async def login(http: HTTPRequest):
    dash = _dash(http)
    access = dash.access
    try:
        body = await http.json()
        key = body["key"] if isinstance(body, dict) and isinstance(body.get("key"), str) else ""
    except ValueError:
        key = ""
    if not access.enabled:
        return {"ok": True, "open": True, "detail": "no key is set: the dashboard is open on loopback"}
    if not access.admin:
        raise APIError(403, "no admin key is set: start the server with --admin-key to use the dashboard",
                       code="admin_key_not_set")
    admin = _match(key, access.admin) if key else None
    if admin is None:
        await asyncio.sleep(0.5)  # guessing costs time
        if key and _match(key, access.api):
            raise APIError(403, "that is an API key; the dashboard needs the admin key", code="admin_key_required")
        raise APIError(401, "wrong admin key", code="invalid_api_key")
    log.info("dashboard: %s logged in", admin.name)
    response = JSONResponse({"ok": True, "key_name": admin.name})
    response.set_cookie(COOKIE, dash.sessions.issue(admin.name), max_age=int(dash.sessions.lifetime_s),
                        path="/", httponly=True, samesite="strict", secure=http.url.scheme == "https")
    return response


@router.post("/logout")
async def logout(http: HTTPRequest):
    dash = _dash(http)
    token = cookie_value(http.headers.get("cookie", ""))
    if token is not None:
        dash.sessions.revoke(token)
    response = JSONResponse({"ok": True})
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response


@api.get("/whoami")
async def whoami(http: HTTPRequest):
    return {"key_name": http.scope.get("state", {}).get("key_name"), "open": not _dash(http).access.enabled}


# ---- status -------------------------------------------------------------------------

@api.get("/status")
async def status(http: HTTPRequest):
    """What the status page draws: cumulative counters (the page turns two polls
    into rates), the load of each engine, memory and the caches by tier."""
    app, pool = http.app, _pool(http)
    metrics = app.state.metrics
    totals = metrics.counters()
    engines = []
    for name, slot in sorted(pool.slots.items()):
        served = slot.served
        if served is None or served.engine.scheduler is None:  # not loaded, or an encoder
            continue
        scheduler = served.engine.scheduler
        counts = totals.get(name, {})
        record = metrics.models.get(name)
        cache = scheduler.cache
        tiers = {}
        if cache is not None:
            tiers["hot"] = {"blocks": len(cache.hot), "bytes": cache.hot.nbytes, "capacity_bytes": cache.hot.capacity,
                            "hit_tokens": counts.get("cache_hits|hot", 0)}
            if cache.ssd is not None:
                ssd = cache.ssd.snapshot_stats()
                tiers["ssd"] = {"blocks": ssd["files"], "bytes": ssd["bytes"], "capacity_bytes": ssd["capacity_bytes"],
                                "hit_tokens": counts.get("cache_hits|ssd", 0)}
        engines.append({
            "model": name,
            **scheduler.load,
            "alive": served.engine.is_alive,
            "degraded": served.engine.degraded,
            "generated_tokens": counts.get("generation_tokens", 0),
            "prompt_tokens": counts.get("prompt_tokens", 0),
            "ttft_sum_s": record.ttft.buckets()[1] if record else 0.0,
            "ttft_count": record.ttft.count if record else 0,
            "cache_lookup_tokens": counts.get("cache_queries", 0),
            "cache": tiers,
        })
    process = marks = None
    enforcer = getattr(app.state, "enforcer", None)
    if enforcer is not None:
        try:
            process = enforcer.read_memory()
            marks = pool.current.settings.memory_marks_bytes()
        except Exception:  # noqa: BLE001 (a status page shows what it can)
            process = None
    return {
        "time": time.time(),
        "engines": engines,
        "models": pool.listing(),
        "memory": {"budget_bytes": pool.budget_bytes, "used_bytes": pool.used_bytes(), "process_bytes": process,
                   "soft_mark_bytes": marks[0] if marks else None, "hard_mark_bytes": marks[1] if marks else None,
                   "paused": pool.paused},
        "running": sum(e.get("running", 0) for e in engines),
        "waiting": sum(e.get("waiting", 0) for e in engines),
    }


# ---- models -------------------------------------------------------------------------

def _model(http: HTTPRequest, slot: Slot) -> dict:
    pool = _pool(http)
    entry = slot.entry
    listed = pool.describe(slot)
    own = pool.current.settings.for_model(entry.name)
    return {
        **listed,
        "quantization": entry.quantization,
        "model_type": getattr(entry, "model_type", None),
        "default": entry.name == pool.default,
        "pinned": slot.pinned,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k in EDITABLE if (v := getattr(own, k)) is not None},
    }


@api.get("/models")
async def models(http: HTTPRequest):
    dash = _dash(http)
    _pool(http).refresh()  # a model pulled, copied in or deleted since
    return {"models": [_model(http, slot) for _, slot in sorted(_pool(http).slots.items())],
            "settings_file": str(dash.watch.path) if dash.watch else None}


@api.post("/models/{name:path}/load")
async def load(name: str, http: HTTPRequest):
    slot = slot_of(http.app.state.pool, name)
    await load_slot(http.app.state.pool, slot)
    return _model(http, slot)


@api.post("/models/{name:path}/unload")
async def unload(name: str, http: HTTPRequest, force: bool = False):
    slot = slot_of(http.app.state.pool, name)
    await unload_slot(http.app.state.pool, slot, force)
    return _model(http, slot)


async def _body(http: HTTPRequest) -> dict:
    try:
        body = await http.json()
    except ValueError as e:
        raise APIError(400, "the body is not JSON", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


async def _write_settings(http: HTTPRequest, model: str, changes: dict) -> dict:
    dash = _dash(http)
    if dash.watch is None:
        raise APIError(409, "this server has no settings file to write", code="no_settings_file")
    async with dash._settings_lock:
        try:
            section = await asyncio.to_thread(edit_model_section, dash.watch.path, model, changes, dash.watch.cli)
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_setting") from e
        dash.watch.check()  # apply it now rather than at the watcher's next look
    log.info("dashboard: settings of %s written to %s: %s", model, dash.watch.path, sorted(changes))
    return section


@api.put("/models/{name:path}/settings")
async def model_settings(name: str, http: HTTPRequest):
    """Per-model settings (EDITABLE), written into the settings file's
    [models."NAME"] section; null or "" removes one."""
    slot = slot_of(http.app.state.pool, name)
    body = await _body(http)
    aliases = body.get("aliases")
    if isinstance(aliases, str):
        body["aliases"] = [a.strip() for a in aliases.split(",") if a.strip()]
    section = await _write_settings(http, slot.entry.name, body)
    overridden = sorted(set(body) & set(_pool(http).current.settings._overridden))
    return {**_model(http, slot), "written": section, "overridden_by_command_line": overridden}


@api.post("/models/{name:path}/pin")
async def pin(name: str, http: HTTPRequest):
    """{"pinned": true}: kept loaded (loaded now), saved in the settings file."""
    slot = slot_of(http.app.state.pool, name)
    pinned = bool((await _body(http)).get("pinned", True))
    await _write_settings(http, slot.entry.name, {"pinned": True if pinned else None})
    if pinned and slot.served is None:
        await load_slot(http.app.state.pool, slot)
    return _model(http, slot)


# ---- GGUF import --------------------------------------------------------------------

@api.post("/import")
async def import_gguf_file(http: HTTPRequest):
    """{"path": a .gguf file on the server, "name": the model's name, "bits": 4/8/16}:
    imported into the model folder in a thread; GET /admin/api/import/{id} reports."""
    from tierlm.models.model_folder import is_model_folder

    body = await _body(http)
    source = Path(str(body.get("path", ""))).expanduser()
    if source.suffix.lower() != ".gguf" or not source.is_file():
        raise APIError(400, f"no .gguf file at {source}", "path", "not_found")
    name = str(body.get("name") or source.stem)
    if not name or "/" in name or name.startswith("."):
        raise APIError(400, f"not a model name: {name!r}", "name", "invalid_name")
    bits = body.get("bits")
    if bits is not None and bits not in (4, 8, 16):
        raise APIError(400, "bits: 4, 8 or 16", "bits", "invalid_bits")
    model_dir = Path(_pool(http).current.settings.model_dir).expanduser()
    target = model_dir / name
    if is_model_folder(target):
        raise APIError(409, f"{target} already exists", "name", "model_exists")
    job = _dash(http).job("import", source=str(source), name=name, stage="starting", done=0, total=0)
    loop = asyncio.get_running_loop()

    def run() -> None:
        from tierlm.models.default_model import _publish
        from tierlm.models.gguf_import import import_gguf

        def report(stage: str, done: int, total: int) -> None:
            job.update(stage=stage, done=done, total=total)

        try:
            model_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=model_dir, prefix=".import-") as tmp:
                built = import_gguf(source, Path(tmp) / name, report, **({"bits": bits} if bits else {}))
                _publish(built, target)
            job.update(state="done", stage="done")
            loop.call_soon_threadsafe(_found, http.app, name)
        except Exception as e:
            log.exception("import of %s failed", source)
            job.update(state="failed", error=f"{type(e).__name__}: {e}")

    threading.Thread(target=run, name="gguf-import", daemon=True).start()
    log.info("dashboard: importing %s as %s", source, name)
    return job


def _found(app, name: str) -> None:
    try:
        app.state.pool.resolve(name)  # an unknown name looks in the model folders again
    except PoolError:
        log.warning("imported %s, but the model folders do not list it", name)


@api.get("/import/{job_id}")
async def import_progress(job_id: str, http: HTTPRequest):
    return _get_job(http, job_id)


def _get_job(http: HTTPRequest, job_id: str) -> dict:
    job = _dash(http).jobs.get(job_id)
    if job is None:
        raise APIError(404, f"no job {job_id}", code="not_found")
    return job


# ---- benchmark ------------------------------------------------------------------------

@api.post("/bench")
async def bench(http: HTTPRequest):
    """{"model", "concurrencies": [1, 2, 4], "max_tokens": 32, "requests": 4 per
    concurrency}: the built-in load generator (tierlm.loadgen.client) against this
    server's own address, one concurrency after another; GET /admin/api/bench/{id}
    reports tok/s and TTFT per concurrency as each ends."""
    dash = _dash(http)
    body = await _body(http)
    slot = slot_of(http.app.state.pool, str(body.get("model") or "default"))
    try:
        levels = [int(c) for c in body.get("concurrencies", [1, 2, 4])]
        max_tokens, per = int(body.get("max_tokens", 32)), int(body.get("requests", 4))
    except (TypeError, ValueError) as e:
        raise APIError(400, "concurrencies: a list of numbers; max_tokens, requests: numbers",
                       code="invalid_request") from e
    if not levels or len(levels) > 6 or not all(1 <= c <= BENCH_LIMITS["concurrency"] for c in levels):
        raise APIError(400, f"concurrencies: 1 to 6 values of 1..{BENCH_LIMITS['concurrency']}", "concurrencies")
    if not 1 <= max_tokens <= BENCH_LIMITS["max_tokens"] or not 1 <= per <= BENCH_LIMITS["requests"]:
        raise APIError(400, f"max_tokens: 1..{BENCH_LIMITS['max_tokens']}, requests: 1..{BENCH_LIMITS['requests']}",
                       "max_tokens")
    if dash.bench_running:
        raise APIError(409, "a benchmark is running already", code="busy")
    host, port = http.scope.get("server") or ("127.0.0.1", dash.settings.port)
    host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    key = secret_of(dash.settings.admin_key[0]) if dash.settings.admin_key else None
    job = dash.job("bench", model=slot.entry.name, concurrencies=levels, max_tokens=max_tokens, requests=per,
                   results=[])
    dash.bench_running = True
    task = asyncio.create_task(_run_bench(dash, job, base, key))
    job_tasks.add(task)
    task.add_done_callback(job_tasks.discard)
    log.info("dashboard: benchmark of %s at concurrencies %s", slot.entry.name, levels)
    return job


job_tasks: set[asyncio.Task] = set()
_PROMPT = "Write a short story about a lighthouse keeper and a storm. Number {i}."


async def _run_bench(dash: Dashboard, job: dict, base: str, key: str | None) -> None:
    from tierlm.loadgen.client import LoadConfig, run_load
    from tierlm.loadgen.metrics import summarize
    from tierlm.loadgen.workloads import BenchRequest, Workload

    try:
        for c in job["concurrencies"]:
            n = max(c, job["requests"])
            sessions = [[BenchRequest(job["max_tokens"], messages=[{"role": "user", "content": _PROMPT.format(i=i)}])]
                        for i in range(n)]
            cfg = LoadConfig(base_url=base, model=job["model"], concurrency=c, api_key=key, timeout_s=120)
            records, duration = await run_load(Workload(f"dashboard c={c}", sessions), cfg)
            s = summarize(records, duration)
            job["results"].append({"concurrency": c, "requests": s["requests"], "failed": s["failed"],
                                   "errors": s["errors"], "output_tok_s": _num(s["output_tok_s"]),
                                   "ttft_mean_s": _num(s["ttft_s"].get("mean")),
                                   "ttft_p50_s": _num(s["ttft_s"].get("p50")),
                                   "duration_s": _num(duration)})
        job["state"] = "done"
    except Exception as e:
        log.exception("dashboard benchmark failed")
        job.update(state="failed", error=f"{type(e).__name__}: {e}")
    finally:
        dash.bench_running = False


def _num(x) -> float | None:
    return None if x is None or math.isnan(x) else round(float(x), 4)


@api.get("/bench/{job_id}")
async def bench_progress(job_id: str, http: HTTPRequest):
    return _get_job(http, job_id)


# ---- logs -----------------------------------------------------------------------------

@api.get("/logs")
async def logs(http: HTTPRequest, after: int = 0):
    lines, newest = _dash(http).logs.after(after)
    return {"lines": lines, "next": newest}
