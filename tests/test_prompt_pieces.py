"""Chats tokenized piece by piece (cut at the template's special tokens), the
pieces seen before reused: exactly the ids of the whole text, on the real
tokenizers; a tokenizer where cutting changes the ids is found and tokenizes
whole."""

from __future__ import annotations

import re

import pytest

from tierlm.serving.prompt_pieces import PART, PieceEncoder, _parts, encode_rendered, encoder_for

SOURCE = "def area(r):\n    return 3.14159 * r ** 2\n\n\nclass Circle:\n    pass\n" * 20
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def _turns() -> list[list[dict]]:
    """An agent's conversation as it grows, a turn at a time."""
    messages = [{"role": "system", "content": "You are a coding agent.  Two spaces; résumé 🙂"},
                {"role": "user", "content": f" Here is geometry.py:\n{SOURCE}\nWhat does it hold?"}]
    turns = [list(messages)]
    for k in range(3):
        messages += [{"role": "assistant", "content": f"It holds {k} things.\n"},
                     {"role": "user", "content": f"\n\nAnd now?  ({k})\t<tag>"}]
        turns.append(list(messages))
    return turns


def _check_real_tokenizer(tokenizer, tools=None):
    encoder = PieceEncoder(tokenizer)  # its own, not the one the process keeps for this tokenizer
    assert encoder.enabled
    misses = []
    for messages in _turns():
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=tools)
        assert encoder.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
        misses.append(encoder.misses)
    # after the first turn, only a turn's new pieces are tokenized: its two messages' and the markers between
    assert all(later - earlier <= 4 for earlier, later in zip(misses[1:], misses[2:]))
    assert encoder.hits > encoder.misses
    # a long new piece (a file of ~21k characters) goes in parts cut at blank lines, all at once
    text = _long_chat(tokenizer)
    assert encoder.line_cut is not None and len(_parts(SOURCE * 15, PART, encoder.line_cut)) > 4
    assert encoder.encode(text) == list(tokenizer.encode(text, add_special_tokens=False))
    assert encoder.check(text, encoder.encode(text), encoder.line_cut) and encoder.line_cut is not None


def _long_chat(tokenizer) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": f"Here:\n{SOURCE * 15}"}],
                                         add_generation_prompt=True, tokenize=False)


def test_the_default_models_pieces_give_the_whole_texts_ids(tokenizer):
    _check_real_tokenizer(tokenizer)


@pytest.mark.slow  # pulls the model
def test_qwen_coders_pieces_give_the_whole_texts_ids_with_tools_in_the_template(qwen_path):
    from tierlm.models.loader import load_tokenizer

    _check_real_tokenizer(load_tokenizer(qwen_path), tools=TOOLS)


@pytest.mark.slow  # pulls the model
def test_gemmas_pieces_give_the_whole_texts_ids(gemma_path):
    from tierlm.models.loader import load_tokenizer

    tokenizer = load_tokenizer(gemma_path)
    if tokenizer.chat_template is None:
        pytest.skip("this Gemma has no chat template")
    _check_real_tokenizer(tokenizer)


def _first_space_tokenizer():
    """A real SentencePiece-style tokenizer, trained here, that puts '▁' before
    the first word of the whole text only: cutting the text changes its ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tierlm.serving.prompt_pieces import _PROBE

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = [m["content"] for m in _PROBE] + ["a b", "b a"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "<|turn|>"])
    raw.train_from_iterator(corpus * 50, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>",
                                 additional_special_tokens=["<|turn|>"])
    hf.chat_template = "{% for m in messages %}<|turn|>{{ m['content'] }}{% endfor %}<|turn|>"
    return hf


def test_a_tokenizer_whose_ids_change_when_cut_is_found_by_the_probe_and_tokenizes_whole():
    tokenizer = _first_space_tokenizer()
    text = "<|turn|>a b<|turn|>b a<|turn|>"
    whole = tokenizer.encode(text, add_special_tokens=False)
    encoder = PieceEncoder(tokenizer)
    assert "<|turn|>" in encoder.cuts  # it would cut
    assert not encoder.enabled  # the probe chat's pieces differed
    assert encoder.encode(text) == whole
    assert encode_rendered(tokenizer, text) == whole


def test_a_prompt_whose_pieces_differ_turns_the_cache_off(tokenizer):
    encoder = PieceEncoder(tokenizer)
    text = tokenizer.apply_chat_template(_turns()[0], add_generation_prompt=True, tokenize=False)
    ids = encoder.encode(text)
    assert encoder.check(text, ids) and encoder.enabled
    assert not encoder.check(text, ids[:-1])  # what a check on its own thread does when they differ
    assert not encoder.enabled and encoder.encode(text) == ids


def test_parts_that_change_the_ids_are_found_by_the_check_and_the_pieces_stay(tokenizer):
    """Parts cut before a line's indent: the default model's tokenizer (GPT-2's
    rules) gives the newline and the indent one token, so the ids change; the
    check turns the parts off, the pieces stay on, and the ids are right again."""
    encoder = PieceEncoder(tokenizer)
    text = _long_chat(tokenizer)
    encoder.line_cut = cut = re.compile(r"(?<=\n)(?=    )")
    wrong = encoder.encode(text)  # its check runs on the checker's thread too, and finds the same
    whole = list(tokenizer.encode(text, add_special_tokens=False))
    assert wrong != whole
    assert not encoder.check(text, wrong, cut)
    assert encoder.line_cut is None and encoder.enabled
    assert encoder.encode(text) == whole


def test_one_encoder_per_tokenizer(tokenizer):
    assert encoder_for(tokenizer) is encoder_for(tokenizer)


def test_the_checkers_thread_starts_with_the_encoder_not_in_a_request(model_path):
    """A request's first check would start the checker's thread (~3 ms on the
    2-core Xeon, in the request's time); the encoder, made when the tokenizer
    loads, starts it. In a process of its own, where no check has run."""
    import subprocess
    import sys

    script = f"""
from pathlib import Path
from mlx_lm.tokenizer_utils import load
from tierlm.serving import prompt_pieces
before = len(prompt_pieces._checker._threads)
assert prompt_pieces.encoder_for(load(Path({str(model_path)!r}))).enabled
print(before, len(prompt_pieces._checker._threads))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0 1"
