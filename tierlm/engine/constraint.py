"""Token constraints: which tokens a request may sample next.

The engine knows no grammar. A request may carry a `TokenConstraint` (built by
the adapter: a JSON schema, a tool-call grammar, a thinking budget); the
scheduler turns it into one more logits processor of that request, so a
constrained request decodes in the same batch as the others and its mask is
its own.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np


class TokenConstraint(Protocol):
    def consume(self, token: int) -> None:
        """The token the request just sampled."""

    def allowed(self, vocab: int) -> np.ndarray | None:
        """The tokens the request may sample next, as a bool array of `vocab`
        entries; None when every token is allowed."""


class AllOf:
    """Several constraints at once: a token must pass each of them."""

    def __init__(self, *constraints: TokenConstraint):
        self.constraints = constraints

    def consume(self, token: int) -> None:
        for c in self.constraints:
            c.consume(token)

    def allowed(self, vocab: int) -> np.ndarray | None:
        masks = [m for c in self.constraints if (m := c.allowed(vocab)) is not None]
        if not masks:
            return None
        return np.logical_and.reduce(masks) if len(masks) > 1 else masks[0]


def constraint_processor(constraint: TokenConstraint):
    """A logits processor (mlx-lm's `(tokens, logits) -> logits`) that masks out
    what `constraint` forbids.

    mlx-lm calls it once per decode step with the tokens so far; on the first
    call the last one is the prompt's, afterwards the token sampled last. That
    token's value is needed before the mask can be computed: the model's step
    for the batch is started first (`async_eval`), so the mask is computed on
    this thread while the step runs."""
    calls = 0

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        mx.async_eval(logits)
        if calls:
            constraint.consume(int(tokens[-1].item()))
        calls += 1
        mask = constraint.allowed(logits.shape[-1])
        if mask is None:
            return logits
        return mx.where(mx.array(mask), logits, mx.array(-float("inf"), logits.dtype))

    return process
