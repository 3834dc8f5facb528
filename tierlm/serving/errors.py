"""The error a request gets, whatever API it came by: an HTTP status, a message,
the field it names and a code. Each API writes it in its own shape
(tierlm/api/errors.py); the dashboard and the Python API raise it too."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
