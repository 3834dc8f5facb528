"""Reasoning sections: markers per model, splitting streamed text, the thinking budget."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from tierlm.engine.constraint import constraint_processor
from tierlm.structured.events import Gathered, ReasoningDelta, TextDelta
from tierlm.structured.reasoning import (
    ReasoningSplitter,
    ThinkingBudget,
    ThinkingMarkers,
    markers_for,
    starts_in_thinking,
)

THINK = ThinkingMarkers("<think>", "</think>", (0,))
CHANNEL = ThinkingMarkers("<|channel>thought", "<channel|>", (0,))

# (name, markers, prompt's generation tail, output, expected reasoning, expected content)
RECORDED = [
    (
        "qwen3, prompt opened <think>",
        THINK,
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "Okay, the user asks for 2+2. Is x < 3? No: 2+2 = 4.\n</think>\n\nThe answer is **4**.",
        "Okay, the user asks for 2+2. Is x < 3? No: 2+2 = 4.\n",
        "The answer is **4**.",
    ),
    (
        "qwen3, output opens <think>",
        THINK,
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "<think>\nSimple arithmetic, </thin is not a marker.\n</think>\n\nIt is 4. Tags like <b> stay.",
        "Simple arithmetic, </thin is not a marker.\n",
        "It is 4. Tags like <b> stay.",
    ),
    (
        "qwen3, thinking switched off",
        THINK,
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "Sure: 4, since 2 < 3 and 4 > 3.",
        "",
        "Sure: 4, since 2 < 3 and 4 > 3.",
    ),
    (
        "deepseek-r1, no start in the output",
        THINK,
        "<｜User｜>Capital of France?<｜Assistant｜><think>\n",
        "Alright, France's capital is Paris.\n</think>\n\nParis.",
        "Alright, France's capital is Paris.\n",
        "Paris.",
    ),
    (
        "gemma, multi-token markers",
        CHANNEL,
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n",
        "<|channel>thought\nThe <channel is Paris, <|chan too.<channel|>The capital is Paris <channel.",
        "The <channel is Paris, <|chan too.",
        "The capital is Paris <channel.",
    ),
    (
        "no thinking at all",
        THINK,
        "<|im_start|>assistant\n",
        "Hello! <b>How</b> can I help? 3 < 4 and </b",
        "",
        "Hello! <b>How</b> can I help? 3 < 4 and </b",
    ),
    (
        "cut off inside thinking (max_tokens)",
        THINK,
        "<|im_start|>assistant\n",
        "<think>\nLet me think about this carefully. First, </thi",
        "Let me think about this carefully. First, </thi",
        "",
    ),
    (
        "only the first section is reasoning",
        THINK,
        "<|im_start|>assistant\n",
        "<think>a</think>b <think>c</think>",
        "a",
        "b <think>c</think>",
    ),
    (
        "lone end marker: what came before already went out as content",
        THINK,
        "<|im_start|>assistant\n",
        "Some thought.</think>\n\nAnswer.",
        "",
        "Some thought.Answer.",
    ),
]


def split(markers: ThinkingMarkers, in_thinking: bool, chunks: list[str]) -> Gathered:
    splitter = ReasoningSplitter(markers, in_thinking)
    events = [e for chunk in chunks for e in splitter.feed(chunk)] + splitter.finish()
    assert all(isinstance(e, (TextDelta, ReasoningDelta)) and e.text for e in events)
    return Gathered().add(events)


def chunkings(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize(("name", "markers", "prompt", "output", "reasoning", "content"), RECORDED)
def test_recorded_outputs_split_alike_however_chunked(name, markers, prompt, output, reasoning, content):
    in_thinking = starts_in_thinking(prompt, markers)
    for chunks in chunkings(output):
        got = split(markers, in_thinking, chunks)
        assert (got.reasoning, got.content) == (reasoning, content), (name, chunks)


def test_reasoning_streams_before_the_end_marker_arrives():
    splitter = ReasoningSplitter(THINK)
    assert splitter.feed("<think>\nfirst") == [ReasoningDelta("first")]
    assert splitter.feed(" idea </th") == [ReasoningDelta(" idea ")]
    assert splitter.feed("ink>\n\nans") == [TextDelta("ans")]
    assert splitter.finish() == []


def test_starts_in_thinking():
    assert starts_in_thinking("<|im_start|>assistant\n<think>\n", THINK)
    assert not starts_in_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not starts_in_thinking("<|im_start|>assistant\n", THINK)
    history = "<think>old</think>done<|im_end|>\n<|im_start|>assistant\n"
    assert not starts_in_thinking(history, THINK)
    assert starts_in_thinking(history + "<think>\n", THINK)


def test_default_model_has_no_thinking(model_path):
    assert markers_for(load_tokenizer(model_path)) is None


def test_setting_names_the_markers(model_path):
    tokenizer = load_tokenizer(model_path)
    end_tokens = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    assert markers_for(tokenizer, "<think>,</think>") == ThinkingMarkers("<think>", "</think>", end_tokens)
    gemma = markers_for(tokenizer, "<|channel>thought,<channel|>")
    assert (gemma.start, gemma.end) == ("<|channel>thought", "<channel|>")
    assert markers_for(tokenizer, "off") is None
    with pytest.raises(ValueError):
        markers_for(tokenizer, "<think>")


def test_thinking_tokens_in_the_vocabulary_are_inferred(model_path, tmp_path):
    from transformers import AutoTokenizer

    for f in model_path.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, tmp_path / f.name)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    hf.add_tokens(["<think>", "</think>"], special_tokens=True)
    hf.save_pretrained(tmp_path)

    tokenizer = load_tokenizer(Path(tmp_path))
    end_id = tokenizer.convert_tokens_to_ids("</think>")
    assert markers_for(tokenizer) == ThinkingMarkers("<think>", "</think>", (end_id,))
    assert markers_for(tokenizer, "off") is None


END = (101, 102)
START = (100,)
VOCAB = 128


def budget(n: int, in_thinking: bool, start_tokens=START) -> ThinkingBudget:
    return ThinkingBudget(ThinkingMarkers("<think>", "</think>", END), n, in_thinking, start_tokens)


def forced(b: ThinkingBudget) -> int | None:
    mask = b.allowed(VOCAB)
    if mask is None:
        return None
    assert mask.shape == (VOCAB,) and mask.dtype == np.bool_ and mask.sum() == 1
    return int(mask.argmax())


def test_budget_forces_the_end_marker_then_lets_go():
    b = budget(3, in_thinking=True)
    for token in (5, 6, 7):
        assert forced(b) is None
        b.consume(token)
    assert forced(b) == 101
    b.consume(101)
    assert forced(b) == 102
    b.consume(102)
    for token in (8, 9, 10):
        assert forced(b) is None
        b.consume(token)
    assert forced(b) is None


def test_model_closing_early_is_never_forced():
    b = budget(3, in_thinking=True)
    for token in (5, 101, 102, 6, 7, 8, 9):
        b.consume(token)
        assert forced(b) is None


def test_zero_budget_forces_at_once():
    b = budget(0, in_thinking=True)
    assert forced(b) == 101


def test_budget_counts_from_the_start_marker():
    b = budget(2, in_thinking=False)
    for token in (5, 6, 7, 8):  # before thinking: not counted
        b.consume(token)
        assert forced(b) is None
    b.consume(100)
    b.consume(5)
    assert forced(b) is None
    b.consume(6)
    assert forced(b) == 101


def test_multi_token_start_marker_and_no_start_tokens():
    b = budget(1, in_thinking=False, start_tokens=(100, 99))
    for token in (100, 5, 99, 100):
        b.consume(token)
        assert forced(b) is None
    b.consume(99)
    b.consume(7)
    assert forced(b) == 101

    b = budget(1, in_thinking=False, start_tokens=None)
    for token in (100, 5, 6, 7):
        b.consume(token)
        assert forced(b) is None


def test_an_end_marker_the_model_began_is_finished_not_restarted():
    b = budget(2, in_thinking=True)
    b.consume(5)
    b.consume(101)
    assert forced(b) == 102
    b.consume(102)
    assert forced(b) is None


def test_budget_as_a_logits_processor():
    process = constraint_processor(budget(1, in_thinking=True))
    logits = mx.zeros((1, VOCAB))
    assert mx.array_equal(process(mx.array([1]), logits), logits)
    masked = process(mx.array([1, 5]), logits)
    assert masked.argmax(-1).item() == 101 and mx.isinf(masked).sum().item() == VOCAB - 1
