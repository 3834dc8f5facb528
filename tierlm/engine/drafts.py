"""Draft tokens from a sequence's own context (prompt lookup), and how many to draft.

A coding agent's answers copy much of their prompt: a file sent back with one
function changed, a patch quoting its context, a path repeated in a tool call.
When the last few tokens of a sequence occurred earlier in its prompt or its
output, the tokens that followed them there are a good guess for what comes
next; the batch verifies such guesses several at a time (speculative_batch).
"""

from __future__ import annotations


class PromptLookup:
    """One sequence's tokens with an index of their n-grams, for n from
    `ngram_max` down to `ngram_min`: each n-gram maps to where the tokens after
    its latest occurrence start. The sequence's own last n-gram is indexed only
    once a token follows it, so a look-up finds an earlier occurrence."""

    def __init__(self, tokens: list[int], ngram_min: int = 2, ngram_max: int = 3):
        self.tokens: list[int] = []
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self._index: dict[tuple[int, ...], int] = {}  # n-grams of every size share one dict
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._index_last()
            self.tokens.append(token)

    def _index_last(self) -> None:
        """Index the n-grams ending at the current last token: the token about to
        be appended follows them."""
        end = len(self.tokens)
        for n in self.sizes:
            if end >= n:
                self._index[tuple(self.tokens[end - n : end])] = end

    def propose(self, k: int, last: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the
        longest recurring suffix of the tokens and then `last` (sampled, not yet
        appended); none if no suffix of `ngram_min` tokens recurs."""
        tokens = self.tokens
        for n in self.sizes:
            if len(tokens) < n - 1:
                continue
            start = self._index.get((*tokens[len(tokens) - n + 1 :], last))
            if start is not None:
                draft = tokens[start : start + k]
                return draft + [last] if len(draft) < k and start + len(draft) == len(tokens) else draft
        return []


class Acceptance:
    """How likely one sequence's next draft token is to be accepted: a draft
    token is accepted only if those before it were, so a draft of k tokens is
    expected to add alpha + alpha^2 + ... + alpha^k tokens. Alpha is counted
    from its recent drafts (older ones count less), from a prior of 0.6: a
    sequence's first drafts are worth trying where a token costs little more
    than one."""

    def __init__(self, memory: float = 0.7):
        self.memory = memory
        self.accepted = self.rejected = 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.2) / (self.accepted + self.rejected + 2)

    def expected(self, k: int) -> float:
        """Tokens a draft of k tokens is expected to add."""
        a = self.alpha
        return a * (1 - a**k) / (1 - a) if a < 1 else float(k)

    def fade(self, keep: float = 0.97) -> None:
        """A step without a draft: the record counts a little less (after ~50
        such steps alpha is most of the way back to its prior), so a sequence
        that stopped drafting tries again."""
        self.accepted *= keep
        self.rejected *= keep

    def record(self, proposed: int, accepted: int) -> None:
        self.accepted = self.memory * self.accepted + accepted
        self.rejected = self.memory * self.rejected + (accepted < proposed)
