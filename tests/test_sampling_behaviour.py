"""What each sampling parameter *does*, through the real server and the official
client (validation is tested elsewhere). Every check is paired with what the
output would be if the parameter were ignored, so that each one can fail: a
filter that should make high-temperature sampling greedy is compared with the
same seeds without the filter, a penalty with the same greedy run without it."""

from __future__ import annotations

import httpx
import pytest
from conftest import wait_until

MODEL = "SmolLM2-135M-Instruct"
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
# greedy answers this with "Hello, hello, hello, ..." for as long as it is let run
REPEAT = [{"role": "user", "content": "Write the word hello twenty times."}]
EXTRA = ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos")  # not in OpenAI's API
SEEDS = range(4)
HOT = 100.0  # the highest temperature the API takes: next to uniform over the vocabulary


def chat(client, messages=STORY, **kw):
    """The one choice of a chat completion, and its usage."""
    extra = {k: kw.pop(k) for k in EXTRA if k in kw}
    kw.setdefault("max_tokens", 8)
    r = client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra or None, **kw)
    return r.choices[0], r.usage


def text(client, messages=STORY, **kw) -> str:
    return chat(client, messages, **kw)[0].message.content


def one_token_id(tokenizer, piece: str) -> int:
    ids = tokenizer.encode(piece, add_special_tokens=False)
    assert len(ids) == 1, f"{piece!r} is {len(ids)} tokens"
    return ids[0]


def repeated_tokens(tokenizer, s: str) -> int:
    """How many tokens of `s` are repeats of an earlier one."""
    ids = tokenizer.encode(s, add_special_tokens=False)
    return len(ids) - len(set(ids))


@pytest.fixture(scope="module")
def greedy(client) -> str:
    return text(client, temperature=0)


# ---- temperature 0 and seeds ---------------------------------------------------


def test_temperature_0_gives_the_same_text_every_time(client, greedy):
    # an ignored temperature would sample at 1, where unseeded runs differ
    assert [text(client, temperature=0) for _ in range(2)] == [greedy, greedy]


def test_a_seed_reproduces_and_another_seed_differs(client):
    first = text(client, temperature=1, seed=1234)
    assert text(client, temperature=1, seed=1234) == first
    others = {text(client, temperature=1, seed=s) for s in SEEDS}
    assert others - {first}, "four other seeds all gave seed 1234's text"


