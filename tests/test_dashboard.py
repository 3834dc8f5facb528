"""/admin, the web dashboard: its JSON endpoints over HTTP, who may call each of
them (no key, a wrong one, an API key, the admin key, the session cookie), and
the pages in a real headless Chromium driven by Selenium: log in, watch the
status while a request runs, load and unload a model, a streamed chat answer
and a stopped one, a short benchmark and its plot. Screenshots go to the
pytest tmp folder (the path is printed)."""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
import tomllib
from pathlib import Path

import httpx
import pytest
from conftest import start_server, stop_server, wait_until

pytestmark = pytest.mark.slow  # a server of its own and a headless browser

MODEL = "SmolLM2-135M-Instruct"
API, ADMIN = "sk-api-test", "sk-admin-test"
STATIC = Path(__file__).parent.parent / "tierlm" / "admin" / "static"


@pytest.fixture(scope="module")
def srv(model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    (root / "models").mkdir()
    (root / "models" / "second").symlink_to(model_path)
    settings = root / "settings.toml"
    settings.write_text('# written by the test\nlog_level = "info"  # chatty\n\n[models."other"]\nkeep_alive = "10m"\n')
    server = start_server(model_path, root / "server.log", "--api-key", f"alice:{API}", "--admin-key",
                          f"ops:{ADMIN}", "--config", str(settings), "--no-hf-cache", "--keep-alive", "-1")
    server.settings_path = settings
    yield server
    stop_server(server)


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextlib.contextmanager
def login(srv):
    """A client with a dashboard session."""
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        r = client.post("/admin/login", json={"key": ADMIN})
        assert r.status_code == 200, r.text
        yield client


# ---- who may call what --------------------------------------------------------------

PROTECTED = [("GET", "/admin/api/status", None), ("GET", "/admin/api/models", None),
             ("GET", "/admin/api/logs", None), ("GET", "/admin/api/whoami", None),
             ("POST", f"/admin/api/models/{MODEL}/load", None), ("POST", "/admin/api/models/second/unload", None),
             ("POST", f"/admin/api/models/{MODEL}/pin", {"pinned": False}),
             ("PUT", f"/admin/api/models/{MODEL}/settings", {}),
             ("POST", "/admin/api/import", {"path": "/nonexistent.gguf"}), ("GET", "/admin/api/import/import-99", None),
             ("POST", "/admin/api/bench", {"concurrencies": [99]}), ("GET", "/admin/api/bench/bench-99", None)]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[f"{m} {p}" for m, p, _ in PROTECTED])
def test_auth_on_every_admin_route(srv, method, path, body):
    def call(**kw):
        return httpx.request(method, srv.base_url + path, json=body, timeout=60, **kw)

    assert call().status_code == 401
    assert call(headers=auth("sk-wrong")).status_code == 401
    r = call(headers=auth(API))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    ok = call(headers=auth(ADMIN)).status_code
    assert ok not in (401, 403), ok  # past the gate: 200, or the route's own 400 / 404


