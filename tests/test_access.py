"""Access control through a real server: API keys on every /v1 route, the admin
key on the routes that manage the server and on its monitoring, keys never in a
URL nor the log; model names that try to leave the model folders; and the
refusal to listen on the network without a key."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys

import httpx
import pytest
from conftest import start_server, stop_server, wait_until

from tierlm.admin.access import Access, check_bind, parse_keys

MODEL = "SmolLM2-135M-Instruct"
ALICE, BARE, ADMIN = "k-alice-7f3a", "k-bare-19c2", "k-admin-5d01"

# (method, path, body): every route an API key opens (a body that passes the key and fails validation)
API_ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/chat/completions", {}),
    ("POST", "/v1/completions", {}),
    ("POST", "/v1/messages", {}),
    ("POST", "/v1/messages/count_tokens", {}),
    ("POST", "/v1/responses", {}),
    ("GET", "/v1/responses/resp_none", None),
    ("DELETE", "/v1/responses/resp_none", None),
    ("GET", "/v1/cache/stats", None),
    ("GET", "/v1/no-such-route", None),
    ("GET", "/api/tags", None),  # Ollama's API
    ("GET", "/api/ps", None),
    ("GET", "/api/version", None),
    ("POST", "/api/show", {}),
    ("POST", "/api/chat", {}),
    ("POST", "/api/generate", {}),
]
ADMIN_ROUTES = [
    ("POST", f"/v1/models/{MODEL}/load", None),
    ("POST", f"/v1/models/{MODEL}/unload", None),
    ("DELETE", "/v1/cache", None),
    ("GET", "/metrics", None),
    ("GET", "/stats", None),
]


@pytest.fixture(scope="module")
def keyed(model_path, tmp_path_factory):
    """Two API keys (one named), one admin key; a symlink in the model folder
    pointing outside it, to a folder that holds a model one level down."""
    root = tmp_path_factory.mktemp("access")
    (root / "models").mkdir()
    (root / "outside" / "deep").mkdir(parents=True)
    (root / "outside" / "deep" / "secret").symlink_to(model_path)
    (root / "outside" / "passwd").write_text("root:x:0:0\n")
    (root / "models" / "link").symlink_to(root / "outside")
    srv = start_server(model_path, root / "server.log", "--api-key", f"alice:{ALICE},{BARE}",
                       "--admin-key", f"ops:{ADMIN}", "--no-hf-cache", "--no-ssd-cache")
    srv.root = root
    yield srv
    stop_server(srv)


def call(srv, method: str, path: str, body=None, headers=None) -> httpx.Response:
    return httpx.request(method, srv.base_url + path, json=body, headers=headers or {}, timeout=60)


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def test_every_api_route_wants_a_key(keyed):
    for method, path, body in API_ROUTES:
        for headers in ({}, bearer(ALICE[:-1]), {"x-api-key": "wrong"}):
            r = call(keyed, method, path, body, headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            if path.startswith("/v1/messages"):  # Anthropic's shape
                assert r.json()["type"] == "error" and error["type"] == "authentication_error"
            elif path.startswith("/api/"):  # Ollama's
                assert "API key" in error
            else:
                assert error["code"] == "invalid_api_key"
        for headers in ((bearer(ALICE), {"x-api-key": BARE}, bearer(ADMIN)) if method == "GET" else
                        (bearer(ALICE),)):
            r = call(keyed, method, path, body, headers)
            assert r.status_code not in (401, 403), (method, path, headers, r.text)


def test_admin_routes_want_the_admin_key(keyed):
    for method, path, body in ADMIN_ROUTES:
        for headers in ({}, bearer("wrong")):
            assert call(keyed, method, path, body, headers).status_code == 401, (method, path)
        for headers in (bearer(ALICE), {"x-api-key": BARE}):
            r = call(keyed, method, path, body, headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", (method, path)
        r = call(keyed, method, path, body, {"x-api-key": ADMIN})
        # the default model is pinned: unloading it is refused, past the key
        assert r.status_code == (409 if path.endswith("/unload") else 200), (method, path, r.text)
    assert call(keyed, "GET", "/health").status_code == 200  # probes need no key


def test_keys_are_never_taken_from_a_url_nor_logged(keyed):
    for query in (f"?api_key={ALICE}", f"?key={ALICE}", f"?x-api-key={ALICE}"):
        assert call(keyed, "GET", "/v1/models" + query).status_code == 401
    log = keyed.log()
    assert "alice" in log and "api-2" in log and "ops" in log  # named at start
    assert not any(k in log for k in (ALICE, BARE, ADMIN, ALICE[:8]))


# names that try to leave the model folders: .., absolute paths, encoded dots,
# the symlink and what lies behind it, a real model folder outside them
def escapes(srv) -> list[str]:
    outside = srv.root / "outside"
    return ["../x", "../../etc/passwd", "/etc", "/etc/passwd", "%2e%2e/%2e%2e/etc", "..%2F..%2Fetc",
            "link", "link/deep", "link/deep/secret", "link/../outside/deep/secret", "link/passwd",
            str(outside / "deep" / "secret"), str(outside), f"{MODEL}/../../outside/deep/secret",
            "./" + MODEL, MODEL + "/.", "models/" + MODEL]


def raw(srv, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    """The exact path on the wire (httpx would resolve dot segments first)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"x-api-key": ADMIN, "content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_model_names_cannot_leave_the_model_folders(keyed):
    listed = {m["id"] for m in call(keyed, "GET", "/v1/models", headers=bearer(ADMIN)).json()["data"]}
    chat = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    bodies = {"/v1/chat/completions": chat, "/v1/completions": {"max_tokens": 1, "prompt": "hi"},
              "/v1/messages": {"max_tokens": 1, **chat}, "/v1/messages/count_tokens": chat,
              "/v1/responses": {"input": "hi", "max_output_tokens": 16}}
    for name in escapes(keyed):
        if name in listed:  # what discovery lists is a model folder the operator put there
            continue
        for suffix, method in (("", "GET"), ("/load", "POST"), ("/unload", "POST")):
            status, text = raw(keyed, method, f"/v1/models/{name}{suffix}")
            assert status == 404, (name, suffix, status, text)
        for path, body in bodies.items():
            status, text = raw(keyed, "POST", path, {**body, "model": name})
            assert status == 404, (name, path, status, text)
    assert listed == {MODEL}, listed
    after = call(keyed, "GET", "/v1/models", headers=bearer(ADMIN)).json()["data"]
    assert [m["id"] for m in after if m["state"] != "available"] == [MODEL]  # nothing else was loaded


