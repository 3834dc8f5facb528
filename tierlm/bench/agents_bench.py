"""A coding agent's session against tierlm: Claude Code, whole (its own system
prompt and every tool it sends), `turns` turns of one conversation (`claude -p`,
then `claude -p --continue`), on one model. For each turn: its wall time as the
agent sees it, and the prompt tokens the server computed and read from its
prefix cache, as the server reported them to the agent (Claude Code's JSON
result). The figure of merit: the share of prompt tokens read from cache on
turns 2..N (each turn resends everything before it).

The server gets a settings file that maps Claude Code's model names to the
model, and, for a base model, greedy sampling and a stop string at the end of
a line (Gemma 3 270M here is one: its answers end nowhere else). Claude Code
comes from npm (tests install it in ~/.cache/tierlm-tests/agents).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tierlm.bench.report import cpu_flags
from tierlm.bench.servers import RunningServer, ServerSpec

KEY = "bench-agents-key"
PROMPTS = ["Say hello in one short sentence.", "What is 2 + 2?", "Thank you.", "Name a colour.",
           "Name a fruit.", "What day comes after Monday?", "Say goodbye.", "Name an animal.",
           "What is the capital of France?", "One more word, please."]
TESTS_AGENTS = Path.home() / ".cache" / "tierlm-tests" / "agents" / "node_modules" / ".bin"


@dataclass
class AgentsBenchConfig:
    model: Path
    claude: Path
    turns: int = 10
    max_output_tokens: int = 200  # Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS
    stop: str = "\n"  # the model's default stop string ("" for none: an instruct model)
    tools: str | None = None  # Claude Code's --tools; None: all of its own


def find_claude() -> Path | None:
    found = shutil.which("claude")
    if found:
        return Path(found)
    return TESTS_AGENTS / "claude" if (TESTS_AGENTS / "claude").exists() else None


def _server(cfg: AgentsBenchConfig, work: Path) -> RunningServer:
    settings = [f'[models."{cfg.model.name}"]', 'aliases = ["claude-*"]', "default_temperature = 0"]
    if cfg.stop:
        settings.append(f"default_stop = [{json.dumps(cfg.stop)}]")
    (work / "settings.toml").write_text("\n".join(settings) + "\n")
    cmd = [sys.executable, "-m", "tierlm.cli", "serve", "--model", str(cfg.model), "--port", "{port}",
           "--config", str(work / "settings.toml"), "--api-key", KEY, "--model-dir", str(work / "models"),
           "--no-hf-cache", "--ssd-cache-dir", str(work / "ssd"), "--log-level", "warning"]
    (work / "models").mkdir()
    return RunningServer(ServerSpec("tierlm", cmd, ready_path="/health"), log_dir=work).start(600)


def _turn(cfg: AgentsBenchConfig, srv: RunningServer, home: Path, prompt: str, first: bool) -> dict:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
           "ANTHROPIC_BASE_URL": srv.base_url, "ANTHROPIC_API_KEY": KEY,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(cfg.max_output_tokens), "DISABLE_AUTOUPDATER": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    cmd = [str(cfg.claude), "-p", prompt, "--output-format", "json"]
    cmd += [] if first else ["--continue"]
    cmd += [] if cfg.tools is None else ["--tools", cfg.tools]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=home / "project", capture_output=True, text=True, timeout=3600,
                          check=False)
    wall = time.perf_counter() - start
    result = json.loads(done.stdout.strip().splitlines()[-1])
    usage = result.get("usage") or {}
    computed, cached = usage.get("input_tokens", 0), usage.get("cache_read_input_tokens", 0)
    return {"wall_s": round(wall, 2), "ok": not result.get("is_error"), "requests": result.get("num_turns"),
            "prompt_tokens": computed + cached, "cached_tokens": cached, "answer": str(result.get("result"))[:80]}


def run_agents_bench(cfg: AgentsBenchConfig, on_progress=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="tierlm-bench-agents-") as tmp:
        work = Path(tmp)
        (work / "home" / "project").mkdir(parents=True)
        srv = _server(cfg, work)
        try:
            turns = []
            for i in range(cfg.turns):
                turns.append(_turn(cfg, srv, work / "home", PROMPTS[i % len(PROMPTS)], i == 0))
                on_progress(f"turn {i + 1}: {turns[-1]}")
        finally:
            srv.stop()
    later = turns[1:]
    share = sum(t["cached_tokens"] for t in later) / max(1, sum(t["prompt_tokens"] for t in later))
    return {"model": cfg.model.name, "claude": _version(cfg.claude), "cpu_flags": cpu_flags(),
            "tools": cfg.tools or "all", "turns": turns, "cached_share_after_first": round(share, 4)}


def _version(claude: Path) -> str:
    done = subprocess.run([str(claude), "--version"], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def print_table(result: dict) -> None:
    from rich.table import Table

    from tierlm.bench.report import console

    table = Table(title=f"{result['claude']} on {result['model']} ({result['cpu_flags']}), tools: {result['tools']}")
    for column in ("turn", "wall s", "ok", "requests", "prompt tokens", "from cache", "share"):
        table.add_column(column, justify="right")
    for i, t in enumerate(result["turns"], 1):
        share = t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0
        table.add_row(str(i), f"{t['wall_s']:.1f}", "yes" if t["ok"] else "no", str(t["requests"]),
                      str(t["prompt_tokens"]), str(t["cached_tokens"]), f"{share:.1%}")
    console.print(table)
    console.print(f"prompt tokens read from cache on turns 2..{len(result['turns'])}: "
                  f"{result['cached_share_after_first']:.1%}")
