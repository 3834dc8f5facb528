"""The plain data that flows through the engine: what was asked, and what came out."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierlm.engine import stages as request_stages

if TYPE_CHECKING:
    from tierlm.engine.constraint import TokenConstraint


MAX_DRAFT_TOKENS = 16  # draft tokens a sequence may verify a step at most (speculative decoding)


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # the first token's leading space is text too: a text completion continues its
    # prompt verbatim (" Paris" after "The capital of France is"); a chat reply
    # starts clean, as mlx-lm's detokenizers trim it
    keep_leading_space: bool = False
    # which tokens may come next (a grammar, a thinking budget); the request's own
    constraint: TokenConstraint | None = None
    # log-probabilities of the generated tokens: None = off; n = the chosen token's
    # and the n most likely alternatives' (0 to 20), per token (RequestOutput.logprobs)
    logprobs: int | None = None
    # draft tokens verified a step at most (speculative decoding): None = the
    # model's setting, 0 = none for this request
    speculative_tokens: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# one generated token's log-probabilities: (token id, its logprob, [(id, logprob) of
# the top alternatives, most likely first])
TokenLogprobs = tuple[int, float, list[tuple[int, float]]]


@dataclass
class Request:
    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # where its time goes to the first token: the HTTP request's, else its own
    stages: request_stages.Stages = field(default_factory=lambda: request_stages.current() or request_stages.Stages())


@dataclass(slots=True)  # one per token per request: slots make them cheaper to build
class RequestOutput:
    """New text and tokens since the last output of this request.

    Outputs of one request can be merged (`merge`) when the consumer lags, so a
    slow reader gets fewer, larger pieces instead of a growing queue.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_type: str | None = None  # "memory" | "internal"; decides the HTTP status
    first_token_time: float | None = None
    # one entry per generated token, for requests that asked (SamplingParams.logprobs),
    # else None; a stop token that ends the request unseen (EOS) has none
    logprobs: list[TokenLogprobs] | None = None

    def merge(self, later: RequestOutput) -> RequestOutput:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.stop_sequence = later.stop_sequence
        self.completion_tokens = later.completion_tokens
        self.cached_tokens = later.cached_tokens
        self.error = later.error
        self.error_type = later.error_type
        self.first_token_time = self.first_token_time or later.first_token_time
        return self


class MemoryGuardError(Exception):
    """A prefill would need more memory than the limit allows."""

    def __init__(self, needed: int, limit: int, prompt_tokens: int, max_tokens: int = 0):
        self.needed, self.limit, self.prompt_tokens = needed, limit, prompt_tokens
        generating = f" and generating up to {max_tokens} tokens" if max_tokens else ""
        super().__init__(
            f"Request refused: processing this {prompt_tokens}-token prompt{generating} needs an "
            f"estimated {needed / 2**20:.0f} MiB, above the memory limit of "
            f"{limit / 2**20:.0f} MiB. Send a shorter prompt or fewer max_tokens, "
            f"or raise --memory-limit."
        )
