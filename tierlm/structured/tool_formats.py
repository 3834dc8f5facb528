"""Tool-call formats per model family: how a model writes a call
(`<tool_call>{json}</tool_call>`, `[TOOL_CALLS][...]`,
`<|tool_call_start|>[f(x=1)]<|tool_call_end|>`, ...), and which one a model uses."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass

import mlx_lm.tool_parsers


@dataclass(frozen=True)
class ToolFormat:
    name: str  # family: "hermes", "llama3_json", "mistral", "generic", or an mlx-lm parser module's name
    start: str  # text that opens one call
    end: str  # text that closes it; "" means the call runs to the end of the output
    args_key: str = "arguments"  # key of the arguments in a JSON body ("parameters" is accepted too)
    json_body: bool = True  # body is {"name": .., args_key: {..}} (or a JSON list of them)
    native: bool = True  # the chat template renders `tools` itself; False: tierlm puts them in the prompt
    bare_json: bool = False  # a call may also open with its JSON object alone (Llama 3.1 `{"name": ...}`)
    # other (start, end) spellings of a call that the family's models write in text
    fenced: tuple[tuple[str, str], ...] = ()

    @property
    def openings(self) -> tuple[tuple[str, str], ...]:
        return ((self.start, self.end), *self.fenced)


# Qwen2.5(-Coder) models write a call in a ```json fence, or as a bare JSON
# object, about as often as in <tool_call>; llama.cpp's Hermes parser reads all
# three, and so does tierlm.
_JSON_FENCES = (("```json\n", "```"), ("```json", "```"), ("```\n", "```"))
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", bare_json=True, fenced=_JSON_FENCES)
LLAMA3_JSON = ToolFormat("llama3_json", "<|python_tag|>", "", "parameters", bare_json=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "")
GENERIC = ToolFormat("generic", "<tool_call>", "</tool_call>", native=False)

_JSON_FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, GENERIC)}
# mlx-lm's names for the JSON families above.
_ALIASES = {"json_tools": "hermes", "llama3": "llama3_json"}


def mlx_families() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}


def format_named(name: str) -> ToolFormat:
    """The format of a family by name (a per-model setting); ValueError when unknown."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in _JSON_FORMATS:
        return _JSON_FORMATS[key]
    if key in mlx_families():
        module = importlib.import_module(f"mlx_lm.tool_parsers.{key}")
        return ToolFormat(key, module.tool_call_start, module.tool_call_end, json_body=False)
    known = sorted(set(_JSON_FORMATS) | set(_ALIASES) | mlx_families())
    raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(known)}")


def format_for(tokenizer) -> ToolFormat:
    """The model's own format when its chat template renders tools and the family is known, else GENERIC."""
    source = _template_source(tokenizer)
    if "tools" not in source:
        return GENERIC
    # mlx-lm's load() records the family it inferred (or the checkpoint named) here.
    family = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
    if family:
        return format_named(family)
    if _is_llama3_template(source):
        return LLAMA3_JSON
    return GENERIC


def _template_source(tokenizer) -> str:
    # A checkpoint with mlx-lm's `chat_template_type` is rendered by Python code, not Jinja;
    # mlx-lm keeps that function on the wrapper only.
    custom = getattr(tokenizer, "_chat_template", None)
    if callable(custom):
        try:
            return inspect.getsource(inspect.getmodule(custom))
        except (OSError, TypeError):
            return ""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates ("default", "tool_use")
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def _is_llama3_template(source: str) -> bool:
    # mlx-lm has no llama3 parser; its templates ask for this shape in so many words.
    return "<|python_tag|>" in source or '"parameters": dictionary of argument name' in source
