"""The tail of the server log for the dashboard: a logging handler that keeps the
last lines in memory, each with a sequence number a page polls after."""

from __future__ import annotations

import logging
import threading
from collections import deque

LINES = 2000
# the dashboard's own polling, kept out of the access log (as /health is)
POLLED = ("/admin/api/status", "/admin/api/logs", "/admin/api/bench", "/admin/api/import")


class LogBuffer(logging.Handler):
    def __init__(self, size: int = LINES):
        super().__init__(logging.INFO)
        self.lines: deque[tuple[int, str]] = deque(maxlen=size)
        self.seq = 0
        self._guard = threading.Lock()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # noqa: BLE001 (a bad log call must not fail the caller)
            return
        with self._guard:
            self.seq += 1
            self.lines.append((self.seq, text))

    def after(self, seq: int, limit: int = 500) -> tuple[list[dict], int]:
        """The lines after `seq` (the last `limit` of them), and the newest seq."""
        with self._guard:
            lines = [{"seq": s, "text": t} for s, t in self.lines if s > seq]
            newest = self.seq
        return lines[-limit:], newest

    def attach(self) -> None:
        """On the root logger and uvicorn's (which do not propagate to it); again
        after uvicorn configured its loggers is fine: attaching twice does nothing."""
        for name in ("", "uvicorn", "uvicorn.access"):
            logger = logging.getLogger(name)
            if self not in logger.handlers:
                logger.addHandler(self)

    def detach(self) -> None:
        for name in ("", "uvicorn", "uvicorn.access"):
            logging.getLogger(name).removeHandler(self)


class QuietDashboardPolls(logging.Filter):
    """Keeps the dashboard's polls (a GET every second or two) out of the access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and args[1] == "GET":
            return not str(args[2]).startswith(POLLED)
        return True
