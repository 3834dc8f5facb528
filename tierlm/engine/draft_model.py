"""Draft tokens from a smaller model of the same tokenizer, for every drafting
sequence of the batch at once.

The draft model keeps a batch cache of its own, one ragged row per drafting
sequence (ragged_kv), beside the target's. A row holds the sequence's tokens
as far as the draft model has read them (`fed`); drafting first feeds each row
what it has not read yet (a sequence joining reads its whole prompt, a chunk at
a time), then asks for one greedy token a pass. After the target's
verification each row keeps the draft tokens the sequence really has and gives
back the rest (`settle`), exactly as the target's rows do.

A greedy draft is a single proposed token per place, so the target's
verification keeps its distribution whatever it samples (speculative_batch).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache

from tierlm.engine.ragged_kv import RaggedBatchKVCache, RaggedWindowKVCache

PREFILL_CHUNK = 512  # prompt tokens the draft model reads a pass when a sequence joins


def load_draft_model(settings, tokenizer):
    """The draft model the settings name (`draft_model`: a model folder, or the
    name of one in the model folders), loaded as the model is; ValueError if it
    is missing or cannot draft for a model of `tokenizer`."""
    from tierlm.models.loader import load_model

    name = settings.draft_model
    folders = [Path(name).expanduser()] + [Path(d).expanduser() / name
                                          for d in (settings.model_dir, *settings.extra_model_dirs)]
    path = next((f for f in folders if (f / "config.json").is_file()), None)
    if path is None:
        raise ValueError(f"draft model {name}: no model folder there or in the model folders")
    draft, draft_tokenizer = load_model(path, settings.cpu_weights_dtype, settings.memory_limit_bytes(),
                                        use_cpu_kernels=settings.cpu_kernels, use_amx=settings.cpu_amx)
    check_draft_model(draft, draft_tokenizer, tokenizer, name)
    return draft


def check_draft_model(draft, draft_tokenizer, tokenizer, name: str) -> None:
    """Raise ValueError unless `draft` can draft for a model of `tokenizer`: the
    same tokens under the same ids, and a cache that can give tokens back."""
    ours, theirs = tokenizer.vocab, draft_tokenizer.vocab
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise ValueError(f"draft model {name}: its tokenizer is not the model's ({len(theirs)} tokens "
                         f"against {len(ours)}, {differ} token-id pairs differ); a draft model must share "
                         "the model's tokenizer")
    kinds = {type(c) for c in make_prompt_cache(draft)}
    if not kinds <= {KVCache, RotatingKVCache}:
        raise ValueError(f"draft model {name}: its cache ({', '.join(sorted(k.__name__ for k in kinds))}) "
                         "cannot give back rejected tokens")


class DraftModelSource:
    """Greedy drafts from `model` for the rows of a generation batch, by uid."""

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size  # ids past the tokenizer's (padded embeddings) are never drafted
        self.uids: list[int] = []  # the draft cache's rows, in order
        self.fed: dict[int, int] = {}  # uid -> tokens of the sequence its row holds
        self.cache: list | None = None  # one ragged batch cache per layer of the draft model
        self._proposed: dict[int, list[int]] = {}  # uid -> the tokens its row holds past the sequence's

    def propose(self, sequences: dict[int, list[int]], last: dict[int, int], k: int) -> dict[int, list[int]]:
        """k greedy draft tokens for each sequence (uid -> its tokens in the
        target's cache, and `last`, sampled and not yet in it)."""
        self._keep(list(sequences))
        for uid in list(self._proposed):  # drafted, then not verified (a plain step was cheaper)
            self.settle(uid, [])
        for uid in sequences:
            if uid not in self.fed:
                self._join(uid, sequences[uid])
        pending = [sequences[uid][self.fed[uid] :] + [last[uid]] for uid in self.uids]
        token = self._feed(pending)
        drafts = {uid: [t] for uid, t in zip(self.uids, token.tolist())}
        for _ in range(k - 1):
            token = self._feed([[d[-1]] for d in drafts.values()])
            for d, t in zip(drafts.values(), token.tolist()):
                d.append(t)
        for uid, d in drafts.items():
            self.fed[uid] = len(sequences[uid])  # its row now holds last and d[:-1] past them
            self._proposed[uid] = [last[uid], *d[:-1]]
        return drafts

    def settle(self, uid: int, emitted: list[int]) -> None:
        """The sequence took `emitted` (its last sampled token and the draft
        tokens it kept): its row keeps what it holds of them, gives back the rest."""
        held = self._proposed.pop(uid, None)
        if held is None:
            return
        kept = 0
        while kept < min(len(held), len(emitted)) and held[kept] == emitted[kept]:
            kept += 1
        self.fed[uid] += kept
        row = self.uids.index(uid)
        for c in self.cache:
            c.drop([len(held) - kept if i == row else 0 for i in range(len(self.uids))])

    def _keep(self, uids: list[int]) -> None:
        """Rows only for these sequences (the others finished, or stopped drafting)."""
        wanted = set(uids)
        keep = [i for i, uid in enumerate(self.uids) if uid in wanted]
        if len(keep) == len(self.uids):
            return
        for uid in self.uids:
            if uid not in wanted:
                self.fed.pop(uid, None)
                self._proposed.pop(uid, None)
        self.uids = [self.uids[i] for i in keep]
        if not keep:
            self.cache = None
        else:
            for c in self.cache:
                c.filter(keep)

    def _join(self, uid: int, tokens: list[int]) -> None:
        """A row for a sequence new to drafting: the draft model reads its tokens."""
        layers = make_prompt_cache(self.model)
        for start in range(0, len(tokens) - 1, PREFILL_CHUNK):  # all but the last: _feed reads it
            chunk = tokens[start : min(start + PREFILL_CHUNK, len(tokens) - 1)]
            self.model(mx.array([chunk]), cache=layers)
            mx.eval([c.state for c in layers])
        rows = [_ragged_row(c) for c in layers]
        if self.cache is None:
            self.cache = rows
        else:
            for c, row in zip(self.cache, rows):
                c.extend(row)
        self.uids.append(uid)
        self.fed[uid] = max(0, len(tokens) - 1)

    def _feed(self, pending: list[list[int]]) -> mx.array:
        """Each row's pending tokens in one pass (rows padded to the longest,
        the padding given back); each row's greedy next token."""
        width = max(len(p) for p in pending)
        inputs = mx.array([p + [p[-1]] * (width - len(p)) for p in pending], dtype=mx.uint32)
        logits = self.model(inputs, cache=self.cache)
        for c in self.cache:
            c.drop([width - len(p) for p in pending])
        at = mx.array([len(p) - 1 for p in pending])
        rows = mx.take_along_axis(logits, at[:, None, None], axis=1)[:, 0, : self.vocab_size]
        token = mx.argmax(rows, axis=-1)
        mx.eval(token)
        return token


def _ragged_row(cache):
    """One sequence's cache as a one-row ragged batch cache."""
    if isinstance(cache, RotatingKVCache):
        return RaggedWindowKVCache.of(BatchRotatingKVCache.merge([cache]))
    return RaggedBatchKVCache.of(BatchKVCache.merge([cache]))
