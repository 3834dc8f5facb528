"""Reasoning ("thinking") sections: which markers a model uses, splitting its
output text into reasoning and content, and a budget that closes the section.

The markers come from mlx-lm's inference (`TokenizerWrapper.has_thinking`,
`think_start`, `think_end`, `think_end_tokens`) unless the model's setting names
them. Splitting follows vLLM's reasoning parsers (deepseek_r1, qwen3): only the
first thinking section is reasoning; whatever follows its end is content,
verbatim.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tierlm.structured.events import ReasoningDelta, TextDelta

Delta = TextDelta | ReasoningDelta

# Where chat templates read an earlier answer's reasoning, sent back by the
# client: Qwen3's, DeepSeek's and GLM's `reasoning_content`, gpt-oss's
# `thinking`. Qwen3's renders it for the answers since the last user message
# (the steps of one tool-calling turn): left out, those steps would be rendered
# unlike what the model wrote, and their cached KV would not match.
REASONING_KEYS = ("reasoning_content", "thinking")


def with_reasoning(text: str) -> dict:
    """An assistant message's reasoning, under every key a template may read it
    from (one that reads none ignores them)."""
    return dict.fromkeys(REASONING_KEYS, text)


@dataclass(frozen=True)
class ThinkingMarkers:
    start: str  # e.g. "<think>"
    end: str  # e.g. "</think>"
    end_tokens: tuple[int, ...]  # token ids of `end`, to force it when the budget runs out


def marker_tokens(tokenizer, marker: str) -> tuple[int, ...]:
    """The token ids of `marker` as the model writes it: no BOS or other added tokens."""
    return tuple(tokenizer.encode(marker, add_special_tokens=False))


def markers_for(tokenizer, setting: str | None = None) -> ThinkingMarkers | None:
    """The thinking markers of a model, or None when its output is not split.

    `setting`: None (or "auto") = what mlx-lm infers from the vocabulary; "off" = no
    splitting; "START,END" = these markers."""
    if setting is None or setting.strip() == "auto":
        return _inferred_markers(tokenizer)
    if setting.strip() == "off":
        return None
    start, end = _parse_setting(setting)
    return ThinkingMarkers(start, end, marker_tokens(tokenizer, end))


def _inferred_markers(tokenizer) -> ThinkingMarkers | None:
    if not tokenizer.has_thinking:
        return None
    return ThinkingMarkers(tokenizer.think_start, tokenizer.think_end, tuple(tokenizer.think_end_tokens))


def _parse_setting(setting: str) -> tuple[str, str]:
    start, comma, end = (part.strip() for part in setting.partition(","))
    if not (comma and start and end):
        raise ValueError(f'thinking markers must be "off", "auto" or "START,END", not {setting!r}')
    return start, end


def starts_in_thinking(prompt_text: str, markers: ThinkingMarkers) -> bool:
    """Whether the rendered prompt left a thinking section open (Qwen3 and DeepSeek-R1
    templates end the generation prompt with "<think>\\n"), so the output starts in it."""
    return prompt_text.rfind(markers.start) > prompt_text.rfind(markers.end)


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers`: they
    must wait for the next piece before they can be sent."""
    longest = max(len(m) for m in markers) - 1
    for n in range(min(longest, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(pos, m) for m in markers if (pos := text.find(m)) >= 0]
    return min(found, default=None)


_BEFORE, _THINKING, _AFTER = "before", "thinking", "after"


class ReasoningSplitter:
    """Splits streamed output text into content (TextDelta) and reasoning (ReasoningDelta).

    Text inside start..end is reasoning, text outside is content; the markers are
    dropped, and so is the whitespace right after either marker (models write
    "<think>\\n...\\n</think>\\n\\nanswer"). A tail is held back only while it could
    be the beginning of a marker being looked for.

    An end marker seen before any start marker (not `in_thinking`): the text before
    it has already gone out as content and cannot be taken back, so, as vLLM's
    parsers do once the end has passed, it stays content; the marker is dropped and
    what follows is content. Callers avoid this case by passing `in_thinking` from
    `starts_in_thinking`, which is how DeepSeek-R1 style prompts open the section.
    Output that ends inside the section (max_tokens) is all reasoning, no content.
    """

    def __init__(self, markers: ThinkingMarkers, in_thinking: bool = False):
        self.markers = markers
        self._phase = _THINKING if in_thinking else _BEFORE
        self._pending = ""
        self._strip = in_thinking  # the prompt's start marker was followed by "\n" too

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        """What was held back: a marker's beginning that the output ended on is text."""
        out: list[Delta] = []
        self._emit(out, self._pending)
        self._pending = ""
        return out

    def _looking_for(self) -> tuple[str, ...]:
        if self._phase == _THINKING:
            return (self.markers.end,)
        return (self.markers.start, self.markers.end) if self._phase == _BEFORE else ()

    def _step(self, out: list[Delta]) -> bool:
        """Sends what can be sent of the pending text; True when it passed a marker
        and the rest must be looked at again."""
        if self._strip:
            self._pending = self._pending.lstrip()
            self._strip = not self._pending
        markers = self._looking_for()
        hit = _first_marker(self._pending, markers) if markers else None
        if hit is None:
            keep = _held_back(self._pending, markers) if markers else 0
            self._emit(out, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return False
        pos, marker = hit
        self._emit(out, self._pending[:pos])
        self._pending = self._pending[pos + len(marker) :]
        self._pass(marker)
        return True

    def _pass(self, marker: str) -> None:
        opened = self._phase == _BEFORE and marker == self.markers.start
        self._phase = _THINKING if opened else _AFTER
        self._strip = True

    def _emit(self, out: list[Delta], text: str) -> None:
        if not text:
            return
        kind = ReasoningDelta if self._phase == _THINKING else TextDelta
        if out and type(out[-1]) is kind:
            out[-1].text += text
        else:
            out.append(kind(text))


class ThinkingBudget:
    """A token constraint that closes the thinking section after `max_thinking_tokens`.

    It counts the tokens generated inside the section (open from the start when
    `in_thinking`, or once the generated ids end with `start_tokens`); at the budget
    it forces the end marker's ids one by one, continuing a marker the model had
    begun. After the end marker, written or forced, every token is allowed.
    Markers are matched by id sequence: decoding text here would be slow and
    ambiguous."""

    def __init__(
        self,
        markers: ThinkingMarkers,
        max_thinking_tokens: int,
        in_thinking: bool,
        start_tokens: tuple[int, ...] | None = None,
    ):
        self.end_tokens = tuple(markers.end_tokens)
        self.start_tokens = tuple(start_tokens or ())
        self.max_thinking_tokens = max_thinking_tokens
        self._phase = _THINKING if in_thinking else _BEFORE
        self._count = 0
        self._recent: deque[int] = deque(maxlen=max(len(self.end_tokens), len(self.start_tokens), 1))

    @property
    def closed(self) -> bool:
        return self._phase == _AFTER

    def consume(self, token: int) -> None:
        if self._phase == _AFTER:
            return
        self._recent.append(token)
        if self._ends_with(self.end_tokens):
            self._phase = _AFTER  # a lone end marker closes a section the prompt opened unseen
        elif self._phase == _THINKING:
            self._count += 1
        elif self.start_tokens and self._ends_with(self.start_tokens):
            self._phase, self._count = _THINKING, 0
            self._recent.clear()  # the start's ids must not count towards an end marker

    def allowed(self, vocab: int) -> np.ndarray | None:
        if self._phase != _THINKING or self._count < self.max_thinking_tokens:
            return None
        mask = np.zeros(vocab, dtype=bool)
        mask[self.end_tokens[self._end_begun()]] = True
        return mask

    def _ends_with(self, seq: tuple[int, ...]) -> bool:
        n = len(seq)
        return 0 < n <= len(self._recent) and tuple(self._recent)[-n:] == seq

    def _end_begun(self) -> int:
        """How many of the end marker's ids the recent tokens already end with."""
        recent = tuple(self._recent)
        for n in range(min(len(self.end_tokens) - 1, len(recent)), 0, -1):
            if recent[-n:] == self.end_tokens[:n]:
                return n
        return 0
