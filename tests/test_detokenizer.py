"""Incremental text: stop strings across token boundaries, whole UTF-8 characters."""

from __future__ import annotations

import pytest

from tierlm.engine.detokenizer import IncrementalText


def stream(tokenizer, text: str, stop: list[str]) -> tuple[list[str], bool]:
    inc = IncrementalText(tokenizer.detokenizer, stop)
    pieces = [inc.add(t) for t in tokenizer.encode(text)]
    if not inc.stopped:
        pieces.append(inc.finish())
    return pieces, inc.stopped


def test_no_stop_reproduces_the_text(tokenizer):
    text = "Hello world, this is a test of 1234 numbers."
    pieces, stopped = stream(tokenizer, text, [])
    assert "".join(pieces) == text and not stopped


@pytest.mark.parametrize("stop", ["is a test", "s a t", "1234", "numbers."])
def test_stop_string_spanning_tokens_is_cut_and_never_shown(tokenizer, stop):
    text = "Hello world, this is a test of 1234 numbers. More text after."
    pieces, stopped = stream(tokenizer, text, [stop, "never appears"])
    assert stopped
    assert "".join(pieces) == text[: text.index(stop)]
    assert all(stop not in p for p in pieces)


def test_held_back_prefix_is_released_when_no_stop_follows(tokenizer):
    text = "I like apples and apple pie."
    pieces, stopped = stream(tokenizer, text, ["apple tart"])
    assert not stopped and "".join(pieces) == text


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Café ☕ naïve 👋🏽 日本語のテキスト"
    pieces, _ = stream(tokenizer, text, [])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # the emoji spans several byte-level tokens; it must arrive whole
    assert any("👋🏽" in p for p in pieces) or any("👋" in p for p in pieces)


def test_stop_string_with_multibyte_characters(tokenizer):
    text = "Das Wetter ist schön ☀️ heute, wirklich."
    pieces, stopped = stream(tokenizer, text, ["☀️ heute"])
    assert stopped and "".join(pieces) == "Das Wetter ist schön "
