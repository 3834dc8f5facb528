"""The dashboard's login: a signed, HTTP-only session cookie that stands for the
admin key it was opened with.

The cookie holds `expiry.nonce.keyname` and an HMAC-SHA256 of it under a secret
drawn at random when the server starts (a restart logs everyone out; the admin
key itself is never in the cookie, in a page, or in anything JavaScript can
read). It is HttpOnly, SameSite=Strict and Path=/ (the chat page calls /v1 with
it); logging out forgets its nonce, so a copy of the cookie stops working too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading
import time
from http.cookies import CookieError, SimpleCookie

COOKIE = "tierlm_session"
LIFETIME_S = 12 * 3600


class Sessions:
    def __init__(self, lifetime_s: float = LIFETIME_S, secret: bytes | None = None):
        self.lifetime_s = lifetime_s
        self._secret = secret or secrets.token_bytes(32)
        self._revoked: dict[str, float] = {}  # nonce -> its expiry (kept until then)
        self._lock = threading.Lock()

    def end_all(self) -> None:
        """Every session issued so far is refused from now on (a new signing secret)."""
        with self._lock:
            self._secret = secrets.token_bytes(32)

    def issue(self, key_name: str) -> str:
        payload = f"{int(time.time() + self.lifetime_s)}.{secrets.token_urlsafe(16)}.{key_name}"
        return _b64(payload.encode()) + "." + _b64(self._sign(payload))

    def verify(self, token: str) -> str | None:
        """The admin key's name the token was issued for, or None (forged, expired, logged out)."""
        opened = self._open(token)
        if opened is None:
            return None
        expiry, nonce, name = opened
        if float(expiry) < time.time():
            return None
        with self._lock:
            if nonce in self._revoked:
                return None
        return name

    def revoke(self, token: str) -> None:
        if self.verify(token) is None:
            return
        expiry, nonce, _ = self._open(token)
        now = time.time()
        with self._lock:
            self._revoked = {n: e for n, e in self._revoked.items() if e > now}
            self._revoked[nonce] = float(expiry)

    def _open(self, token: str) -> tuple[str, str, str] | None:
        """(expiry, nonce, key name) of a token signed here, else None."""
        encoded, _, signature = token.partition(".")
        try:
            payload = _unb64(encoded).decode()
            given = _unb64(signature)
        except (ValueError, UnicodeDecodeError):
            return None
        if not hmac.compare_digest(given, self._sign(payload)):
            return None
        expiry, nonce, name = payload.split(".", 2)
        return expiry, nonce, name

    def from_headers(self, headers) -> str | None:
        """The key name of the request's session cookie, if it has a valid one."""
        token = cookie_value(headers.get("cookie", ""))
        return None if token is None else self.verify(token)

    def _sign(self, payload: str) -> bytes:
        return hmac.new(self._secret, payload.encode(), hashlib.sha256).digest()


def cookie_value(header: str) -> str | None:
    if COOKIE not in header:
        return None
    try:
        jar = SimpleCookie(header)
    except CookieError:
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
