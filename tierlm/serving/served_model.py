"""A model as every front end serves it: its engine, its names, its limits,
its settings and turns. Turns validated request fields into engine requests;
knows no MLX."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

from tierlm.config import Settings
from tierlm.engine.constraint import TokenConstraint
from tierlm.engine.core import EngineCore
from tierlm.engine.detokenizer import byte_level_table
from tierlm.engine.request import MemoryGuardError, Request, SamplingParams
from tierlm.models.loader import ModelInfo, vocab_bounds
from tierlm.models.model_folder import CHAT
from tierlm.serving.errors import APIError
from tierlm.serving.fill_in_middle import FimFormat, find_format
from tierlm.serving.validation import check_request, parse_logit_bias
from tierlm.structured.turn import ModelTurns


class ServedModel:
    kind = CHAT  # what it serves (an encoder is a ServedEncoder: serving/encoder.py)

    def __init__(self, info: ModelInfo, engine: EngineCore, aliases: tuple[str, ...] = (),
                 turns: ModelTurns | None = None, settings: Settings | None = None):
        self.info, self.engine = info, engine
        # this model's settings: sampling defaults, template variables, context
        # limit (replaced when the settings file changes)
        self.settings = settings or Settings()
        self.turns = turns or ModelTurns(engine.tokenizer)  # tools, output formats, reasoning
        self.names = {info.name, str(info.path), *aliases}
        # tokenizer_ids_fit: a prompt the tokenizer made needs no check of its ids
        self.vocab_size, self.tokenizer_ids_fit = vocab_bounds(engine.tokenizer, engine.model, info.name)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def matches(self, requested: str | None) -> bool:
        return requested is None or requested in self.names

    @property
    def context(self) -> int:
        """Tokens of context: the model's, or less where the settings say so."""
        return min(self.info.context_length, self.settings.context_limit or self.info.context_length)

    def within_context(self, prompt_tokens: int, max_tokens: int) -> int:
        """`max_tokens` cut to the room the prompt leaves: for APIs where it is only
        a ceiling (agents send 32000 whatever the model), not a promise."""
        room = self.context - prompt_tokens
        return min(max_tokens, room) if room > 0 else max_tokens

    def prompt_too_long(self, prompt_tokens: int) -> bool:
        """Whether the prompt leaves no room for a single token of answer."""
        return prompt_tokens >= self.context

    def check_prompt(self, prompt_tokens: int, max_tokens: int | None, names: Mapping[str, str] | None = None) -> int:
        """Validate the prompt's length; returns the max_tokens to use. `names`:
        the request's own names of the prompt and max_tokens fields."""
        context = self.context
        prompt_field = (names or {}).get("prompt", "messages")
        limit_field = (names or {}).get("max_tokens", "max_tokens")
        if prompt_tokens == 0:
            raise APIError(400, "the prompt is empty", prompt_field, "empty_prompt")
        if self.prompt_too_long(prompt_tokens):
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens. However, your "
                f"prompt has {prompt_tokens} tokens. Please shorten it.",
                prompt_field, "context_length_exceeded",
            )
        if max_tokens is not None and prompt_tokens + max_tokens > context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or {limit_field}.",
                limit_field, "context_length_exceeded",
            )
        max_tokens = max_tokens if max_tokens is not None else context - prompt_tokens
        try:
            self.engine.scheduler.guard.check_alone(prompt_tokens, max_tokens)
        except MemoryGuardError as e:
            raise APIError(400, str(e), prompt_field, "memory_limit") from e
        return max_tokens

    def sampling_params(self, body, max_tokens: int, keep_leading_space: bool = False,
                        logprobs: int | None = None) -> SamplingParams:
        """A request's sampling fields (`body`: tierlm.api.fields.SamplingFields,
        or any object with its attributes) as the engine's params, before
        `check_request` holds them against the model. Fields the request leaves
        out take the model's defaults from the settings, then OpenAI's."""
        default = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, **self.settings.sampling_defaults()}
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=default["temperature"] if body.temperature is None else body.temperature,
            top_p=default["top_p"] if body.top_p is None else body.top_p,
            top_k=default["top_k"] if body.top_k is None else body.top_k,
            min_p=body.min_p or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=parse_logit_bias(body.logit_bias) or None,
            seed=body.seed,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or default.get("stop", [])),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            speculative_tokens=getattr(body, "speculative_tokens", None),
            keep_leading_space=keep_leading_space,
            logprobs=logprobs,
        )

    def make_request(self, prefix: str, tokens: list[int], body, max_tokens: int | None,
                     keep_leading_space: bool = False, logprobs: int | None = None,
                     constraint: TokenConstraint | None = None, names: Mapping[str, str] | None = None,
                     tokenized: bool = False) -> Request:
        """`logprobs`: alternatives per token (SamplingParams.logprobs), None for none.
        `constraint`: the tokens the answer may be made of (a grammar, a thinking budget).
        `names`: the request's names of the engine's fields where they differ
        ("prompt", "max_tokens", ...), for its errors; the prompt is `prompt` for
        a text completion, `messages` for a chat, unless named. `tokenized`: the
        tokenizer made the prompt (not a client's ids), so its ids are checked
        only if the tokenizer has ids past the embedding's rows (a 20k-token
        prompt's check: ~0.5 ms)."""
        names = {"prompt": "prompt" if prefix == "cmpl" else "messages", **(names or {})}
        limit = self.check_prompt(len(tokens), max_tokens or self.settings.default_max_tokens, names)
        params = check_request(self.sampling_params(body, limit, keep_leading_space, logprobs), tokens,
                               self.vocab_size, names, ids_checked=tokenized and self.tokenizer_ids_fit)
        params.constraint = constraint
        return Request(self.engine.new_request_id(prefix), tokens, params)

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (a piece of a UTF-8 character for some byte-level
        tokens), as logprobs show it."""
        data = self._token_bytes.get(token)
        if data is None:
            data = self._token_bytes[token] = self._bytes_of(token)
        return data

    @cached_property
    def fim_format(self) -> FimFormat | None:
        """The model's fill-in-the-middle tokens (a completion's `suffix`), None if none."""
        return find_format(self.tokenizer)

    @cached_property
    def _token_bytes(self) -> dict[int, bytes]:
        table = byte_level_table(self.tokenizer.detokenizer)  # ~40 ms, once
        return dict(enumerate(table)) if table is not None else {}

    def _bytes_of(self, token: int) -> bytes:
        """A token outside the byte-level table: SentencePiece's piece (its byte
        fallback `<0xHH>` as that byte, '▁' as a space), else its decoded text."""
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token)
        except (IndexError, KeyError, TypeError, ValueError, OverflowError):
            piece = None
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token]).encode()
