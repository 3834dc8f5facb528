"""Rendering a chat into prompt token ids, the model's template or a client's.

A template a client sends is code that runs on the server: it is refused unless
the server allows it (`--allow-client-chat-template`), and then rendered under a
time bound and a size bound, so its loops cannot hold a thread or the memory.
"""

from __future__ import annotations

import logging
import sys
import time

import jinja2

from tierlm.engine import stages as request_stages
from tierlm.serving.errors import APIError
from tierlm.serving.prompt_pieces import encode_rendered

log = logging.getLogger(__name__)

CLIENT_TEMPLATE_SECONDS = 2.0
CLIENT_TEMPLATE_MAX_CHARS = 16 * 2**20


class _OutOfTime(Exception):
    pass


def render_chat_template(tokenizer, messages: list[dict], variables: dict, client_template: str | None,
                         allow_client_template: bool, messages_param: str = "messages") -> list[int]:
    """Prompt token ids of `messages`, or APIError(400) naming what the template
    refused (`messages_param`: the request's name of the messages)."""
    try:
        if client_template is None:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **variables)
            request_stages.mark("template")
            tokens = encode_rendered(tokenizer, text)
            request_stages.mark("tokenize")
            return tokens
        if not allow_client_template:
            raise APIError(400, "this server does not render chat templates sent by clients "
                           "(start it with --allow-client-chat-template to allow them)",
                           "chat_template", "unsupported")
        text = _bounded(lambda: tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, chat_template=client_template, **variables))
        if not isinstance(text, str) or len(text) > CLIENT_TEMPLATE_MAX_CHARS:
            raise APIError(400, f"the chat template rendered more than {CLIENT_TEMPLATE_MAX_CHARS} characters",
                           "chat_template", "invalid_value")
        request_stages.mark("template")
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
        request_stages.mark("tokenize")
        return tokens
    except APIError:
        raise
    except _OutOfTime:
        raise APIError(400, f"the chat template took more than {CLIENT_TEMPLATE_SECONDS:g} s to render",
                       "chat_template", "invalid_value") from None
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            MemoryError, RecursionError) as e:
        param = messages_param if client_template is None else "chat_template"
        raise APIError(400, f"the chat template rejected these messages: {e}", param, "invalid_value") from e
    except Exception as e:
        if client_template is None:
            raise  # the model's own template: a bug of ours
        # a client's template is the client's code: whatever it raises is its error
        raise APIError(400, f"the chat template rejected these messages: {type(e).__name__}: {e}",
                       "chat_template", "invalid_value") from e


def _bounded(render):
    """`render()`, stopped with _OutOfTime once CLIENT_TEMPLATE_SECONDS have passed.
    Jinja compiles a template to Python, so a trace function on this thread sees
    every line of its loops; it costs a few times the render, for client templates only."""
    deadline = time.monotonic() + CLIENT_TEMPLATE_SECONDS

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise _OutOfTime
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return render()
    finally:
        sys.settrace(previous)
