"""Incremental detokenizing with stop strings, never emitting broken UTF-8."""

from __future__ import annotations

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder


class IncrementalText:
    """Turns a request's tokens into text deltas and watches for stop strings.

    mlx-lm's streaming detokenizer holds back bytes until they form whole UTF-8
    characters. On top of that we hold back any tail of the text that could be
    the start of a stop string, so a stop string split across tokens (or chunks)
    is still found and never shown to the client.
    """

    def __init__(self, detokenizer, stop: list[str], bytes_table: list[bytes] | None = None,
                 keep_leading_space: bool = False):
        """`bytes_table`: `byte_level_table(detokenizer)`, built once per model; with
        it, a byte-level detokenizer takes the fast path (ByteLevelStream).
        `keep_leading_space`: the first text keeps its leading space (mlx-lm trims it)."""
        if bytes_table is not None:
            self._stream = ByteLevelStream(bytes_table, keep_leading_space)
        else:
            self._stream = MlxLmStream(detokenizer, keep_leading_space)
        self._stop = [s for s in stop if s]
        self._held = ""  # decoded but not yet emitted
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def watches_stops(self) -> bool:
        return bool(self._stop)

    def add(self, token: int) -> str:
        segment = self._stream.add(token)
        return self._release(segment, final=False) if self._stop else segment

    def add_many(self, tokens: list[int]) -> str:
        """The text of several tokens, all that `add` one by one would give. With
        stop strings, the caller must still look at `stopped` token by token."""
        if self._stop:
            return "".join([self.add(t) for t in tokens])
        return self._stream.add_many(tokens)

    def finish(self) -> str:
        """Flush what is left once the request ends for another reason."""
        return self._release(self._stream.finish(), final=True)

    def _release(self, segment: str, final: bool) -> str:
        if not self._stop:  # nothing to hold back or look for (most requests)
            return segment
        if self.stopped:
            return ""
        text = self._held + segment
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self.matched = next(s for s in self._stop if text.find(s) == cut)
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


class MlxLmStream:
    """Text deltas from any of mlx-lm's streaming detokenizers."""

    def __init__(self, detokenizer, keep_leading_space: bool = False):
        self._detok = detokenizer
        if keep_leading_space and hasattr(detokenizer, "trim_space"):  # SentencePiece's
            detokenizer.trim_space = False
        self._detok.reset()

    def add(self, token: int) -> str:
        self._detok.add_token(token)
        return self._detok.last_segment

    def add_many(self, tokens: list[int]) -> str:
        return "".join([self.add(t) for t in tokens])

    def finish(self) -> str:
        self._detok.finalize()
        return self._detok.last_segment


class ByteLevelStream:
    """The text of mlx-lm's BPEStreamingDetokenizer (byte-level BPE: GPT-2, Llama 3,
    SmolLM2, Qwen), delta for delta, at a quarter of its cost per token: each
    token's bytes come from a table built once per vocabulary, and one C call
    decodes them. It runs for every generated token of every request on the
    worker thread, which at batch 32 on a GPU is the bottleneck.

    Same rules as mlx-lm: bytes that end in an incomplete UTF-8 character, or a
    lone space token, wait for the next token; the first text loses one leading
    space."""

    def __init__(self, bytes_table: list[bytes], keep_leading_space: bool = False):
        self._bytes = bytes_table
        self._unflushed = b""
        self._started = keep_leading_space  # some text was emitted (or none is to be trimmed)

    def add(self, token: int) -> str:
        piece = self._bytes[token] if token < len(self._bytes) else b"!"  # mlx-lm's padded-vocab fallback
        data = self._unflushed + piece
        text = data.decode("utf-8", "replace")
        if piece == b" " or text.endswith("\ufffd"):
            self._unflushed = data
            return ""
        self._unflushed = b""
        return text if self._started else self._first(text)

    def add_many(self, tokens: list[int]) -> str:
        """What `add` gives token by token, joined, with one decode for all of them
        (a fifth of the cost at 8 tokens). Before the first text, or where the last
        token leaves bytes waiting, the tokens go one by one: what is trimmed or held
        back then is theirs to say."""
        if not self._started or not tokens:
            return "".join([self.add(t) for t in tokens])
        n = len(self._bytes)
        pieces = [self._bytes[t] if t < n else b"!" for t in tokens]  # add's padded-vocab fallback
        text = (self._unflushed + b"".join(pieces)).decode("utf-8", "replace")
        if pieces[-1] == b" " or text.endswith("\ufffd"):
            return "".join([self.add(t) for t in tokens])
        self._unflushed = b""
        return text

    def finish(self) -> str:
        text = self._unflushed.decode("utf-8", "replace")
        self._unflushed = b""
        return text if self._started else self._first(text)

    def _first(self, text: str) -> str:
        if text[:1] == " ":
            text = text[1:]
        self._started = bool(text)
        return text


def byte_level_table(detokenizer) -> list[bytes] | None:
    """Every token's bytes, for ByteLevelStream; None unless `detokenizer` is
    mlx-lm's byte-level one. ~40 ms for 49k tokens: build it once per model."""
    if not isinstance(detokenizer, BPEStreamingDetokenizer):
        return None
    return [token_bytes(t) for t in detokenizer.tokenmap]


def token_bytes(token: str) -> bytes:
    """A byte-level token's bytes, as mlx-lm's detokenizer maps them (characters
    outside the byte alphabet, and the one that maps to byte 0, as their UTF-8)."""
    decoder = _byte_decoder()
    out = bytearray()
    for c in token:
        b = decoder.get(c)
        if b:
            out.append(b)
        else:
            out += c.encode()
    return bytes(out)
