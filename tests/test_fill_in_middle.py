"""Fill in the middle on /v1/completions: `suffix` becomes the model's own FIM
prompt. Served for real and asked through the official `openai` client: a tiny
random-weight model whose tokenizer holds StarCoder's FIM tokens (SmolLM2's
tokenizer with four of its special tokens renamed: same ids, same vocabulary),
and the default model, whose vocabulary has none."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import start_server, stop_server
from tokenizers import Tokenizer

from tierlm.models.random_model import make_random_model
from tierlm.serving.fill_in_middle import FimFormat, find_format

RENAMED = {"<repo_name>": "<fim_prefix>", "<reponame>": "<fim_suffix>", "<file_sep>": "<fim_middle>",
           "<filename>": "<fim_pad>"}
BEFORE = "def add(a, b):\n    return"
AFTER = "\n\nprint(add(2, 3))\n"
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def fim_model(model_path, tmp_path_factory):
    folder = make_random_model("tiny", tmp_path_factory.mktemp("fim") / "tiny-fim", model_path, "float32")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).is_file():
            text = (folder / name).read_text()
            for old, new in RENAMED.items():
                text = text.replace(json.dumps(old), json.dumps(new))
            (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def fim_server(fim_model):
    # no prefix cache: the answers compared below are computed alike, none from cached KV
    srv = start_server(fim_model, fim_model.parent / "server.log", "--no-prefix-cache", "--no-ssd-cache")
    yield srv
    stop_server(srv)


def test_a_suffix_is_the_models_fim_prompt(fim_server, fim_model):
    """The middle is what the model writes after <fim_prefix> BEFORE <fim_suffix>
    AFTER <fim_middle>, sent as ids; and it stops where the FIM family stops."""
    tokenizer = Tokenizer.from_file(str(fim_model / "tokenizer.json"))
    ids = tokenizer.token_to_id
    expected = [ids("<fim_prefix>"), *tokenizer.encode(BEFORE, add_special_tokens=False).ids,
                ids("<fim_suffix>"), *tokenizer.encode(AFTER, add_special_tokens=False).ids, ids("<fim_middle>")]
    client = fim_server.client()
    fim = client.completions.create(model="tiny-fim", prompt=BEFORE, suffix=AFTER, **GREEDY)
    assert fim.usage.prompt_tokens == len(expected)
    stops = [ids("<fim_pad>"), ids("<|endoftext|>")]
    by_ids = client.completions.create(model="tiny-fim", prompt=expected, **GREEDY,
                                       extra_body={"stop_token_ids": stops})
    assert fim.choices[0].text == by_ids.choices[0].text and fim.usage.completion_tokens > 0
    assert fim.choices[0].finish_reason == by_ids.choices[0].finish_reason

    streamed = client.completions.create(model="tiny-fim", prompt=BEFORE, suffix=AFTER, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == fim.choices[0].text
    # a prompt that is not text, or an echo of it, cannot go with a suffix: a 400 naming why
    for bad in ({"prompt": expected}, {"prompt": BEFORE, "echo": True}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-fim", suffix=AFTER, max_tokens=4, **bad)
        assert "suffix" in e.value.body["message"], e.value.body
    assert client.completions.create(model="tiny-fim", prompt=BEFORE, max_tokens=2).usage.completion_tokens


def test_a_bad_suffix_is_a_400_and_the_next_completion_is_answered(fim_server):
    import httpx

    url = fim_server.v1 + "/completions"
    for suffix in (5, ["x"], "x \ud800", {"text": "x"}):
        body = json.dumps({"model": "tiny-fim", "prompt": BEFORE, "suffix": suffix, "max_tokens": 2})
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"], (suffix, r.text)
    good = httpx.post(url, json={"model": "tiny-fim", "prompt": BEFORE, "suffix": AFTER, "max_tokens": 2}, timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] > 0


def test_a_model_without_fim_tokens_refuses_a_suffix(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=BEFORE, suffix=AFTER, max_tokens=4)
    assert e.value.body["param"] == "suffix" and "fill-in-the-middle" in e.value.body["message"]
    # an empty suffix asks for nothing after the completion: a plain one, on any model
    plain = client.completions.create(model="default", prompt=BEFORE, suffix="", max_tokens=4, temperature=0)
    assert plain.choices[0].text == client.completions.create(model="default", prompt=BEFORE, max_tokens=4,
                                                              temperature=0).choices[0].text


class Vocabulary:
    """Just what `find_format` reads of a tokenizer: its vocabulary and its BOS."""

    def __init__(self, tokens: list[str], bos: str | None = None, adds_bos: bool = False):
        self.vocab = {t: i for i, t in enumerate(["a", *tokens])}
        self.bos_token_id = self.vocab.get(bos)
        self.adds_bos = adds_bos

    def get_vocab(self):
        return dict(self.vocab)

    def encode(self, text, add_special_tokens=True):
        return ([self.bos_token_id] if self.adds_bos and add_special_tokens else []) + [0]


@pytest.mark.parametrize("tokens,bos,adds_bos,expected", [
    (["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|endoftext|>", "<|im_end|>"],
     None, False, FimFormat(1, 3, 2, None, (4, 5))),  # Qwen2.5-Coder
    (["<s>", "<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"],
     "<s>", True, FimFormat(2, 3, 4, 1, ())),  # DeepSeek-Coder, whose tokenizer puts a BOS first
    (["<s>", "[PREFIX]", "[SUFFIX]", "[MIDDLE]"], "<s>", True, None),  # Mistral's: not taken (fill_in_middle.py)
    (["<s>", "<fim_prefix>", "<fim_suffix>"], "<s>", False, None),  # no middle token: not a format
    (["<|im_start|>", "<|im_end|>"], None, False, None),
])
def test_the_fim_family_is_told_by_its_tokens(tokens, bos, adds_bos, expected):
    assert find_format(Vocabulary(tokens, bos, adds_bos)) == expected
