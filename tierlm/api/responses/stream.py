"""A turn's events as the Responses API streams them: each output item opened
(`response.output_item.added`, its content part), grown (text, reasoning and
arguments deltas) and closed (the `.done` events) in order, every event
numbered (`sequence_number`). The items it builds are the response's output."""

from __future__ import annotations

from tierlm.api.responses.turns import Tools, call_item, message_item, new_id, output_text, reasoning_item
from tierlm.api.sse import sse_event
from tierlm.structured.events import Event, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart


class StreamWriter:
    def __init__(self, tools: Tools):
        self.tools = tools
        self.items: list[dict] = []  # the output so far; the last one may be open
        self._open = False
        self._seq = 0

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(kind, payload)

    @property
    def reasoning(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def feed(self, events: list[Event]) -> list[str]:
        out: list[str] = []
        for e in events:
            if isinstance(e, TextDelta):
                out += self._grow("message", e.text)
            elif isinstance(e, ReasoningDelta):
                out += self._grow("reasoning", e.text)
            elif isinstance(e, ToolCallStart):
                out += self._close("completed")
                out += self._open_item(call_item(new_id("fc"), e.id, e.name, "", self.tools, "in_progress"))
            else:
                assert isinstance(e, ToolCallArgs)
                out += self._arguments(e.text)
        return out

    def finish(self, status: str) -> list[str]:
        """Close the last item (`status`: completed, or incomplete when cut short);
        an answer with nothing in it still has its (empty) message."""
        if not self.items:
            return self._grow("message", "") + self._close(status)
        return self._close(status)

    # ---- one item's life -----------------------------------------------------------

    def _grow(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if not (self._open and self.items[-1]["type"] == kind):
            out += self._close("completed")
            empty = message_item(new_id("msg"), "", "in_progress") if kind == "message" else \
                reasoning_item(new_id("rs"), "", "in_progress")
            out += self._open_item(empty)
        item, where = self.items[-1], self._where()
        item["content"][0]["text"] += text
        kind = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return out + [self.event(kind, **where, content_index=0, delta=text, **extra)] if text else out

    def _arguments(self, text: str) -> list[str]:
        item = self.items[-1]
        assert self._open and item["type"] == "function_call", "a call's arguments come right after its start"
        item["arguments"] += text
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=text)]

    def _open_item(self, item: dict) -> list[str]:
        self.items.append(item)
        self._open = True
        content = item.pop("content", None)  # added empty, its part then added
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item={**item, **({"content": []} if content is not None else {})})]
        if content is not None:
            item["content"] = content
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part=dict(content[0])))
        return out

    def _close(self, status: str) -> list[str]:
        if not self._open:
            return []
        self._open = False
        item, where = self.items[-1], self._where()
        item["status"] = status
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            part, text = item["content"][0], item["content"][0]["text"]
            if item["type"] == "message":
                out.append(self.event("response.output_text.done", **where, content_index=0, text=text,
                                      logprobs=[]))
                part = output_text(text)
            else:
                out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        return out + [self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
