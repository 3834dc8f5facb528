"""Incremental detokenizing with stop strings, never emitting broken UTF-8."""

from __future__ import annotations


class IncrementalText:
    """Turns a request's tokens into text deltas and watches for stop strings.

    mlx-lm's streaming detokenizer holds back bytes until they form whole UTF-8
    characters. On top of that we hold back any tail of the text that could be
    the start of a stop string, so a stop string split across tokens (or chunks)
    is still found and never shown to the client.
    """

    def __init__(self, detokenizer, stop: list[str]):
        self._detok = detokenizer
        self._detok.reset()
        self._stop = [s for s in stop if s]
        self._held = ""  # decoded but not yet emitted
        self.stopped = False

    def add(self, token: int) -> str:
        self._detok.add_token(token)
        return self._release(self._detok.last_segment, final=False)

    def finish(self) -> str:
        """Flush what is left once the request ends for another reason."""
        self._detok.finalize()
        return self._release(self._detok.last_segment, final=True)

    def _release(self, segment: str, final: bool) -> str:
        if not self._stop:  # nothing to hold back or look for (most requests)
            return segment
        if self.stopped:
            return ""
        text = self._held + segment
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = 0 if final else self._partial_stop_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best
