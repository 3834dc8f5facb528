"""Incremental text: stop strings across token boundaries, whole UTF-8 characters."""

from __future__ import annotations

import pytest

from tierlm.engine.detokenizer import IncrementalText, byte_level_table


@pytest.fixture(params=["mlx-lm", "byte-level"])
def detok(request, tokenizer):
    """Both ways to text: mlx-lm's detokenizer, and the byte-level fast path."""
    table = byte_level_table(tokenizer.detokenizer) if request.param == "byte-level" else None
    return tokenizer, table


def stream(detok, text: str, stop: list[str]) -> tuple[list[str], bool]:
    tokenizer, table = detok
    inc = IncrementalText(tokenizer.detokenizer, stop, table)
    pieces = [inc.add(t) for t in tokenizer.encode(text)]
    if not inc.stopped:
        pieces.append(inc.finish())
    return pieces, inc.stopped


def test_no_stop_reproduces_the_text(detok):
    text = "Hello world, this is a test of 1234 numbers."
    pieces, stopped = stream(detok, text, [])
    assert "".join(pieces) == text and not stopped


@pytest.mark.parametrize("stop", ["is a test", "s a t", "1234", "numbers."])
def test_stop_string_spanning_tokens_is_cut_and_never_shown(detok, stop):
    text = "Hello world, this is a test of 1234 numbers. More text after."
    pieces, stopped = stream(detok, text, [stop, "never appears"])
    assert stopped
    assert "".join(pieces) == text[: text.index(stop)]
    assert all(stop not in p for p in pieces)


def test_held_back_prefix_is_released_when_no_stop_follows(detok):
    text = "I like apples and apple pie."
    pieces, stopped = stream(detok, text, ["apple tart"])
    assert not stopped and "".join(pieces) == text


def test_multibyte_characters_are_never_split(detok):
    text = "Café ☕ naïve 👋🏽 日本語のテキスト"
    pieces, _ = stream(detok, text, [])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # the emoji spans several byte-level tokens; it must arrive whole
    assert any("👋🏽" in p for p in pieces) or any("👋" in p for p in pieces)


def test_stop_string_with_multibyte_characters(detok):
    text = "Das Wetter ist schön ☀️ heute, wirklich."
    pieces, stopped = stream(detok, text, ["☀️ heute"])
    assert stopped and "".join(pieces) == "Das Wetter ist schön "


def _deltas(stream, tokens: list[int]) -> list[str]:
    return [stream.add(t) for t in tokens] + [stream.finish()]


def test_byte_level_fast_path_gives_mlx_lms_deltas(tokenizer):
    """ByteLevelStream replaces mlx-lm's BPE detokenizer on the hot path: same
    delta for every token, on text, on random ids (broken UTF-8, special tokens)
    and around lone space tokens, whose leading-space rule is the subtle part."""
    import random

    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    from tierlm.engine.detokenizer import ByteLevelStream, MlxLmStream, byte_level_table

    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)  # SmolLM2: byte-level BPE
    table = byte_level_table(tokenizer.detokenizer)
    tokenmap = tokenizer.detokenizer.tokenmap
    space = tokenmap.index("Ġ")
    rng = random.Random(0)
    sequences = [tokenizer.encode("Café ☕ naïve 👋🏽 日本語 <|im_end|> done")]
    sequences += [[rng.randrange(len(tokenmap)) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    sequences += [[space] * k + tokenizer.encode(" Hello  world") for k in range(4)]
    sequences += [[space, rng.randrange(len(tokenmap))] for _ in range(50)]
    sequences += [[len(tokenmap) + 5, 100]]  # past the map: mlx-lm's "!" fallback
    for tokens in sequences:
        expected = _deltas(MlxLmStream(tokenizer.detokenizer), tokens)
        assert _deltas(ByteLevelStream(table), tokens) == expected, tokens


def test_other_detokenizers_stream_through_mlx_lm(tokenizer):
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

    text = "Hello world, café ☕ and more."
    inc = IncrementalText(NaiveStreamingDetokenizer(tokenizer._tokenizer), [])
    pieces = [inc.add(t) for t in tokenizer.encode(text)] + [inc.finish()]
    assert "".join(pieces) == text


def test_the_first_tokens_leading_space_is_trimmed_unless_kept(tokenizer):
    """A chat reply starts clean (mlx-lm's rule); a text completion keeps the space
    it continues its prompt with."""
    table = byte_level_table(tokenizer.detokenizer)
    ids = tokenizer.encode(" Paris is the capital.")
    for keep, expected in [(False, "Paris is the capital."), (True, " Paris is the capital.")]:
        inc = IncrementalText(tokenizer.detokenizer, [], table, keep_leading_space=keep)
        assert "".join([inc.add(t) for t in ids] + [inc.finish()]) == expected


def test_add_many_gives_what_add_gives_token_by_token(tokenizer):
    """The scheduler's fast path makes the text of several tokens at once
    (Scheduler._emit): the same delta as one by one, on text, random ids (broken
    UTF-8), lone spaces and ids past the table, in groups of any size."""
    import random

    from tierlm.engine.detokenizer import ByteLevelStream, MlxLmStream

    table = byte_level_table(tokenizer.detokenizer)
    space = tokenizer.detokenizer.tokenmap.index("Ġ")
    rng = random.Random(1)
    sequences = [tokenizer.encode("Café ☕ naïve 👋🏽 日本語 and more text, " * 3)]
    sequences += [[rng.randrange(len(table)) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    sequences += [[space, space, *tokenizer.encode(" Hello  world"), space] for _ in range(3)]
    sequences += [[100, len(table) + 5, 200, 300]]
    for make in (lambda: ByteLevelStream(table), lambda: MlxLmStream(tokenizer.detokenizer),
                 lambda: IncrementalText(tokenizer.detokenizer, [], table)):
        for tokens in sequences:
            one_by_one, grouped, i = make(), make(), 0
            while i < len(tokens):  # group by group, the same delta
                group = tokens[i : i + rng.randrange(1, 6)]
                assert grouped.add_many(group) == "".join(one_by_one.add(t) for t in group), tokens
                i += len(group)
            assert grouped.finish() == one_by_one.finish(), tokens
