"""Hot reload of the settings file: when it changes, read it again (under the same
environment and command line as at start) and hand the new Settings on; a file
that does not parse is reported once and the last good settings stay in force."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from tierlm.config import Settings, load_settings

log = logging.getLogger("tierlm.settings")


class SettingsWatcher:
    """`check()` compares the file's (mtime, size, inode) with the last look;
    `start()` runs it every `interval_s` on the event loop."""

    def __init__(self, path: str | Path, on_change: Callable[[Settings], object], *,
                 cli: dict | None = None, interval_s: float = 1.0):
        self.path = Path(path)
        self.on_change = on_change
        self.cli = cli
        self.interval_s = interval_s
        self.error: str | None = None  # the current file's problem, None while it is good
        self._seen = self._signature()  # the file as it was when the server read it at start
        self._task: asyncio.Task | None = None

    def _signature(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def check(self) -> Settings | None:
        """The new Settings when the file changed and reads well (after calling
        `on_change` with them); None otherwise."""
        signature = self._signature()
        if signature == self._seen:
            return None
        self._seen = signature  # a bad file is reported once, not every second
        try:
            settings = load_settings(self.cli, str(self.path))
        except (OSError, ValueError) as e:
            self.error = str(e)
            log.error("settings file not applied, the last good settings stay: %s", e)
            return None
        self.error = None
        log.info("settings file %s changed: applying it", self.path)
        self.on_change(settings)
        return settings

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:  # a failing callback must not end the watching
                log.exception("applying the changed settings failed")

    def start(self) -> asyncio.Task:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="settings-watch")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