# ---- without a server


@pytest.mark.slow  # a server of its own
def test_keys_in_the_settings_file_change_without_a_restart(model_path, tmp_path):
    """A key taken out of the settings file stops working at once (a leaked one
    is revoked without a restart), a dashboard session of an admin key taken
    away ends, and keys that could not start a server are refused in the log
    while the keys in force stay."""
    config = tmp_path / "settings.toml"
    config.write_text(f'api_key = ["alice:{ALICE}"]\nadmin_key = ["ops:{ADMIN}"]\n')
    srv = start_server(model_path, tmp_path / "server.log", "--config", str(config), "--no-hf-cache",
                       "--no-ssd-cache")
    try:
        def models(key: str) -> int:
            return httpx.get(srv.v1 + "/models", headers={"Authorization": f"Bearer {key}"}).status_code

        assert models(ALICE) == 200 and models(BARE) == 401
        with httpx.Client(base_url=srv.base_url) as dashboard:
            assert dashboard.post("/admin/login", json={"key": ADMIN}).status_code == 200
            assert dashboard.get("/admin/api/whoami").status_code == 200
            config.write_text(f'api_key = ["bare:{BARE}"]\nadmin_key = ["ops:k-admin-rotated"]\n')
            wait_until(lambda: "access changed" in srv.log(), timeout=60)
            assert models(BARE) == 200 and models(ALICE) == 401
            assert dashboard.get("/admin/api/whoami").status_code == 401  # its key was rotated
        config.write_text(f'api_key = ["{BARE}"]\nadmin_key = ["{BARE}"]\n')  # one key for both: refused
        wait_until(lambda: "the keys were not changed" in srv.log(), timeout=60)
        assert models(BARE) == 200 and models(ALICE) == 401
    finally:
        stop_server(srv)


def test_api_keys_alone_never_manage_the_server():
    access = Access(("alice:a-key",), ())
    for method, path, _ in ADMIN_ROUTES:
        if path in ("/metrics", "/stats"):  # monitoring: an API key reads it when no admin key is set
            assert access.check(method, path, {"x-api-key": "a-key"}) == (None, "alice")
            continue
        denied, name = access.check(method, path, {"x-api-key": "a-key"})
        assert (denied.status, denied.code, name) == (403, "admin_key_not_set", "alice")
        assert access.check(method, path, {})[0].status == 401
    assert access.check("POST", "/v1/chat/completions", bearer("a-key")) == (None, "alice")
    assert access.check("GET", "/health", {}) == (None, None)
    only_admin = Access((), ("root:r-key",))  # inference stays open; managing wants the key
    assert only_admin.check("POST", "/v1/chat/completions", {}) == (None, None)
    assert only_admin.check("POST", "/v1/models/x/load", {})[0].status == 401
    assert only_admin.check("GET", "/metrics", bearer("r-key")) == (None, "root")
    assert Access().check("POST", "/v1/models/x/load", {}) == (None, None)  # no key at all: a local server


def test_key_entries():
    keys = parse_keys(("alice:one", "two", "ci.bot@x:th:ree"), "api")
    assert [k.name for k in keys] == ["alice", "api-2", "ci.bot@x"]
    assert Access(("alice:one", "two", "ci.bot@x:th:ree")).check("GET", "/v1/models", bearer("th:ree"))[1] == \
        "ci.bot@x"
    for entries, message in ((("a:1", "a:2"), "two api keys"), (("a: ",), "empty")):
        with pytest.raises(ValueError, match=message):
            parse_keys(entries, "api")
    with pytest.raises(ValueError, match="both an API key and an admin key"):
        Access(("a:same",), ("b:same",))


def test_binding_beyond_loopback_wants_a_key(tmp_path):
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_bind(host, (), False)
    check_bind("0.0.0.0", ("k",), False)
    check_bind("0.0.0.0", (), True)
    for host in ("0.0.0.0", "::", "192.168.1.10"):
        with pytest.raises(ValueError, match="--insecure-no-auth"):
            check_bind(host, (), False)
    run = subprocess.run([sys.executable, "-m", "tierlm.cli", "serve", "--host", "0.0.0.0", "--port", "1",
                          "--model-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
                         env={"TIERLM_CONFIG": str(tmp_path / "none.toml"), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and "refusing to listen on 0.0.0.0 without an API key" in run.stderr


@pytest.mark.parametrize("flag, value, reason", [("--batch-kv-bits", "7", "expected one of 16, 8, 4"),
                                                 ("--warmup-wait-s", "-1", "expected at least 0")])
def test_a_setting_refused_on_the_command_line_ends_the_start_with_its_reason(tmp_path, flag, value, reason):
    run = subprocess.run([sys.executable, "-m", "tierlm.cli", "serve", flag, value, "--port", "1",
                          "--model-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
                         env={"TIERLM_CONFIG": str(tmp_path / "none.toml"), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and reason in run.stderr and "Traceback" not in run.stderr, run.stderr