def test_login_cookie_and_logout(srv):
    r = httpx.post(srv.base_url + "/admin/login", json={"key": "sk-wrong"}, timeout=30)
    assert r.status_code == 401 and "set-cookie" not in r.headers
    r = httpx.post(srv.base_url + "/admin/login", json={"key": API}, timeout=30)
    assert r.status_code == 403 and "set-cookie" not in r.headers
    r = httpx.post(srv.base_url + "/admin/login", json={"key": ADMIN}, timeout=30)
    assert r.status_code == 200 and r.json()["key_name"] == "ops"
    cookie = r.headers["set-cookie"]
    assert ADMIN not in cookie
    for flag in ("HttpOnly", "SameSite=strict", "Path=/"):
        assert flag.lower() in cookie.lower(), cookie
    token = r.cookies["tierlm_session"]
    jar = {"tierlm_session": token}
    assert httpx.get(srv.base_url + "/admin/api/status", cookies=jar).status_code == 200
    assert httpx.get(srv.v1 + "/models", cookies=jar).status_code == 200  # the chat page's calls
    assert httpx.get(srv.base_url + "/admin/api/whoami", cookies=jar).json()["key_name"] == "ops"
    # a forged or altered cookie is nobody
    assert httpx.get(srv.base_url + "/admin/api/status", cookies={"tierlm_session": token[:-2] + "AA"}).status_code == 401
    # a change made with the cookie from another site's page is refused
    r = httpx.post(srv.base_url + "/admin/api/models/second/unload", cookies=jar,
                   headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin"
    # the page itself: a redirect to the login without a session, the page with one
    r = httpx.get(srv.base_url + "/admin", timeout=30)
    assert r.status_code == 303 and r.headers["location"] == "/admin/login"
    r = httpx.get(srv.base_url + "/admin", cookies=jar)
    assert r.status_code == 200 and "<title>tierlm dashboard" in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    r = httpx.post(srv.base_url + "/admin/logout", cookies=jar)
    assert r.status_code == 200 and 'tierlm_session=""' in r.headers["set-cookie"]
    # logged out: that cookie no longer opens anything, even if kept
    assert httpx.get(srv.base_url + "/admin/api/status", cookies=jar).status_code == 401
    assert httpx.get(srv.v1 + "/models", cookies=jar).status_code == 401


def test_assets_are_all_served_here():
    """Works offline: no asset names another host (the SVG namespace is not fetched)."""
    for f in STATIC.iterdir():
        text = f.read_text()
        urls = set(re.findall(r"(?:https?:)?//[A-Za-z0-9.-]+\.[a-z]{2,}[^\s\"')]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (f.name, urls)
        for src in re.findall(r'(?:src|href)="([^"#]+)"', text) if f.suffix == ".html" else []:
            assert src.startswith("/admin/static/"), (f.name, src)


def test_static_files(srv):
    r = httpx.get(srv.base_url + "/admin/static/app.js", timeout=30)  # open: the login page needs them
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    for bad in ("/admin/static/..%2f..%2fconfig.py", "/admin/static/nope.js", "/admin/static/%2e%2e"):
        assert httpx.get(srv.base_url + bad, timeout=30).status_code in (401, 404), bad


# ---- the endpoints ----------------------------------------------------------------

def test_status_models_and_logs(srv):
    with login(srv) as c:
        s = c.get("/admin/api/status").json()
        assert [e["model"] for e in s["engines"]] == [MODEL]
        assert s["memory"]["budget_bytes"] > 0 and s["memory"]["process_bytes"] > 0
        assert "hot" in s["engines"][0]["cache"]
        models = {m["name"]: m for m in c.get("/admin/api/models").json()["models"]}
        assert set(models) == {MODEL, "second"} and models[MODEL]["default"] and models[MODEL]["size_bytes"] > 0
        logs = c.get("/admin/api/logs").json()
        assert logs["next"] > 0 and any("logged in" in line["text"] for line in logs["lines"])
        later = c.get("/admin/api/logs", params={"after": logs["next"]}).json()
        assert all(line["seq"] > logs["next"] for line in later["lines"])


def test_settings_saved_to_the_file_and_applied(srv):
    with login(srv) as c:
        r = c.put("/admin/api/models/second/settings",
                  json={"aliases": "tiny, small-*", "keep_alive": "2m", "default_temperature": 0.3})
        assert r.status_code == 200, r.text
        data = tomllib.loads(srv.settings_path.read_text())
        assert data["log_level"] == "info" and data["models"]["other"] == {"keep_alive": "10m"}  # kept
        assert srv.settings_path.read_text().startswith('# written by the test\nlog_level = "info"  # chatty\n')
        assert data["models"]["second"] == {"aliases": ["tiny", "small-*"], "keep_alive": "2m",
                                            "default_temperature": 0.3}
        # applied without a restart: the alias names the model now
        assert httpx.get(srv.v1 + "/models/small-x", headers=auth(API)).json()["id"] == "second"
        m = next(m for m in c.get("/admin/api/models").json()["models"] if m["name"] == "second")
        assert m["settings"]["aliases"] == ["tiny", "small-*"]
        # a bad value is refused and the file left as it was
        before = srv.settings_path.read_text()
        r = c.put("/admin/api/models/second/settings", json={"default_top_p": 7})
        assert r.status_code == 400 and srv.settings_path.read_text() == before
        assert c.put("/admin/api/models/second/settings", json={"max_body_bytes": 1}).status_code == 400
        # null removes
        c.put("/admin/api/models/second/settings", json={"aliases": None, "keep_alive": None,
                                                        "default_temperature": None})
        assert "second" not in tomllib.loads(srv.settings_path.read_text()).get("models", {})


def test_load_pin_unload(srv):
    with login(srv) as c:
        assert c.post("/admin/api/models/second/pin", json={"pinned": True}).json()["state"] == "pinned"
        assert tomllib.loads(srv.settings_path.read_text())["models"]["second"] == {"pinned": True}
        assert c.post("/admin/api/models/second/unload").status_code == 409
        assert c.post("/admin/api/models/second/pin", json={"pinned": False}).json()["state"] == "loaded"
        assert c.post("/admin/api/models/second/unload").json()["state"] == "available"
        assert c.post("/admin/api/models/nope/load").status_code == 404
        assert c.post("/admin/api/models/..%2F..%2Fetc/load").status_code == 404


def test_import_refuses_what_is_not_a_gguf(srv, tmp_path):
    with login(srv) as c:
        assert c.post("/admin/api/import", json={"path": str(tmp_path / "x.gguf")}).status_code == 400
        bad = tmp_path / "broken.gguf"
        bad.write_bytes(b"not a gguf file")
        job = c.post("/admin/api/import", json={"path": str(bad), "name": "broken"}).json()
        job = wait_until(lambda: (j := c.get(f"/admin/api/import/{job['id']}").json())["state"] != "running" and j)
        assert job["state"] == "failed" and job["error"]


def test_bench_api(srv):
    with login(srv) as c:
        assert c.post("/admin/api/bench", json={"concurrencies": [1, 99]}).status_code == 400
        job = c.post("/admin/api/bench", json={"model": MODEL, "concurrencies": [1, 2], "max_tokens": 2,
                                               "requests": 1}).json()
        job = wait_until(lambda: (j := c.get(f"/admin/api/bench/{job['id']}").json())["state"] != "running" and j,
                         timeout=60)
        assert job["state"] == "done", job
        assert [r["concurrency"] for r in job["results"]] == [1, 2]
        for r in job["results"]:
            assert r["failed"] == 0 and r["output_tok_s"] > 0 and r["ttft_mean_s"] > 0


# ---- in a browser -------------------------------------------------------------------------

def _browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Chromium and chromedriver are not installed (Debian: apt-get install chromium "
                    "chromium-driver; ./install.sh test does it where apt-get is)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1366,900", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture(scope="module")
def browser():
    b = _browser()
    yield b
    b.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dashboard-screenshots")
    print(f"\ndashboard screenshots: {folder}")
    return folder


def test_in_a_browser(srv, browser, shots):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    b = browser
    wait = WebDriverWait(b, 60, poll_frequency=0.1)
    find = b.find_element

    def text(css: str) -> str:  # read in the page: tables are redrawn under a held element
        return b.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", css)

    def click(css: str) -> None:
        wait.until(lambda _: b.execute_script(
            "const e = document.querySelector(arguments[0]); if (!e || e.disabled) return false; e.click(); return true",
            css))

    def shot(name: str) -> None:
        b.save_screenshot(str(shots / f"{name}.png"))

    # log in (a wrong key first)
    b.get(srv.base_url + "/admin")
    wait.until(lambda _: b.current_url.endswith("/admin/login"))
    find(By.ID, "key").send_keys("sk-wrong", Keys.ENTER)
    wait.until(lambda _: text("#login-error"))
    shot("login-refused")
    find(By.ID, "key").send_keys(ADMIN, Keys.ENTER)
    wait.until(lambda _: b.current_url.endswith("/admin"))
    assert all(c["name"] != "tierlm_session" or c["httpOnly"] for c in b.get_cookies())
    assert b.execute_script("return document.cookie") == ""  # not readable by scripts
    wait.until(lambda _: text("#st-running") == "0")

    # the status moves while a request runs: a stream held open until the page has
    # shown it, then let go of (the server aborts it)
    seen = threading.Event()

    def long_request():
        with httpx.stream("POST", srv.v1 + "/chat/completions", headers=auth(API), timeout=120,
                          json={"model": MODEL, "max_tokens": 4000, "ignore_eos": True, "stream": True,
                                "messages": [{"role": "user", "content": "Count to a thousand."}]}) as r:
            for _ in r.iter_lines():
                if seen.is_set():
                    break

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        wait.until(lambda _: text("#st-running") == "1")
        wait.until(lambda _: text("#st-toks") not in ("–", "0.0"))
        shot("status-running")
    finally:
        seen.set()
        worker.join()
    wait.until(lambda _: text("#st-running") == "0" and text("#st-ttft").endswith("ms"))
    b.execute_script("document.documentElement.dataset.theme = 'dark'")
    shot("status-dark")
    b.execute_script("delete document.documentElement.dataset.theme")

    # load and unload a model
    b.get(srv.base_url + "/admin#models")
    row = '#models-body tr[data-model="second"]'
    click(row + " [data-action=load]")
    wait.until(lambda _: "loaded" in text(row + " .state"))
    shot("models-loaded")
    click(row + " [data-action=unload]")
    wait.until(lambda _: "available" in text(row + " .state"))

    # a streamed chat answer, then one stopped
    b.get(srv.base_url + "/admin#chat")
    wait.until(lambda _: find(By.CSS_SELECTOR, f'#chat-model option[value="{MODEL}"]'))
    b.execute_script("document.getElementById('chat-max').value = 40; document.getElementById('chat-temp').value = 0")
    find(By.ID, "chat-text").send_keys("Write a Python function that adds two numbers, in a code block.",
                                        Keys.ENTER)
    answer = ".msg.assistant:last-of-type"
    wait.until(lambda _: find(By.CSS_SELECTOR, answer).get_attribute("data-state") == "done")
    assert text(answer + " .body").strip()
    shot("chat-answer")
    b.execute_script("document.getElementById('chat-max').value = 2000")
    find(By.ID, "chat-text").send_keys("Tell me a very long story.", Keys.ENTER)
    wait.until(lambda _: len(text(answer + " .body")) > 20)
    find(By.ID, "chat-stop").click()
    wait.until(lambda _: find(By.CSS_SELECTOR, answer).get_attribute("data-state") == "stopped")
    assert "stopped" in text(answer + " .note")
    wait_until(lambda: httpx.get(srv.base_url + "/stats", headers=auth(ADMIN)).json()["engines"][0]["running"] == 0,
               timeout=30)  # the server aborted the request when the page let go of it
    shot("chat-stopped")

    # a short benchmark and its plot
    b.get(srv.base_url + "/admin#bench")
    wait.until(lambda _: find(By.CSS_SELECTOR, f'#bench-model option[value="{MODEL}"]'))
    for name, value in (("concurrencies", "1"), ("max_tokens", "2"), ("requests", "1")):
        field = find(By.CSS_SELECTOR, f'#bench-form [name="{name}"]')
        field.clear()
        field.send_keys(value)
    find(By.ID, "bench-run").click()
    wait.until(lambda _: find(By.ID, "bench-plot").get_attribute("data-state") in ("done", "failed"))
    assert find(By.ID, "bench-plot").get_attribute("data-state") == "done", text("#bench-msg")
    # one concurrency (the API test runs several): its tok/s point and its TTFT point
    assert len(b.find_elements(By.CSS_SELECTOR, "#bench-plot circle")) == 2
    assert len(b.find_elements(By.CSS_SELECTOR, "#bench-body tr")) == 1
    shot("benchmark")

    # the log, live
    b.get(srv.base_url + "/admin#logs")
    wait.until(lambda _: "dashboard: benchmark" in text("#log-view"))
    shot("logs")

    # log out: back to the login page, and the cookie is gone
    find(By.ID, "logout").click()
    wait.until(lambda _: b.current_url.endswith("/admin/login"))
    b.get(srv.base_url + "/admin")
    wait.until(lambda _: b.current_url.endswith("/admin/login"))
    errors = [e for e in b.get_log("browser") if e["level"] == "SEVERE" and "favicon" not in e["message"]
              and "401" not in e["message"]]
    assert not errors, errors
    assert len(list(shots.glob("*.png"))) >= 8
