"""Claude Code and Codex CLI, installed from npm for test_agents. On a fresh
machine that is a minute of downloads, so the install starts in the background
when the run starts (conftest) and test_agents runs last, by which time it is
done; npm's own failure is shown by installing again in the foreground."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

# versions tested
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"
AGENTS_DIR = Path(os.environ.get("TIERLM_TEST_AGENTS_DIR", Path.home() / ".cache" / "tierlm-tests" / "agents"))
_background: subprocess.Popen | None = None


def _command() -> list[str] | None:
    npm = shutil.which("npm")
    if npm is None:
        return None
    return [npm, "install", "--prefix", str(AGENTS_DIR), "--no-audit", "--no-fund", "--loglevel=error",
            CLAUDE_CODE, CODEX]


def start() -> None:
    """The install, started in the background (a no-op where npm is missing)."""
    global _background
    command = _command()
    if command is None or _background is not None:
        return
    AGENTS_DIR.mkdir(parents=True, exist_ok=True)
    with open(AGENTS_DIR / "install.log", "wb") as log:
        _background = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def installed() -> Path:
    """The folder of the agents' commands, once installed (a skip where npm is missing)."""
    command = _command()
    if command is None:
        pytest.skip("npm is missing: Claude Code and Codex CLI install from npm")
    if _background is None or _background.wait(timeout=900) != 0:
        AGENTS_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run(command, check=True, timeout=900)
    return AGENTS_DIR / "node_modules" / ".bin"
