"""A chat template sent by a client: refused by default (test_bad_input), and with
--allow-client-chat-template rendered under a time and a size bound."""

from __future__ import annotations

import httpx
import pytest
from conftest import start_server, stop_server

pytestmark = pytest.mark.slow  # a server of its own

MSG = [{"role": "user", "content": "What is the capital of France?"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def permissive(model_path, tmp_path_factory):
    srv = start_server(model_path, tmp_path_factory.mktemp("templates") / "server.log",
                       "--allow-client-chat-template", "--no-ssd-cache")
    yield srv
    stop_server(srv)


def chat(server, template: str) -> httpx.Response:
    body = {"messages": MSG, "max_tokens": 8, "temperature": 0, "chat_template": template}
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=60)


def test_a_client_template_is_rendered_when_allowed(permissive):
    ours = chat(permissive, CHATML)
    assert ours.status_code == 200, ours.text
    plain = httpx.post(permissive.v1 + "/chat/completions", json={"messages": MSG, "max_tokens": 8,
                                                                  "temperature": 0}, timeout=60).json()
    assert ours.json()["usage"]["prompt_tokens"] != plain["usage"]["prompt_tokens"]  # no system prompt in ours


@pytest.mark.parametrize("template, words", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "2 s"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "characters"),
    ("{{ 1 / 0 }}", "rejected"),
    ("{% for %}", "rejected"),
])
def test_a_client_template_that_runs_away_or_fails_is_a_400(permissive, template, words):
    r = chat(permissive, template)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template" and words in error["message"]
    assert chat(permissive, CHATML).status_code == 200  # and the next request is served
