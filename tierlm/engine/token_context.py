"""A row's token context, made an array only when something reads it.

mlx-lm's GenerationBatch keeps, for every row, a TokenBuffer of every token
the row has fed (its whole prompt at the start), for logits processors
(repetition penalties) alone: it updates and reads a row's buffer only if the
row has processors. Yet it builds each buffer when the batch is made, an
`mx.array` of the whole prompt: ~1 ms for a 20k-token prompt, on the path of
every hit's first token. Here the buffer holds the list until it is first read.

`install` puts LazyTokenBuffer where GenerationBatch looks the name up;
tests/test_first_token.py fails loudly if that changes.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import TokenBuffer

from tierlm.backends import mlx_lm_generate


class LazyTokenBuffer(TokenBuffer):
    """TokenBuffer, its `_buffer` built from the tokens it was given at first use."""

    def __init__(self, tokens=None):  # TokenBuffer's __init__ builds the array: not called
        # mlx-lm's batch goes on appending to this very list (its `tokens` row):
        # the buffer holds its first `_size`, what the row had fed when made
        self._pending = [] if tokens is None else tokens
        self._size = len(self._pending)
        self._array = None

    @property
    def _buffer(self) -> mx.array:
        if self._array is None:
            self._array = mx.array(self._pending[: self._size], dtype=mx.int32)
            self._pending = None
        return self._array

    @_buffer.setter
    def _buffer(self, value: mx.array) -> None:
        self._array, self._pending = value, None


def install() -> None:
    mlx_lm_generate().TokenBuffer = LazyTokenBuffer
