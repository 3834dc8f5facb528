"""Token ids of a rendered chat, reusing the ids of the pieces seen before.

An agent sends its whole conversation every turn: 20k tokens of it take the
tokenizer 10-20 ms a turn on these machines, every turn, though all but the
last messages are the ones it tokenized a turn ago. A chat template puts the
model's special tokens (`<|im_start|>`, `<end_of_turn>`, ...) between the
messages, and the tokenizer cuts its input at those before anything else (a
BPE merge never spans one), so the text between two of them tokenizes the same
wherever it stands. The ids of each such piece are kept (least recently used
first out, up to MAX_CACHED_TOKENS), and a new turn tokenizes only the pieces
it has not sent before.

Whether cutting gives exactly the tokenizer's own ids depends on the tokenizer
(a SentencePiece one that adds a space only at the start of the whole text
would not), so it is checked: on a probe chat when a tokenizer is first used,
before any prompt; then on the first CHECKED_PROMPTS prompts and one in
CHECK_EVERY after, each against the whole text tokenized at once, on a thread
of its own (a check on the request's way would double the first turns' cost,
170 ms at 60k tokens on the H200's host). Any difference turns the cache off
for that tokenizer, logged, and every later prompt is tokenized whole.

A piece the cache does not hold yet that is long (a file in the first
message: what a new process meets on every prompt, and a cold prompt too) is
tokenized in parts cut at blank lines, all parts at once on the tokenizer's
own threads. Where exactly a blank line may be cut depends on the tokenizer's
pre-tokenizer (Qwen's and Llama 3's keep "\n\n" with what comes before it,
GPT-2's gives the last newline to what follows), so the first of LINE_CUTS
whose parts give a probe text's own ids is used. That is checked like the
pieces, apart: a difference the parts make turns them off and leaves the
pieces on.

The encoders are kept per tokenizer object (`encode_rendered`), so the API and
`tierlm.LLM` share them without passing them around; they go with the model.
A server gives each a file beside the SSD tier (piece_store), which keeps its
pieces across restarts.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierlm.serving import piece_store

log = logging.getLogger(__name__)

MAX_CACHED_TOKENS = 4_000_000  # ~16 MB of ids (and the pieces' text beside them)
CHECKED_PROMPTS = 4
CHECK_EVERY = 64
# A check starts this long after its prompt was tokenized: it holds the GIL for
# milliseconds of Python (the whole text's ids), which the request's own way to
# the engine waited for (+3.4 ms on the first prompts, the 2-core Xeon)
CHECK_AFTER_S = 0.05
LONG_PIECE = 16_000  # characters: a new piece longer than this is tokenized in parts, in parallel
PART = 4_000  # characters a part holds at least
LINE_CUTS = (re.compile(r"(?<=\n\n)(?=\S)"),  # after a blank line
             re.compile(r"(?<=\n)(?=\n\S)"))  # before the last newline of a blank line
_LINES_PROBE = ('def f(a):\n    return a + 1  # one\n\n\ndef g(b):\n    """Doc."""\n    return [b, 2]\n\n'
                "class C:\n    pass\n\nSome prose, with 123 numbers.\n\n- an item\n- another: (x)\n\nEnd.\n")
_PROBE = [  # what a probe chat holds: spaces, newlines, digits, code, accents, emoji
    {"role": "system", "content": "You are a helpful assistant.\n  Indent: 4 spaces."},
    {"role": "user", "content": " leading space, x=1234567 résumé 日本語 🙂\n\n\tdef f(a):\n        return a"},
    {"role": "assistant", "content": "Sure:  two  spaces\n"},
    {"role": "user", "content": "trailing newline\n"},
]


class PieceEncoder:
    """Ids of rendered chat text for one tokenizer, cut at its special tokens."""

    def __init__(self, tokenizer, store: Path | None = None):
        """`store`: the file its pieces are kept in across restarts (piece_store)."""
        self.tokenizer = tokenizer
        self.store = store
        self._saved_at, self._unsaved = time.monotonic(), False
        self.cuts = _cuts(tokenizer)  # the special tokens the text is cut at
        self._pattern = re.compile("(" + "|".join(map(re.escape, self.cuts)) + ")") if self.cuts else None
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self._prompts = 0
        self.hits = self.misses = 0  # pieces reused, pieces tokenized
        self._batch = _batch_encoder(tokenizer)  # many texts at once, on the tokenizer's threads (or None)
        self.line_cut = self._line_cut() if self._batch is not None else None  # parts of long new pieces
        self.enabled = self._pattern is not None and self._probe()
        if self.enabled:  # the checker's thread starts now, not in a request's first submit (~3 ms on the Xeon)
            _checker.submit(int)
            if store is not None:
                self._keep(piece_store.read(store))
        self._unsaved = False  # what the file holds, and the probe's pieces

    def encode(self, text: str) -> list[int]:
        if not self.enabled:
            return self._whole(text)
        cut = self.line_cut  # as it is now: a check on the checker's thread may turn it off meanwhile
        ids = self._by_pieces(text, cut)
        self._prompts += 1
        if self._prompts <= CHECKED_PROMPTS or self._prompts % CHECK_EVERY == 0:
            _checker.submit(self._check_later, text, ids, cut)
        if self.store is not None and self._unsaved and time.monotonic() - self._saved_at >= piece_store.SAVE_EVERY_S:
            self._saved_at = time.monotonic()
            _checker.submit(self.save)
        return ids

    def stats(self) -> dict:
        """Pieces reused and tokenized, and what the cache holds."""
        with self._lock:
            return {"enabled": self.enabled, "hits": self.hits, "misses": self.misses, "pieces": len(self._pieces),
                    "tokens": self._tokens, "store": None if self.store is None else str(self.store)}

    def save(self) -> None:
        """Its pieces into its store, if it has one and new pieces came since the
        last save (an encoder turned off leaves none: the file goes)."""
        if self.store is None or not self._unsaved:
            return
        with self._lock:
            pieces, self._unsaved = list(self._pieces.items()), False
        self._saved_at = time.monotonic()
        try:
            if pieces:
                piece_store.write(self.store, pieces)
            else:
                self.store.unlink(missing_ok=True)
        except OSError as e:
            log.warning("prompt pieces: could not keep them in %s: %s", self.store, e)

    def _check_later(self, text: str, ids: list[int], cut: re.Pattern | None) -> None:
        time.sleep(CHECK_AFTER_S)
        self.check(text, ids, cut)

    def check(self, text: str, ids: list[int], cut: re.Pattern | None = None) -> bool:
        """Whether `ids` (made with the parts `cut` gives) are the whole text's;
        if not, the parts (where they made the difference) or the cache are off
        from now on."""
        whole = self._whole(text)
        if whole == ids:
            return True
        if cut and self._fresh(text, cut) != whole and self._fresh(text, None) == whole:
            self._disable_lines("a prompt")
        else:
            self._disable("a prompt")
        return False

    def _fresh(self, text: str, cut) -> list[int]:
        """The text's ids by pieces (long ones in parts where `cut`), none from the cache."""
        return [i for piece in self._split(text) for part in _new_parts(piece, cut) for i in self._encode(part)]

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode(self, piece: str) -> list[int]:
        return list(self.tokenizer.encode(piece, add_special_tokens=False))

    def _split(self, text: str) -> list[str]:
        return [piece for piece in self._pattern.split(text) if piece]

    def _by_pieces(self, text: str, cut: re.Pattern | None = None) -> list[int]:
        pieces = self._split(text)
        found = [self._cached(piece) for piece in pieces]
        missing = list(dict.fromkeys(p for p, ids in zip(pieces, found) if ids is None))
        if missing:
            made = dict(zip(missing, self._tokenize(missing, cut)))
            found = [made[p] if ids is None else ids for p, ids in zip(pieces, found)]
        return [i for ids in found for i in ids]

    def _cached(self, piece: str) -> array | None:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
            return ids

    def _tokenize(self, pieces: list[str], cut: re.Pattern | None) -> list[array]:
        """The pieces' ids, kept: long ones in parts where `cut`, and all at once
        where the tokenizer can."""
        texts = [_new_parts(p, cut) for p in pieces]
        flat = [t for parts in texts for t in parts]
        encoded = iter(self._batch(flat) if self._batch is not None and len(flat) > 1 else map(self._encode, flat))
        made = [array("I", [i for _ in parts for i in next(encoded)]) for parts in texts]
        with self._lock:
            self.misses += len(pieces)
        self._keep(zip(pieces, made))
        return made

    def _keep(self, pieces) -> None:
        """(text, ids) pairs into the cache, the oldest out past MAX_CACHED_TOKENS."""
        with self._lock:
            for piece, ids in pieces:
                if piece not in self._pieces:
                    self._pieces[piece] = ids
                    self._tokens += len(ids)
                    self._unsaved = True
            while self._tokens > MAX_CACHED_TOKENS and self._pieces:
                self._tokens -= len(self._pieces.popitem(last=False)[1])

    def _probe(self) -> bool:
        """Whether the probe chat's pieces give the whole text's ids (the parts
        of long pieces have a probe of their own: `_line_cut`)."""
        try:
            text = self.tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
        except Exception:  # no template, or one that wants other messages: the prompts will tell
            return True
        if not isinstance(text, str):
            return True
        if self._by_pieces(text) == self._whole(text):
            return True
        self._disable("a probe chat")
        return False

    def _disable(self, what: str) -> None:
        self.enabled = False
        self._forget()
        log.warning("tokenizing a chat piece by piece differs from tokenizing it whole on %s; "
                    "this model's prompts are tokenized whole", what)

    def _line_cut(self):
        """The first of LINE_CUTS whose parts give the probe text's ids (None: none does)."""
        whole = self._whole(_LINES_PROBE)
        for cut in LINE_CUTS:
            if [i for p in _parts(_LINES_PROBE, 1, cut) for i in self._encode(p)] == whole:
                return cut
        return None

    def _disable_lines(self, what: str) -> None:
        self.line_cut = None
        self._forget()
        log.warning("tokenizing a long chat piece in parts cut at blank lines differs from tokenizing it whole "
                    "on %s; this model's pieces are tokenized whole", what)

    def _forget(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._tokens = 0
            self._unsaved = True  # the store's pieces go too


def _new_parts(piece: str, cut: re.Pattern | None) -> list[str]:
    """What a piece the cache does not hold is tokenized as: parts where `cut`
    is given and the piece is long, else the piece."""
    return _parts(piece, PART, cut) if cut is not None and len(piece) > LONG_PIECE else [piece]


def _parts(piece: str, part: int, cut: re.Pattern) -> list[str]:
    """`piece` cut where `cut` matches into parts of at least `part` characters."""
    parts, start = [], 0
    while len(piece) - start > part:
        found = cut.search(piece, start + part)
        if found is None:
            break
        parts.append(piece[start : found.start()])
        start = found.start()
    parts.append(piece[start:])
    return parts


def _batch_encoder(tokenizer):
    """A function giving the ids of many texts at once on the tokenizer's own
    threads (Hugging Face's Rust tokenizer), or None where there is none."""
    inner = tokenizer
    for _ in range(3):  # mlx-lm's wrapper -> transformers' fast tokenizer -> the Rust tokenizer
        if hasattr(inner, "encode_batch") and not hasattr(inner, "apply_chat_template"):
            return lambda texts: [e.ids for e in inner.encode_batch(texts, add_special_tokens=False)]
        inner = getattr(inner, "_tokenizer", None)
        if inner is None:
            return None
    return None


def _cuts(tokenizer) -> list[str]:
    """The special tokens its chat template may write, longest first (a pattern
    of them finds the longest at a place, as the tokenizer does). Only tokens
    the tokenizer matches as they stand (no stripping of the spaces around them,
    not inside another added token) cut: another one inside a piece is found by
    the tokenizer there, as in the whole text."""
    template = getattr(tokenizer, "chat_template", None)  # mlx-lm's wrapper passes these on
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(template, str) or not isinstance(added, dict):
        return []
    named = {getattr(tokenizer, name, None) for name in ("bos_token", "eos_token")}
    contents = [t.content for t in added.values()]
    return sorted({
        t.content for t in added.values()
        if t.special and t.content and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        and (t.content in template or t.content in named)
        and not any(t.content in other and t.content != other for other in contents)
    }, key=len, reverse=True)


_checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierlm-piece-check")
_encoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_encoders_lock = threading.Lock()


def encoder_for(tokenizer, store: Path | None = None) -> PieceEncoder:
    """The tokenizer's PieceEncoder, made (and probed) on first use; `store`:
    where a new one keeps its pieces across restarts."""
    with _encoders_lock:
        encoder = _encoders.get(tokenizer)
        if encoder is None:
            encoder = _encoders[tokenizer] = PieceEncoder(tokenizer, store)
        return encoder


def _existing(tokenizer) -> PieceEncoder | None:
    """The tokenizer's encoder if it has one (none is made)."""
    with _encoders_lock:
        return _encoders.get(tokenizer)


def stats_of(tokenizer) -> dict | None:
    """The tokenizer's encoder's counts (None before it has one)."""
    encoder = _existing(tokenizer)
    return None if encoder is None else encoder.stats()


def forget(tokenizer) -> None:
    """The tokenizer's pieces dropped, in memory and in their store (the SSD
    folder cleared: it holds text of the prompts)."""
    encoder = _existing(tokenizer)
    if encoder is not None:
        encoder._forget()
        encoder.save()


def save_all() -> None:
    """Every encoder's new pieces into its store (a server stopping)."""
    with _encoders_lock:
        encoders = list(_encoders.values())
    for encoder in encoders:
        encoder.save()


def encode_rendered(tokenizer, text: str) -> list[int]:
    """The ids of a chat the model's own template rendered (`text`), as
    `tokenizer.encode(text, add_special_tokens=False)` gives them."""
    return encoder_for(tokenizer).encode(text)
