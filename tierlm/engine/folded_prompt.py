"""A short prompt end computed in one pass with its last token.

mlx-lm's BatchGenerator prefills a prompt but for its last token, then feeds
that token alone as the generation batch's first step: two model calls before
the first token is sampled, the second one over the whole context (on the CPU,
a 2k-token hit's next turn: 45-50 ms of ~0.3 s). The split exists so the model's
head multiplies one position, not every prompt position. Here the uncached end
of a prompt, when it is short, is held back from the prompt batch
(`FoldedEnds.hold`) and computed in the generation batch's first step together
with the last token; the backbone's hidden states are cut to each row's last
position before the head (`_AtPositions`), so the head still multiplies one
position a row.

A sequence moving from the prompt batch to generation takes its caches with
it as they are when the whole batch moves (`split`), not copied twice.

This module reaches inside mlx-lm's PromptProcessingBatch (its `generate`, its
`_copy` and `split`, the padding it feeds ragged rows with, the BatchGenerator's unprocessed
sequences) and into a model's backbone attribute; tests/test_folded_prompt.py
fails loudly if either changes.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.generate import PromptProcessingBatch, _right_pad_prompts


class FoldedEnds:
    """Prompt ends held back for a sequence's first step (uid → tokens), shared by
    a generator and its prompt batches; `computed` counts their tokens once run."""

    def __init__(self) -> None:
        self.by_uid: dict[int, list[int]] = {}
        self.computed = 0

    def hold(self, pending, limit: int) -> None:
        """Take the prompt end out of each newly inserted sequence
        (BatchGenerator's `(uid, segments, ...)` entries) whose uncached tokens
        are that end, of at most `limit` tokens, and the final token: its first
        step computes it. A longer prompt keeps its prompt batch segments to the
        end: where its prefill ends, the blocks it made are stored for requests
        that came meanwhile with the same start (they wait for it)."""
        for entry in pending:
            uid, segments = entry[0], entry[1]
            if len(segments) == 2 and len(segments[-1]) == 1 and 0 < len(segments[0]) <= limit:
                self.by_uid[uid] = segments.pop(0)

    def drop(self, uids) -> None:
        for uid in uids:
            self.by_uid.pop(uid, None)


class FoldingPromptBatch(PromptProcessingBatch):
    """A prompt batch whose sequences, on moving to generation, run their held
    back prompt end and last token in one model call."""

    folds: FoldedEnds

    @classmethod
    def empty_with(cls, folds: FoldedEnds, model, fallback_sampler, prefill_step_size: int):
        batch = cls.empty(model, fallback_sampler, prefill_step_size)
        batch.folds = folds
        return batch

    def _copy(self):  # `split` copies the batch field by field: keep the shared folds
        batch = super()._copy()
        batch.folds = self.folds
        return batch

    def split(self, indices: list[int]):
        """The rows `indices` as a batch of their own, leaving the rest here.
        mlx-lm's split deep-copies the caches and gathers the rows out of the
        copy: every moving row's KV copied twice (a 20k-token hit of a 1B model:
        ~5 ms of gathers on an H100, on the way to its first token). When every
        row moves on (a lone request, the common case) the caches move as they
        are."""
        if sorted(indices) != list(range(len(self.uids))):
            return super().split(indices)
        moved = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, list):  # filter([]) below empties the prompt cache's list in place
                setattr(moved, name, list(value))
        self.filter([])
        return moved

    def generate(self, tokens: list[list[int]]):
        rows = [self.folds.by_uid.pop(uid, []) + list(t) for uid, t in zip(self.uids, tokens)]
        if all(len(row) == 1 for row in rows):
            return super().generate(tokens)
        self.folds.computed += sum(len(row) - 1 for row in rows)
        for held, row in zip(self.tokens, rows):
            held += row[:-1]  # the tokens the cache holds once the first step ran
        model, self.model = self.model, _FirstStep(self.model, rows)
        try:
            batch = super().generate([row[-1:] for row in rows])
        finally:
            self.model = model
        batch.model = model
        return batch


class _FirstStep:
    """Stands in for the model in a generation batch's first step: runs each row's
    held back prompt end and last token (right-padded where rows differ, as the
    prompt batch pads), and gives back the logits of each row's last token."""

    def __init__(self, model, rows: list[list[int]]):
        self.model, self.rows = model, rows

    def __call__(self, last_tokens: mx.array, cache):
        lengths = [len(row) for row in self.rows]
        padding = [max(lengths) - n for n in lengths]
        ragged = max(padding) > 0
        if ragged:
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        logits = last_position_logits(self.model, _right_pad_prompts(self.rows), cache, mx.array(lengths) - 1)
        if ragged:
            for c in cache:
                c.finalize()
        return logits


def last_position_logits(model, inputs: mx.array, cache, positions: mx.array) -> mx.array:
    """The model's logits at one position per row, shape (rows, 1, vocabulary):
    its backbone's hidden states are cut to those positions before its head."""
    backbone = model["model"]
    model["model"] = _AtPositions(backbone, positions)
    try:
        return model(inputs, cache=cache)
    finally:
        model["model"] = backbone


def can_fold(model) -> bool:
    """Whether the model runs through a backbone held as `model.model` (mlx-lm's
    decoder models): what `last_position_logits` cuts."""
    return callable(model.get("model") if hasattr(model, "get") else None)


class _AtPositions:
    """A backbone whose hidden states come back at one position per row."""

    def __init__(self, backbone, positions: mx.array):
        self._backbone, self._positions = backbone, positions

    def __call__(self, *args, **kwargs):
        hidden = self._backbone(*args, **kwargs)
        return hidden[mx.arange(hidden.shape[0]), self._positions][:, None]

    def __getattr__(self, name):  # a tied head reads the embedding through it
        return getattr(self._backbone, name)
