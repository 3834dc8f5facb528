"""Server-sent events framing."""

from __future__ import annotations

import json

KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"


def sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_event(event: str, payload: dict) -> str:
    """A named event, as the Anthropic API streams them."""
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
