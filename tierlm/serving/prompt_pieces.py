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

The encoders are kept per tokenizer object (`encode_rendered`), so the API and
`tierlm.LLM` share them without passing them around; they go with the model.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

MAX_CACHED_TOKENS = 4_000_000  # ~16 MB of ids (and the pieces' text beside them)
CHECKED_PROMPTS = 4
CHECK_EVERY = 64
_PROBE = [  # what a probe chat holds: spaces, newlines, digits, code, accents, emoji
    {"role": "system", "content": "You are a helpful assistant.\n  Indent: 4 spaces."},
    {"role": "user", "content": " leading space, x=1234567 résumé 日本語 🙂\n\n\tdef f(a):\n        return a"},
    {"role": "assistant", "content": "Sure:  two  spaces\n"},
    {"role": "user", "content": "trailing newline\n"},
]


class PieceEncoder:
    """Ids of rendered chat text for one tokenizer, cut at its special tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cuts = _cuts(tokenizer)  # the special tokens the text is cut at
        self._pattern = re.compile("(" + "|".join(map(re.escape, self.cuts)) + ")") if self.cuts else None
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self._prompts = 0
        self.hits = self.misses = 0  # pieces reused, pieces tokenized
        self.enabled = self._pattern is not None and self._probe()

    def encode(self, text: str) -> list[int]:
        if not self.enabled:
            return self._whole(text)
        ids = self._by_pieces(text)
        self._prompts += 1
        if self._prompts <= CHECKED_PROMPTS or self._prompts % CHECK_EVERY == 0:
            _checker.submit(self.check, text, ids)
        return ids

    def check(self, text: str, ids: list[int]) -> bool:
        """Whether `ids` are the whole text's; if not, the cache is off from now on."""
        if self._whole(text) == ids:
            return True
        self._disable("a prompt")
        return False

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _by_pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._pattern.split(text):
            if piece:
                ids.extend(self._piece(piece))
        return ids

    def _piece(self, piece: str) -> array | list[int]:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                return ids
        ids = array("I", self.tokenizer.encode(piece, add_special_tokens=False))
        with self._lock:
            self.misses += 1
            if piece not in self._pieces:
                self._pieces[piece] = ids
                self._tokens += len(ids)
            while self._tokens > MAX_CACHED_TOKENS and self._pieces:
                self._tokens -= len(self._pieces.popitem(last=False)[1])
        return ids

    def _probe(self) -> bool:
        """Whether the probe chat's pieces give the whole text's ids."""
        try:
            text = self.tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
        except Exception:  # no template, or one that wants other messages: the prompts will tell
            return True
        if not isinstance(text, str) or self._by_pieces(text) == self._whole(text):
            return True
        self._disable("a probe chat")
        return False

    def _disable(self, what: str) -> None:
        self.enabled = False
        with self._lock:
            self._pieces.clear()
            self._tokens = 0
        log.warning("tokenizing a chat piece by piece differs from tokenizing it whole on %s; "
                    "this model's prompts are tokenized whole", what)


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


def encoder_for(tokenizer) -> PieceEncoder:
    """The tokenizer's PieceEncoder, made (and probed) on first use."""
    with _encoders_lock:
        encoder = _encoders.get(tokenizer)
        if encoder is None:
            encoder = _encoders[tokenizer] = PieceEncoder(tokenizer)
        return encoder


def encode_rendered(tokenizer, text: str) -> list[int]:
    """The ids of a chat the model's own template rendered (`text`), as
    `tokenizer.encode(text, add_special_tokens=False)` gives them."""
    return encoder_for(tokenizer).encode(text)
