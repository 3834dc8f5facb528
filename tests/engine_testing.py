"""What the in-process engine tests share: an engine on the default model, and
requests to it."""

from __future__ import annotations

import asyncio

from tierlm.config import Settings
from tierlm.engine.core import EngineCore
from tierlm.engine.request import Request, SamplingParams

QUESTION = [{"role": "user", "content": "Write a poem about autumn leaves."}]


def run(coro):
    return asyncio.run(coro)


async def started(loaded, **settings) -> EngineCore:
    """An engine on `loaded` (model, tokenizer), started, with no SSD tier."""
    engine = EngineCore(f"test-{id(settings)}", lambda: loaded, Settings(ssd_cache=False, **settings))
    await engine.start()
    return engine


def request(loaded, engine, max_tokens=8, text=QUESTION, **params) -> Request:
    """A greedy request (unless told otherwise) for the chat `text`."""
    tokens = loaded[1].apply_chat_template(text, add_generation_prompt=True)
    params.setdefault("temperature", 0)
    return Request(engine.new_request_id(), tokens, SamplingParams(max_tokens=max_tokens, **params))