@pytest.mark.slow  # a long stream beside
def test_a_seed_reproduces_while_batched_with_another_request(server, client):
    """The seeded request runs beside a long unseeded one that draws random numbers
    every step: its text is the one it gets alone."""
    alone = text(client, temperature=1, seed=99, max_tokens=12)
    body = {"model": MODEL, "messages": STORY, "temperature": 1, "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=120) as other:
        lines = other.iter_lines()
        next(line for line in lines if '"content": "' in line and '"role"' not in line)  # it is decoding
        assert server.stats()["running"] == 1
        together = text(client, temperature=1, seed=99, max_tokens=12)
    wait_until(lambda: server.stats()["running"] == 0)  # closing the stream aborted it
    assert together == alone


# ---- filters: top_k, top_p, min_p -------------------------------------------------


def unfiltered_differs_from(client, greedy: str) -> None:
    """The control of the filter tests: at the same temperature and seeds, without
    a filter, sampling is not greedy."""
    assert any(text(client, temperature=HOT, seed=s) != greedy for s in SEEDS)


def test_top_k_1_at_temperature_1_is_greedy(client, greedy):
    assert [text(client, temperature=1, top_k=1, seed=s) for s in SEEDS] == [greedy] * len(SEEDS)
    assert any(text(client, temperature=1, seed=s) != greedy for s in SEEDS)


@pytest.mark.slow  # many sampled answers
def test_top_k_2_draws_the_first_token_from_two(client):
    """At a temperature where the whole vocabulary is about equally likely, the
    first token of eight seeds is one of two; without top_k it is eight different
    ones."""
    first = lambda **kw: {text(client, temperature=HOT, max_tokens=1, seed=s, **kw) for s in range(8)}
    assert len(first(top_k=2)) <= 2
    assert len(first()) >= 6


@pytest.mark.slow  # many sampled answers
def test_top_p_near_0_at_a_high_temperature_is_greedy(client, greedy):
    assert [text(client, temperature=HOT, top_p=0.01, seed=s) for s in SEEDS] == [greedy] * len(SEEDS)
    unfiltered_differs_from(client, greedy)


@pytest.mark.slow  # many sampled answers
def test_min_p_1_at_a_high_temperature_is_greedy_and_min_p_0_is_not(client, greedy):
    assert [text(client, temperature=HOT, min_p=1.0, seed=s) for s in SEEDS] == [greedy] * len(SEEDS)
    assert any(text(client, temperature=HOT, min_p=0.0, seed=s) != greedy for s in SEEDS)


# ---- logit_bias -------------------------------------------------------------------


def test_logit_bias_plus_100_forces_its_token(client, tokenizer):
    apple = one_token_id(tokenizer, " apple")
    for temperature in (0, 1):
        choice, usage = chat(client, temperature=temperature, seed=7, max_tokens=6, logit_bias={str(apple): 100})
        # the first text loses its leading space (mlx-lm's detokenizer rule), so compare words
        assert choice.message.content.split() == ["apple"] * 6 and usage.completion_tokens == 6
        assert choice.finish_reason == "length"


def test_logit_bias_minus_100_bans_greedys_first_token(client, tokenizer, greedy):
    first = text(client, temperature=0, max_tokens=1)
    assert greedy.startswith(first)
    banned = one_token_id(tokenizer, first)
    other = text(client, temperature=0, max_tokens=1, logit_bias={str(banned): -100})
    assert other and other != first


# ---- penalties --------------------------------------------------------------------


@pytest.fixture(scope="module")
def repeats_without_penalty(client, tokenizer) -> int:
    n = repeated_tokens(tokenizer, text(client, REPEAT, temperature=0, max_tokens=32, ignore_eos=True))
    assert n >= 24, "the prompt no longer makes the model repeat itself: choose another"
    return n


@pytest.mark.slow  # long answers, three times
@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                     {"repetition_penalty": 2.0}], ids=lambda p: next(iter(p)))
def test_a_strong_penalty_cuts_repeats(client, tokenizer, repeats_without_penalty, penalty):
    penalized = text(client, REPEAT, temperature=0, max_tokens=32, ignore_eos=True, **penalty)
    assert repeated_tokens(tokenizer, penalized) * 2 <= repeats_without_penalty, penalized


@pytest.mark.slow  # long answers
def test_a_negative_frequency_penalty_makes_repeats(client, tokenizer):
    """The sign matters: a negative penalty rewards tokens already in the text. (By
    a margin of repeats, not a ratio: the plain story differs with the CPU's
    arithmetic; on an AVX2 machine it had 8 repeats in 32 tokens, and the
    rewarded one, a word over and over, 17.)"""
    plain = text(client, temperature=0, max_tokens=32, ignore_eos=True)
    rewarded = text(client, temperature=0, max_tokens=32, ignore_eos=True, frequency_penalty=-2.0)
    assert repeated_tokens(tokenizer, rewarded) >= repeated_tokens(tokenizer, plain) + 8, (plain, rewarded)


def test_penalties_count_the_output_not_the_prompt(client):
    """The first token comes before any output: presence and frequency penalties
    leave it as it is, even where it repeats the prompt. (Counted over the prompt's
    last 20 tokens, as mlx-lm's own do, 2.0 off " mat" and " cat" made it " bed".)"""
    prompt = "The cat sat on the mat. The cat sat on the"

    def first(**kw) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, **kw).choices[0].text

    plain = first()
    assert plain.strip() in prompt.replace(".", "").split(), plain  # a word of the prompt: what a penalty over it pushes down
    assert first(presence_penalty=2.0) == plain
    assert first(frequency_penalty=2.0) == plain


# ---- stop_token_ids ---------------------------------------------------------------


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_token_ids_stop_at_the_token(client, tokenizer, ignore_eos):
    """Greedy's third token, given as a stop token: the completion ends right there,
    the stop token counted and not shown."""
    choice, usage = chat(client, temperature=0, max_tokens=8)
    assert choice.finish_reason == "length"
    ids = tokenizer.encode(choice.message.content, add_special_tokens=False)
    assert len(ids) == usage.completion_tokens == 8 and tokenizer.decode(ids) == choice.message.content
    assert ids[2] not in ids[:2]
    choice, usage = chat(client, temperature=0, max_tokens=8, stop_token_ids=[ids[2]], ignore_eos=ignore_eos)
    assert choice.finish_reason == "stop"
    assert usage.completion_tokens == 3
    assert choice.message.content == tokenizer.decode(ids[:2])
