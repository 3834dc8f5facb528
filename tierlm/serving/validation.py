"""Every value the engine will see, checked in one place for every API adapter.

An adapter reads its API's body into the engine's `SamplingParams` and prompt
token ids, then calls `check_request`: each value is held against what the
model and MLX accept, and anything else is a 400 naming the field (`names` maps
the engine's field names to the adapter's, where they differ). Nothing here
knows MLX; the ranges that depend on the model come from its vocabulary size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from tierlm.engine.request import SamplingParams
from tierlm.serving.errors import APIError

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # any int64 or uint64; a negative seed is read as its uint64
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries, as OpenAI allows
# (lowest, highest, lowest excluded) for the float fields
FLOAT_RANGES = {
    "temperature": (0.0, 100.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 10.0, True),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
}
# keyword arguments of the tokenizer's apply_chat_template: they change what the
# call returns (a string, tensors, a dict) or which template runs, so a client may
# not pass them as template variables
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_request(params: SamplingParams, prompt: list[int], vocab_size: int,
                  names: Mapping[str, str] | None = None, ids_checked: bool = False) -> SamplingParams:
    """The params as the engine should run them, or APIError(400). `ids_checked`:
    the prompt's ids are known to be in the vocabulary."""
    names = names or {}

    def fail(field: str, message: str):
        raise APIError(400, f"'{names.get(field, field)}': {message}", names.get(field, field), "invalid_value")

    if not ids_checked:
        check_token_ids(prompt, vocab_size, names.get("prompt", "prompt"))
    for field, (low, high, open_low) in FLOAT_RANGES.items():
        value = getattr(params, field)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not (
                low < value <= high if open_low else low <= value <= high):
            fail(field, f"must be a number {'>' if open_low else '>='} {low:g} and <= {high:g}")
    if params.max_tokens < 1:
        fail("max_tokens", "must be at least 1")
    top_k = params.top_k
    if top_k < -1 or top_k > vocab_size:
        fail("top_k", f"must be -1 or 0 (off), or between 1 and the vocabulary size ({vocab_size})")
    seed = params.seed
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        fail("seed", f"must fit in 64 bits ({SEED_MIN} to {SEED_MAX})")
    bias = params.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        fail("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
    for token, value in bias.items():
        if not 0 <= token < vocab_size:
            fail("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")
        if not math.isfinite(value) or not -100 <= value <= 100:
            fail("logit_bias", "values must be between -100 and 100")
    if len(params.stop) > MAX_STOP_STRINGS:
        fail("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        fail("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
    for token in params.stop_token_ids:
        if not 0 <= token < vocab_size:
            fail("stop_token_ids", f"token id {token} is outside the vocabulary [0, {vocab_size})")
    return dataclasses.replace(
        params,
        top_k=0 if top_k in (-1, vocab_size) else top_k,  # -1 and "all of them" both mean no top-k
        seed=None if seed is None else seed % 2**64,
    )


def check_token_ids(tokens: list[int], vocab_size: int, param: str) -> None:
    """Prompt token ids a client sent (or the tokenizer made): all in the vocabulary."""
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):  # min/max: C speed on long prompts
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise APIError(400, f"prompt token id {bad} is outside this model's vocabulary [0, {vocab_size})",
                       param, "invalid_token_id")


def parse_logit_bias(bias: Mapping[str, float] | None, param: str = "logit_bias") -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys: decimal ASCII digits only (str.isdigit
    also takes '²' and '①', which int() refuses)."""
    parsed = {}
    for key, value in (bias or {}).items():
        digits = key.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
            raise APIError(400, f"'{param}': keys must be token ids, got {key!a}", param, "invalid_value")
        parsed[int(key)] = value
    return parsed


def check_template_args(args: Mapping[str, object] | None, param: str = "chat_template_kwargs") -> dict:
    """Variables a client passes to the chat template (enable_thinking, ...): names
    of template variables, never apply_chat_template's own arguments."""
    for name in args or {}:
        if name in RESERVED_TEMPLATE_ARGS:
            raise APIError(400, f"'{param}': {name!r} is not a template variable and may not be set",
                           param, "invalid_value")
        if not name.isidentifier():
            raise APIError(400, f"'{param}': {name!a} is not a template variable name",
                           param, "invalid_value")
    return dict(args or {})


def find_lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string in a decoded JSON body holding a lone UTF-16
    surrogate (JSON's "\\ud800"), which no tokenizer, template or UTF-8 encoder
    accepts; None if there is none."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(item, dict):
            for key, sub in item.items():
                name = f"{where}.{key}" if where else str(key)
                if find_lone_surrogate(key) is not None:
                    return name.encode("utf-8", "backslashreplace").decode()
                stack.append((sub, name))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}.{i}" if where else str(i)) for i, sub in enumerate(item))
    return None
