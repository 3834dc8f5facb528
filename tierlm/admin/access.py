"""Who may call what: API keys for the /v1 routes, an admin key for the routes
that change the server (load, unload, clear the cache), its dashboard and its
monitoring (/metrics, /stats).

A key is given as KEY or NAME:KEY (`--api-key alice:sk-1,bob:sk-2`, a list in
the settings file, TIERLM_API_KEY); the name is what logs and pages show, never
the key. Keys are read from `Authorization: Bearer KEY` or `x-api-key: KEY`,
never from a URL, and compared in constant time against every key configured.

Levels:
- open: /health (probes), everything outside /v1 and the admin area;
- api: /v1 (inference, the model list): an API key or the admin key, when any key is set;
- monitor: /metrics, /stats: the admin key when one is set, else an API key when one is set;
- admin: POST /v1/models/{id}/load and /unload, DELETE /v1/cache, /admin: the
  admin key when one is set; with API keys and no admin key they are refused
  (403): an API key never manages the server, and a request from loopback is
  not trusted more (behind a reverse proxy on the same host every request is).
  With no key at all (a loopback-only server by default) everything is open.

The dashboard's session cookie (admin.session, opened at /admin/login with the
admin key) counts as that admin key on every route; a request that changes
something with it must come from the server's own pages (its Origin, when sent,
is the server's host). The login page, its assets and logout are open.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_ADMIN_PATHS = [("POST", re.compile(r"/v1/models/.+/(load|unload)")), ("DELETE", re.compile(r"/v1/cache/?")),
                (None, re.compile(r"/admin(/.*)?"))]
MONITOR_PATHS = ("/metrics", "/stats")
# the dashboard's pieces that a visitor without a session needs
_OPEN_ADMIN = re.compile(r"/admin/?|/admin/(login|logout|static/[A-Za-z0-9_.-]+)")  # the page redirects itself


@dataclass(frozen=True)
class Key:
    name: str
    digest: bytes  # SHA-256 of the key: only digests of equal length are compared


def parse_keys(entries: tuple[str, ...] | list[str], kind: str = "api") -> list[Key]:
    """KEY or NAME:KEY entries as named keys (unnamed ones: `{kind}-1`, ...);
    ValueError for an empty key or a name used twice."""
    keys: list[Key] = []
    for i, entry in enumerate(entries, 1):
        name, sep, secret = entry.partition(":")
        if not sep or not _NAME.fullmatch(name):
            name, secret = f"{kind}-{i}", entry
        secret = secret.strip()
        if not secret:
            raise ValueError(f"{kind} key {name!r} is empty")
        if any(k.name == name for k in keys):
            raise ValueError(f"two {kind} keys are named {name!r}")
        keys.append(Key(name, _digest(secret)))
    return keys


def secret_of(entry: str) -> str:
    """The key of a KEY or NAME:KEY entry (what a client sends)."""
    name, sep, secret = entry.partition(":")
    return secret.strip() if sep and _NAME.fullmatch(name) else entry


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def _match(given: str, keys: list[Key]) -> Key | None:
    """The key `given` is, comparing its digest with every key's in constant time
    (no early exit: the time says nothing of which key nor how much matched)."""
    digest, found = _digest(given), None
    for key in keys:
        if hmac.compare_digest(digest, key.digest):
            found = key
    return found


def presented(headers) -> list[str]:
    """What a request offers as a key: a bearer token (OpenAI's clients) and
    `x-api-key` (Anthropic's)."""
    auth = headers.get("authorization", "")
    bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    return [k for k in (bearer, headers.get("x-api-key", "").strip()) if k]


def level_of(method: str, path: str) -> str:
    """open, api, monitor or admin."""
    if _OPEN_ADMIN.fullmatch(path):
        return "open"
    if any((m is None or m == method) and rx.fullmatch(path) for m, rx in _ADMIN_PATHS):
        return "admin"
    if path in MONITOR_PATHS:
        return "monitor"
    if path in ("/v1", "/rerank") or path.startswith(("/v1/", "/api/")):  # OpenAI's, Anthropic's; Ollama's
        return "api"
    return "open"


@dataclass(frozen=True)
class Denied:
    status: int
    message: str
    code: str


class Access:
    """The keys of a server and who they let in."""

    def __init__(self, api_keys: tuple[str, ...] = (), admin_keys: tuple[str, ...] = (), sessions=None):
        self.api, self.admin = _parsed(api_keys, admin_keys)
        self.api_entries, self.admin_entries = tuple(api_keys), tuple(admin_keys)  # as given: is a change one?
        self.sessions = sessions  # admin.session.Sessions: the dashboard's logins, or None

    def replace(self, api_keys: tuple[str, ...], admin_keys: tuple[str, ...]) -> None:
        """Other keys from now on (the settings file changed), checked as at start:
        ValueError leaves the keys as they were. When the admin keys change, every
        dashboard session ends (one may have come from a key taken away)."""
        before = {(k.name, k.digest) for k in self.admin}
        self.api, self.admin = _parsed(api_keys, admin_keys)
        self.api_entries, self.admin_entries = tuple(api_keys), tuple(admin_keys)
        if self.sessions is not None and {(k.name, k.digest) for k in self.admin} != before:
            self.sessions.end_all()

    @property
    def enabled(self) -> bool:
        return bool(self.api or self.admin)

    def describe(self) -> str:
        """For the start-up log: names only."""
        if not self.enabled:
            return "no keys: every route is open"
        api = ", ".join(k.name for k in self.api) or "none (the /v1 routes are open)"
        admin = ", ".join(k.name for k in self.admin) or "none (load, unload and clearing the cache are refused)"
        return f"API keys: {api}; admin keys: {admin}"

    def check(self, method: str, path: str, headers) -> tuple[Denied | None, str | None]:
        """(why the request is refused or None, the name of the key it used)."""
        level = level_of(method, path)
        if level == "open" or not self.enabled:
            return None, None
        given = presented(headers)
        admin = next((k for g in given if (k := _match(g, self.admin))), None)
        if admin is not None:
            return None, admin.name
        session = self.sessions.from_headers(headers) if self.sessions and self.admin else None
        if session is not None:
            if method not in ("GET", "HEAD", "OPTIONS") and not _same_origin(headers):
                return Denied(403, "a dashboard session is only accepted from the server's own pages",
                              "cross_origin"), session
            return None, session
        api = next((k for g in given if (k := _match(g, self.api))), None)
        if level == "admin" or (level == "monitor" and self.admin):
            if not self.admin:
                if api is None:
                    return Denied(401, "invalid or missing API key", "invalid_api_key"), None
                return Denied(403, "this route changes the server and needs the admin key, and none is set: "
                                   "start the server with --admin-key", "admin_key_not_set"), api.name
            if api is not None:
                return Denied(403, "this route needs the admin key; an API key cannot use it",
                              "admin_key_required"), api.name
            return Denied(401, "invalid or missing admin key", "invalid_api_key"), None
        if api is not None or not self.api:  # api/monitor level, open when only an admin key is set
            return None, api.name if api else None
        return Denied(401, "invalid or missing API key", "invalid_api_key"), None


def _parsed(api_keys: tuple[str, ...], admin_keys: tuple[str, ...]) -> tuple[list[Key], list[Key]]:
    api, admin = parse_keys(api_keys, "api"), parse_keys(admin_keys, "admin")
    if {k.digest for k in api} & {k.digest for k in admin}:
        raise ValueError("a key is both an API key and an admin key: an API key must not manage the server")
    return api, admin


def _same_origin(headers) -> bool:
    """Whether a request's Origin, if it sent one, is the host it was sent to."""
    origin = headers.get("origin")
    if not origin:
        return True
    return origin.partition("://")[2].rstrip("/") == headers.get("host", "")


_SECRET_QUERY = re.compile(r"([?&](?:[\w.-]*key|[\w.-]*token|auth[\w.-]*|password)=)[^&#\s]*", re.IGNORECASE)


def redact_query(target: str) -> str:
    """A request target with the values of key-like query parameters hidden: a
    key is never read from a URL, but a client that sends one there must not
    find it in the access log."""
    return _SECRET_QUERY.sub(r"\1***", target)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_keys: tuple[str, ...], insecure_no_auth: bool) -> None:
    """A server reachable from other machines must want a key: ValueError unless
    it binds to loopback, has an API key, or was told --insecure-no-auth."""
    if is_loopback(host) or api_keys or insecure_no_auth:
        return
    raise ValueError(f"refusing to listen on {host} without an API key: anyone who reaches it could use "
                     "the server. Set --api-key (and --admin-key to manage it), or pass --insecure-no-auth "
                     "if the network in front of it does the checking")
