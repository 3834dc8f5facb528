"""Where a request's time goes before its first token: the stages each response
names in its Server-Timing header, and their medians in /stats."""

from __future__ import annotations

import time

import httpx

from tierlm.engine.stages import STAGES, StageLog, Stages

BEFORE_ENGINE = ["read", "model", "template", "tokenize", "grammar"]


def _timing(header: str) -> dict[str, float]:
    """`read;dur=0.4, template;dur=1.2` as {"read": 0.4, "template": 1.2}."""
    out = {}
    for entry in header.split(","):
        name, dur = entry.strip().split(";dur=")
        out[name] = float(dur)
    return out


def test_a_whole_answer_names_every_stage_to_its_first_token(server):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3}
    r = httpx.post(server.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    timing = _timing(r.headers["server-timing"])
    # in order; a stream's deliver stage is the stream's own
    assert list(timing) == [s for s in STAGES if s != "deliver"]
    assert all(ms >= 0 for ms in timing.values())
    assert timing["prefill"] > 0  # the model ran


def test_a_stream_names_the_stages_before_the_engine_and_stats_has_the_rest(server):
    body = {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        timing = _timing(r.headers["server-timing"])  # sent before the first token
        r.read()
    assert list(timing) == BEFORE_ENGINE
    stages = server.stats()["request_stages"]
    assert list(stages["last"]) == list(STAGES)  # this stream's, to its first token reaching the stream
    assert stages["requests"] >= 1
    for stage in STAGES:
        assert 0 <= stages[stage]["p50_ms"] <= stages[stage]["p90_ms"]


def test_a_text_completion_has_no_template_stage(server):
    r = httpx.post(server.v1 + "/completions", json={"prompt": "One, two,", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200
    timing = _timing(r.headers["server-timing"])
    assert "template" not in timing and "tokenize" in timing and "prefill" in timing


def test_stages_run_from_the_last_one_marked_and_a_stage_marked_again_counts_its_last_end():
    stages = Stages()
    stages.mark("read")
    stages.mark("queue")
    time.sleep(0.01)
    stages.mark("queue")  # queued again: it waited for another request's prefix
    stages.mark("prefill")
    seconds = stages.seconds()
    assert list(seconds) == ["read", "queue", "prefill"]  # STAGES' order, the unmarked left out
    assert seconds["queue"] >= 0.01 > seconds["prefill"]
    assert stages.server_timing().startswith("read;dur=")


def test_the_log_keeps_the_last_requests_and_reads_them_when_asked():
    log = StageLog(size=3)
    for _ in range(5):
        stages = Stages()
        stages.mark("read")
        log.add(stages)
    stages.mark("prefill")  # marked after it was added: a stream's deliver is
    summary = log.summary()
    assert summary["requests"] == 3
    assert summary["read"]["requests"] == 3 and summary["prefill"]["requests"] == 1
    assert set(summary["last"]) == {"read", "prefill"}


def test_the_app_loads_what_a_first_streamed_answer_would_at_its_start():
    """anyio's event-loop backend (a streamed answer's task group loads it on
    first use: ~8 ms of a process's first request) and the loop's thread pool
    are there once the app has started, before any request: in a process of
    its own, which has loaded neither."""
    script = """
import asyncio, sys
from tierlm.api.app import create_app
from tierlm.config import Settings

async def main():
    app = create_app(Settings(ssd_cache=False), None)
    before = "anyio._backends._asyncio" in sys.modules, asyncio.get_running_loop()._default_executor is not None
    async with app.router.lifespan_context(app):
        after = "anyio._backends._asyncio" in sys.modules, asyncio.get_running_loop()._default_executor is not None
    print(before, after)

asyncio.run(main())
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "(False, False) (True, True)"
