"""Workloads for speculative decoding: what coding agents write, and prose.

- code-edit: a Python module of 150-400 lines from the standard library in the
  prompt, asked back whole with one function renamed;
- agent-edit: the same module and an `edit_file` tool; the call quotes the
  function to replace and writes it again (a grammar holds the call's shape);
- prose: a short story, nothing to copy.

Real code on every machine, no data files; the same requests every run.
"""

from __future__ import annotations

import importlib
import inspect
import re

from tierlm.loadgen.workloads import BenchRequest, Workload

# standard-library modules of 150-400 lines: real code, on every machine
MODULES = ("colorsys", "fnmatch", "getopt", "codeop", "linecache", "glob", "quopri", "tabnanny")
STORIES = ("a lighthouse keeper", "a night train", "a beekeeper's first winter", "a lost violin",
           "a city garden", "a chess club", "a mountain rescue", "a bakery at dawn")
EDIT_TOOL = {"type": "function", "function": {
    "name": "edit_file", "description": "Replace old_string with new_string in a file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"}},
        "required": ["path", "old_string", "new_string"]}}}


def module_source(name: str) -> tuple[str, str]:
    """A module's source and the name of its first top-level function."""
    source = inspect.getsource(importlib.import_module(name))
    function = re.search(r"^def (\w+)", source, re.M).group(1)
    return source, function


def code_edit(n: int, max_tokens: int) -> Workload:
    sessions = []
    for name in MODULES[:n]:
        source, function = module_source(name)
        ask = (f"Here is {name}.py:\n\n```python\n{source}```\n\nRename the function {function} to "
               f"{function}_v2 and return the whole file.")
        sessions.append([BenchRequest(max_tokens, messages=[{"role": "user", "content": ask}])])
    return Workload("code-edit", sessions, {"modules": list(MODULES[:n]), "max_tokens": max_tokens})


def agent_edit(n: int, max_tokens: int) -> Workload:
    sessions = []
    for name in MODULES[:n]:
        source, function = module_source(name)
        ask = (f"Here is {name}.py:\n\n```python\n{source}```\n\nUse edit_file to rename the function "
               f"{function} to {function}_v2: old_string is the whole function, new_string the same "
               "function renamed.")
        sessions.append([BenchRequest(max_tokens, messages=[{"role": "user", "content": ask}],
                                      extra={"tools": [EDIT_TOOL], "tool_choice": "required"})])
    return Workload("agent-edit", sessions, {"modules": list(MODULES[:n]), "max_tokens": max_tokens})


def prose(n: int, max_tokens: int) -> Workload:
    sessions = [[BenchRequest(max_tokens, messages=[{"role": "user", "content": f"Write a short story about {s}."}])]
                for s in STORIES[:n]]
    return Workload("prose", sessions, {"max_tokens": max_tokens})


WORKLOADS = {"code-edit": code_edit, "agent-edit": agent_edit, "prose": prose}
