"""A streaming parser from a model's text deltas to tool-call events.

Families whose body is JSON (tool_formats.py) are read here with a small
incremental scanner so that the arguments stream as they are generated; the
others are buffered to their end marker and handed to mlx-lm's parser for that
family.
"""

from __future__ import annotations

import importlib
import json
import secrets

import regex

from tierlm.structured.events import Event, TextDelta, ToolCallArgs, ToolCallStart
from tierlm.structured.tool_formats import ToolFormat, mlx_families

_WS = " \t\r\n"
_ARGS_KEYS = ("arguments", "parameters")
# Mistral's newer calls: `name[ARGS]{...}`, some with `[CALL_ID]id` between.
_HEADER = regex.compile(r"\s*([\w.-]+)\s*(?:\[CALL_ID\]\s*[\w-]*\s*)?\[ARGS\]")


def _skip_ws(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in _WS:
        pos += 1
    return pos


def _string_end(buf: str, pos: int) -> int | None:
    """Index just past the JSON string opening at `pos`, or None while it is unterminated."""
    i = pos + 1
    while i < len(buf):
        if buf[i] == "\\":
            i += 2
        elif buf[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _marker_prefix_len(buf: str, marker: str) -> int:
    """Length of the longest tail of `buf` that could be the beginning of `marker`."""
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class _ValueEnd:
    """Finds where one JSON value ends, fed piece by piece: strings, escapes, and nesting depth.
    It does not validate the value; the model's arguments pass through as written."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = self.scalar = self.started = self.done = False

    def scan(self, text: str) -> int:
        """How many characters of `text` belong to the value; sets `done` once it is complete."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self._end(i + 1)
            elif not self.started:
                self.started = True
                self.in_string = ch == '"'
                self.depth = 1 if ch in "{[" else 0
                self.scalar = ch not in '"{['
            elif self.scalar:
                if ch in ",}] \t\r\n":  # a number or literal ends at the next delimiter, not its own
                    return self._end(i)
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self._end(i + 1)
        return len(text)

    def _end(self, n: int) -> int:
        self.done = True
        return n


class _JsonCalls:
    """Reads one JSON call body piece by piece: an object {"name", "arguments"}, a list of them,
    or (with `headers`, Mistral) `name[ARGS]{...}` repeated. Produces `items`:
    ("name", n), ("args", raw JSON piece), ("end", ""). A handler returns the new position, or
    None when it needs more text (having consumed nothing), so any split gives the same items."""

    def __init__(self, headers: bool) -> None:
        self.headers = headers
        self.state = "open"
        self.in_list = self.failed = self.done = self.paused = False
        self.items: list[tuple[str, str]] = []
        self._new_call()

    def _new_call(self) -> None:
        self.key = ""
        self.name: str | None = None
        self.held_args = ""  # arguments that came before the name
        self.args_seen = self.string_args = False
        self.string_text = ""  # arguments written as a JSON string, decoded once complete
        self.value = _ValueEnd()

    def step(self, buf: str) -> int:
        """Consume what can be decided of `buf`; stops after a name so the caller can veto it."""
        pos = 0
        while pos < len(buf) and not (self.failed or self.done or self.paused):
            new = getattr(self, "_" + self.state)(buf, pos)
            if new is None:
                break
            pos = new
        self.paused = False
        return pos

    @property
    def after_calls(self) -> bool:
        """Whether the calls are complete and what waits is text that may start another header."""
        return self.state == "next_header"

    def _fail(self, pos: int) -> int:
        self.failed = True
        return pos

    def _open(self, buf: str, pos: int) -> int | None:
        pos = _skip_ws(buf, pos)
        if pos == len(buf):
            return None
        if buf[pos] == "[":
            self.in_list, self.state = True, "item"
            return pos + 1
        if buf[pos] == "{":
            self.state = "key"
            return pos + 1
        if self.headers:
            self.state = "header"
            return pos
        return self._fail(pos)

    def _item(self, buf: str, pos: int) -> int | None:
        pos = _skip_ws(buf, pos)
        if pos == len(buf):
            return None
        if buf[pos] == "{":
            self._new_call()
            self.state = "key"
            return pos + 1
        if buf[pos] == "]":
            self.done = True
            return pos + 1
        return self._fail(pos)

    def _key(self, buf: str, pos: int) -> int | None:
        pos = _skip_ws(buf, pos)
        if pos == len(buf):
            return None
        if buf[pos] == "}":
            return self._close_object(pos + 1)
        if buf[pos] != '"':
            return self._fail(pos)
        end = _string_end(buf, pos)
        if end is None:
            return None
        self.key = _loads_or_none(buf[pos:end])
        if not isinstance(self.key, str):
            return self._fail(pos)
        self.state = "colon"
        return end

    def _colon(self, buf: str, pos: int) -> int | None:
        pos = _skip_ws(buf, pos)
        if pos == len(buf):
            return None
        if buf[pos] != ":":
            return self._fail(pos)
        self.state = "value"
        return pos + 1

    def _value(self, buf: str, pos: int) -> int | None:
        pos = _skip_ws(buf, pos)
        if pos == len(buf):
            return None
        if buf[pos] in ",:}]":
            return self._fail(pos)
        if self.key == "name":
            return self._name_value(buf, pos)
        if self.key in _ARGS_KEYS and not self.args_seen:
            self.args_seen, self.string_args = True, buf[pos] == '"'
            self.state = "args"
        else:
            self.value, self.state = _ValueEnd(), "skip"
        return pos

    def _name_value(self, buf: str, pos: int) -> int | None:
        if buf[pos] != '"' or self.name is not None:
            return self._fail(pos)
        end = _string_end(buf, pos)
        if end is None:
            return None
        name = _loads_or_none(buf[pos:end])
        if not isinstance(name, str):
            return self._fail(pos)
        self._got_name(name)
        self.state = "comma"
        return end

    def _got_name(self, name: str) -> None:
        self.name, self.paused = name, True
        self.items.append(("name", name))
        if self.held_args:
            self.items.append(("args", self.held_args))
            self.held_args = ""

    def _args(self, buf: str, pos: int) -> int:
        n = self.value.scan(buf[pos:])
        self._args_piece(buf[pos : pos + n])
        if self.value.done:
            self._args_done()
        return pos + n

    def _args_piece(self, piece: str) -> None:
        if self.string_args:
            self.string_text += piece
        elif self.name is None:
            self.held_args += piece
        elif piece:
            self.items.append(("args", piece))

    def _args_done(self) -> None:
        if self.string_args:  # `"arguments": "{\"city\": ...}"`: the string holds the JSON text
            self.string_args = False
            decoded = _loads_or_none(self.string_text)
            self._args_piece(decoded if isinstance(decoded, str) else "")
        if self.headers and self.state == "hargs":
            self.items.append(("end", ""))
            self.state = "next_header"
        else:
            self.state = "comma"

    def _skip(self, buf: str, pos: int) -> int:
        n = self.value.scan(buf[pos:])
        if self.value.done:
            self.state = "comma"
        return pos + n

    def _comma(self, buf: str, pos: int) -> int | None:
        pos = _skip_ws(buf, pos)
        if pos == len(buf):
            return None
        if buf[pos] == ",":
            self.state = "key"
            return pos + 1
        if buf[pos] == "}":
            return self._close_object(pos + 1)
        return self._fail(pos)

    def _close_object(self, pos: int) -> int:
        if self.name is None:
            return self._fail(pos - 1)
        self.items.append(("end", ""))
        if self.in_list:
            self.state = "after_item"
        else:
            self.done = True
        return pos

    def _after_item(self, buf: str, pos: int) -> int | None:
        pos = _skip_ws(buf, pos)
        if pos == len(buf):
            return None
        if buf[pos] == ",":
            self.state = "item"
            return pos + 1
        if buf[pos] == "]":
            self.done = True
            return pos + 1
        return self._fail(pos)

    def _header(self, buf: str, pos: int) -> int | None:
        m = _HEADER.match(buf, pos, partial=True)
        if m is None:
            return self._fail(pos)
        if m.partial:
            return None
        self._new_call()
        self._got_name(m.group(1))
        self.args_seen, self.state = True, "hvalue"
        return m.end()

    def _hvalue(self, buf: str, pos: int) -> int | None:
        pos = _skip_ws(buf, pos)
        if pos == len(buf):
            return None
        self.string_args = buf[pos] == '"'
        self.state = "hargs"
        return pos

    def _hargs(self, buf: str, pos: int) -> int:
        return self._args(buf, pos)

    def _next_header(self, buf: str, pos: int) -> int | None:
        # Another `name[ARGS]` may follow at once; anything else is text after the calls.
        m = _HEADER.match(buf, pos, partial=True)
        if m is None:
            self.done = True
            return pos
        if m.partial:
            return None
        self.state = "header"
        return pos


class ToolCallParser:
    """Turns one turn's text deltas into TextDelta / ToolCallStart / ToolCallArgs events.

    `tool_names`: calls naming anything else are given back as text. `tools`: the request's tool
    definitions (OpenAI shape), which some mlx-lm parsers use to type XML argument values."""

    def __init__(
        self,
        fmt: ToolFormat,
        tool_names: set[str] | None = None,
        id_prefix: str = "call_",
        tools: list[dict] | None = None,
    ) -> None:
        self.fmt = fmt
        self._tool_names = tool_names
        self._id_prefix = id_prefix
        self._tools = tools
        self._mlx_parse = None if fmt.json_body else _mlx_parser(fmt.name)
        self._events: list[Event] = []
        self._buf = ""
        self._mode = "text"  # text | json (a JSON body) | raw (a body for mlx-lm) | after (a call's tail)
        self._segment_start = True  # output start or just after a call: separators are held
        self._after_call = False
        self._index = 0
        self._open_call: int | None = None
        self._args_emitted = False
        self._raw = ""  # the current block's text so far, given back if it turns out malformed
        self._block_started = False
        self._junk = False
        self._body: _JsonCalls | None = None
        self._end = fmt.end  # the end marker of the block open now

    @property
    def called(self) -> bool:
        return self._index > 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while getattr(self, "_in_" + self._mode)():
            pass
        return self._take()

    def finish(self) -> list[Event]:
        getattr(self, "_finish_" + self._mode)()
        self._buf = ""
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._events and isinstance(self._events[-1], TextDelta):
            self._events[-1].text += text
        else:
            self._events.append(TextDelta(text))

    # -- text outside calls --

    def _separators(self) -> str:
        # Llama 3.1 writes several calls as `{...}; {...}`.
        return _WS + ";" if self._after_call and self.fmt.bare_json else _WS

    def _in_text(self) -> bool:
        openings = [start for start, _ in self.fmt.openings]
        if self._segment_start and self._buf:
            rest = self._buf.lstrip(self._separators())
            if not rest or any(len(rest) < len(s) and s.startswith(rest) for s in openings):
                return False  # cannot tell yet whether only separators stand before a call
            marker = next((s for s in openings if rest.startswith(s)), None)
            if marker is not None or (self.fmt.bare_json and rest[0] == "{"):
                # Whitespace between calls (or before the first) is dropped.
                marker = marker or ""
                self._buf = rest[len(marker) :]
                self._open_block(marker)
                return True
            self._segment_start = False
        found = [(j, -len(s), s) for s in openings if (j := self._buf.find(s)) >= 0]
        if found:
            j, _, marker = min(found)  # the first, and the longest of those starting there
            self._text(self._buf[:j])
            self._buf = self._buf[j + len(marker) :]
            self._open_block(marker)
            return True
        keep = max(_marker_prefix_len(self._buf, s) for s in openings)
        self._text(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _finish_text(self) -> None:
        if not (self._segment_start and self.called and not self._buf.strip(self._separators())):
            self._text(self._buf)

    def _open_block(self, marker: str) -> None:
        self._raw, self._block_started = marker, False
        self._end = dict(self.fmt.openings).get(marker, "")  # a bare JSON call has no end marker
        if self.fmt.json_body:
            self._body = _JsonCalls(headers=self.fmt.name == "mistral")
            self._mode = "json"
        else:
            self._mode = "raw"

    def _to_text(self, after_call: bool) -> None:
        self._mode = "text"
        self._segment_start = self._after_call = after_call

    # -- a JSON body, streamed --

    def _in_json(self) -> bool:
        n = self._body.step(self._buf)
        self._raw += self._buf[:n]
        self._buf = self._buf[n:]
        if not self._take_items() or self._body.failed:
            self._fail_block()
        elif self._body.done:
            self._mode, self._junk = "after", False
        else:
            return n > 0
        return True

    def _take_items(self) -> bool:
        """Turn the body's items into events; False when a name is not one of the tools."""
        items, self._body.items = self._body.items, []
        for kind, value in items:
            if kind == "name":
                if self._tool_names is not None and value not in self._tool_names:
                    return False
                self._start_call(value)
            elif kind == "args" and value:
                self._events.append(ToolCallArgs(self._open_call, value))
                self._args_emitted = True
            elif kind == "end":
                self._close_call()
        return True

    def _start_call(self, name: str) -> None:
        self._open_call, self._args_emitted, self._block_started = self._index, False, True
        self._events.append(ToolCallStart(self._index, self._id_prefix + secrets.token_hex(12), name))
        self._index += 1

    def _close_call(self) -> None:
        if self._open_call is not None and not self._args_emitted:
            self._events.append(ToolCallArgs(self._open_call, "{}"))  # a call without arguments
        self._open_call = None

    def _fail_block(self) -> None:
        if self._block_started:  # a started call stands; the rest of its markup is dropped
            self._close_call()
            self._mode, self._junk = "after", True
        else:
            self._text(self._raw)
            self._to_text(after_call=False)

    def _finish_json(self) -> None:
        if self._block_started:
            self._close_call()
            if self._body.after_calls:
                self._text(self._buf)
        else:
            self._text(self._raw + self._buf)

    # -- what follows a JSON body: its end marker, or text --

    def _in_after(self) -> bool:
        end, start = self._end, self.fmt.start
        if not end:
            self._to_text(after_call=True)
            return True
        k, s = self._buf.find(end), self._buf.find(start)
        if k >= 0 and (s < 0 or k < s):
            self._buf = self._buf[k + len(end) :]
        elif s >= 0:  # the end marker was forgotten and the next call begins
            self._buf = self._buf[s:]
        else:
            return False
        self._to_text(after_call=True)
        return True

    def _finish_after(self) -> None:
        if not self._junk and self._buf.strip():
            self._text(self._buf)

    # -- a body for mlx-lm's parser, buffered to its end marker --

    def _in_raw(self) -> bool:
        end = self._end
        k = self._buf.find(end) if end else -1
        if k < 0:
            return False
        body, self._buf = self._buf[:k], self._buf[k + len(end) :]
        self._emit_parsed(body, self._raw + body + end)
        return True

    def _finish_raw(self) -> None:
        # The end marker is missing: the model may have stopped right after a complete body.
        self._emit_parsed(self._buf, self._raw + self._buf)

    def _emit_parsed(self, body: str, raw: str) -> None:
        calls = self._parse_calls(body)
        if calls is None or any(self._tool_names is not None and n not in self._tool_names for n, _ in calls):
            self._text(raw)
            self._to_text(after_call=False)
            return
        for name, args in calls:
            self._start_call(name)
            self._events.append(ToolCallArgs(self._open_call, args))
            self._open_call = None
        self._to_text(after_call=True)

    def _parse_calls(self, body: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call mlx-lm's parser finds in `body`, or None."""
        try:
            parsed = self._mlx_parse(body, self._tools)
        except Exception:  # noqa: BLE001 - the family parsers raise many kinds on malformed text
            return None
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            name = call.get("name") if isinstance(call, dict) else None
            args = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(args, str):
                args = _loads_or_none(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                return None
            calls.append((name, json.dumps(args, ensure_ascii=False)))
        return calls or None


def _loads_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _mlx_parser(family: str):
    if family not in mlx_families():
        raise ValueError(f"no mlx-lm tool parser for format {family!r}")
    return importlib.import_module(f"mlx_lm.tool_parsers.{family}").parse_tool_call
