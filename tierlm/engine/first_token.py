"""A sequence's first token goes out before its second step is sent.

mlx-lm's generation batch is a pipeline: a step sends the next step's forward
pass to the device before it waits for the tokens it returns. A sequence's
first token (sampled by the pass that ran its prompt's end) therefore reaches
the client only after the second step has been built and launched: on an H100
with CUDA graphs off, ~1 ms of Python and ~2-4 ms of kernel launches for a 1B
model, on the path of every hot hit's first token (docs/prefix-cache.md).

Here, when sequences enter an empty batch (a lone request: an agent's turn),
the step after waits for their first tokens and returns them without sending
anything; the step after that feeds them (their KV, and the next tokens in
flight) and returns only the tokens of rows that joined meanwhile. From then
on the pipeline runs as mlx-lm's. A batch that is already decoding takes new
rows as mlx-lm does: waiting for their tokens would stall the others' steps.

This reaches inside mlx-lm's GenerationBatch (its pending tokens and log-
probabilities, the per-row counters, stop matchers and Response);
tests/test_first_token.py fails loudly if they change.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from tierlm.engine import token_context

token_context.install()  # a row's prompt is made an array only if its processors read it


class FirstTokensFirst(GenerationBatch):
    """A generation batch that posts the first tokens of rows entering it empty
    before their second step (`posting_step`, called first by `next`)."""

    post_first_tokens = True  # False: mlx-lm's pipeline from the first token (for comparisons)
    _unposted = False  # rows entered an empty batch: their first tokens are pending, unreturned
    _posted: frozenset = frozenset()  # uids whose first token went out before it was fed

    def extend(self, batch) -> None:
        was_empty = not self.uids
        super().extend(batch)
        if was_empty and self.uids and self.post_first_tokens:
            self._unposted = True

    def posting_step(self) -> list | None:
        """This step's responses where it posts first tokens or feeds posted
        ones; None where it is an ordinary step."""
        if self._unposted:
            self._unposted = False
            mx.eval(self._next_tokens, self._next_logprobs)
            self._posted = frozenset(self.uids)
            return self._respond(self._next_tokens.tolist(), self._next_logprobs, frozenset())
        if self._posted:
            posted, self._posted = self._posted, frozenset()
            tokens, logprobs = self._step()  # feeds the posted tokens: returns them again
            return self._respond(tokens, logprobs, posted)
        return None

    def _respond(self, tokens: list[int], logprobs: list, skip: frozenset) -> list:
        """mlx-lm's GenerationBatch.next after its step: each row's token counted
        and matched against its stop sequences, a finished row's cache taken
        and the row dropped; rows in `skip` (their token already went out)
        give no response."""
        keep, responses = [], []
        for i, uid in enumerate(self.uids):
            if uid in skip:
                keep.append(i)
                continue
            self._num_tokens[i] += 1
            finish = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
            if self._matchers[i].advance(tokens[i]):
                finish = "stop"
            if finish is None:
                keep.append(i)
                responses.append(self.Response(uid=uid, token=tokens[i], logprobs=logprobs[i], finish_reason=None,
                                               prompt_cache=None, all_tokens=None))
            else:
                responses.append(self.Response(uid=uid, token=tokens[i], logprobs=logprobs[i], finish_reason=finish,
                                               prompt_cache=self.extract_cache(i), all_tokens=self.tokens[i]))
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses
