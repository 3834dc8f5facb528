"""The settings file read again while the server runs: a change reaches the
callback, a broken file is reported once and changes nothing until it is fixed,
and the environment and command line still win over the file."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from tierlm.config import env_var, setting_fields
from tierlm.settings_watch import SettingsWatcher

GOOD = '[models."qwen"]\naliases = ["fast"]\npinned = false\nkeep_alive = "5m"\n'
CHANGED = '[models."qwen"]\naliases = ["fast", "claude-*"]\npinned = true\nkeep_alive = "-1"\n'


@pytest.fixture
def settings_file(monkeypatch, tmp_path):
    for f in setting_fields():
        monkeypatch.delenv(env_var(f.name), raising=False)
    path = tmp_path / "settings.toml"
    path.write_text(GOOD)
    return path


def rewrite(path, text: str) -> None:
    """Write and move the mtime on, so that a coarse clock still shows a change."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_a_change_reaches_the_callback(settings_file):
    seen = []
    watcher = SettingsWatcher(settings_file, seen.append)
    assert watcher.check() is None and seen == []  # unchanged since start

    rewrite(settings_file, CHANGED)
    new = watcher.check()
    qwen = seen[0].for_model("qwen")
    assert new is seen[0] and len(seen) == 1
    assert qwen.aliases == ("fast", "claude-*") and qwen.pinned and qwen.keep_alive_s() is None
    assert seen[0].model_for_alias("claude-haiku", ["qwen"]) == "qwen"
    assert watcher.check() is None and len(seen) == 1  # once per change


@pytest.mark.parametrize("garbage", ["[models.\n", 'no_such = 1\n', '[models."qwen"]\nkeep_alive = "soon"\n'])
def test_a_broken_file_is_reported_once_and_the_fix_applies(settings_file, garbage, caplog):
    seen = []
    watcher = SettingsWatcher(settings_file, seen.append)
    rewrite(settings_file, garbage)
    with caplog.at_level(logging.ERROR, logger="tierlm.settings"):
        assert watcher.check() is None
        assert watcher.check() is None
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert seen == [] and len(errors) == 1 and str(settings_file) in errors[0].getMessage()
    assert watcher.error and str(settings_file) in watcher.error

    rewrite(settings_file, CHANGED)
    watcher.check()
    assert len(seen) == 1 and seen[0].for_model("qwen").pinned and watcher.error is None


def test_the_environment_and_command_line_still_win(settings_file, monkeypatch):
    monkeypatch.setenv("TIERLM_KEEP_ALIVE", "30s")
    seen = []
    watcher = SettingsWatcher(settings_file, seen.append, cli={"port": 9001, "hf_cache": None})
    rewrite(settings_file, "port = 8080\nhf_cache = false\n" + CHANGED)
    watcher.check()
    assert seen[0].port == 9001 and not seen[0].hf_cache
    assert seen[0].for_model("qwen").keep_alive_s() == 30.0 and seen[0].for_model("qwen").pinned


def test_the_watcher_polls_on_the_event_loop(settings_file):
    async def main():
        changed = asyncio.Event()
        seen = []
        watcher = SettingsWatcher(settings_file, lambda s: (seen.append(s), changed.set()), interval_s=0.02)
        watcher.start()
        rewrite(settings_file, CHANGED)
        await asyncio.wait_for(changed.wait(), 5)
        await watcher.stop()
        return seen

    seen = asyncio.run(main())
    assert len(seen) == 1 and seen[0].for_model("qwen").aliases == ("fast", "claude-*")
