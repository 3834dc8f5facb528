"""Two real coding agents, installed from npm and pointed at a real server on
Qwen2.5-Coder-0.5B-Instruct (32k context, a chat template that knows tools,
`<tool_call>` a token of its own): Claude Code over the Anthropic Messages API
and Codex CLI over the Responses API. Claude Code writes a file and changes a
function, Codex runs a command that writes a file, each checked on disk; each
agent completes a turn, and its second turn reads the first turn's prompt from
the prefix cache, as the agent itself reports the server's usage. The agents
ask for their own model names (claude-*, gpt-*), which the settings file's
aliases map to Qwen (conftest's qwen_server, shared with test_qwen_coder).

Claude Code runs with few of its tools instead of its 25 and Codex with a
one-line instruction file instead of its own: their whole prompts are 21.8k and
~9k tokens, smaller ones keep each turn to seconds on a 2-core CPU (`tierlm
bench agents` measures the whole ones). A model of 0.5B parameters
calls its tool again after the result rather than answering, so the file
tasks end at Claude Code's own turn limit, after the call that did the work.
Skipped only where npm is missing."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import agents_install
import httpx
import pytest
from conftest import AGENT_KEY as KEY

pytestmark = pytest.mark.slow  # the real agents' sessions on Qwen2.5-Coder-0.5B: minutes


@pytest.fixture(scope="module")
def agents() -> Path:
    """The folder of the agents' commands (installed in the background since the run began)."""
    return agents_install.installed()


def _run(command: list, home: Path, env: dict, exit_codes=(0,)) -> subprocess.CompletedProcess:
    workdir = home / "project"
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", **env}
    done = subprocess.run([str(c) for c in command], env=env, cwd=workdir, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode in exit_codes, f"{command[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def claude(agents: Path, srv, home: Path, prompt: str, *args: str, tools: str = "Read,Bash") -> dict:
    """One `claude -p` session; its result (text, turns, usage as the server reported it).
    An exit code of 1 is Claude Code's for a session that ended in error (the
    result says which): the caller checks the result."""
    env = {"ANTHROPIC_BASE_URL": srv.base_url, "ANTHROPIC_API_KEY": KEY, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "200",
           "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    done = _run([agents / "claude", "-p", prompt, "--output-format", "json", "--tools", tools, *args], home, env,
                exit_codes=(0, 1))
    return json.loads(done.stdout.strip().splitlines()[-1])


def claude_turn(agents: Path, srv, home: Path, prompt: str, *args: str) -> dict:
    result = claude(agents, srv, home, prompt, *args)
    assert not result["is_error"], result
    return result


# a file task's session: a one-line system prompt, edits without asking, one answer
_FILE_TASK = ("--system-prompt", "You are a coding agent in the current directory. You do each task by calling a "
              "tool.", "--permission-mode", "acceptEdits", "--max-turns", "1")


def test_claude_code_writes_a_file(agents, qwen_server, tmp_path):
    """The file is checked on disk. Write is the one tool, acceptEdits lets it
    write without asking, and one turn is the limit: the model's next turn would
    call Write again (see the module's docstring)."""
    result = claude(agents, qwen_server, tmp_path, "Create the file notes.txt containing exactly: hello world",
                    *_FILE_TASK, tools="Write")
    assert result["subtype"] in ("success", "error_max_turns"), result
    assert (tmp_path / "project" / "notes.txt").read_text() == "hello world"


CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


def test_claude_code_changes_a_function(agents, qwen_server, tmp_path):
    """Two turns of one conversation, as a user would: read the file, then
    change it. Claude Code's Edit refuses a file not read first, and asked both
    at once the 0.5B model edits first, so the reading is a turn of its own.
    Each turn is one answer (--max-turns 1): the model's next would edit again."""
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "calc.py").write_text(CALC)
    read = claude(agents, qwen_server, tmp_path, "Read calc.py.", *_FILE_TASK, tools="Read,Edit")
    changed = claude(agents, qwen_server, tmp_path, "In calc.py, change the function add: replace return a + b "
                     "with return a + b + 1.", *_FILE_TASK, "--continue", tools="Read,Edit")
    assert (tmp_path / "project" / "calc.py").read_text() == CALC.replace("a + b", "a + b + 1")
    for result in (read, changed):
        assert result["subtype"] in ("success", "error_max_turns"), result
    # the second turn reads what the first sent from the cache, but its last, partial block
    sent = read["usage"]["input_tokens"] + read["usage"]["cache_read_input_tokens"]
    assert changed["usage"]["cache_read_input_tokens"] >= sent - 256, (read["usage"], changed["usage"])


def test_claude_code_completes_turns_and_the_second_reads_the_first_from_cache(agents, qwen_server, tmp_path):
    first = claude_turn(agents, qwen_server, tmp_path, "Say hello in one short sentence.")
    assert first["result"].strip()
    prompt = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    assert prompt > 2000  # Claude Code's own system prompt and tools were there

    kept_before = kept_hits(qwen_server)
    second = claude_turn(agents, qwen_server, tmp_path, "Thank you.", "--continue")
    assert second["result"].strip()
    # everything the first turn sent but its last, partial cache block
    assert second["usage"]["cache_read_input_tokens"] >= prompt - 256, (first["usage"], second["usage"])
    # from the first turn's KV as the batch left it: no side request came between
    # (engine/last_sequence.py keeps one sequence)
    assert kept_hits(qwen_server) == kept_before + 1


def kept_hits(srv) -> int:
    stats = httpx.get(srv.v1 + "/cache/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    return stats["prefix_cache"]["kept_hits"]


def _codex_config(srv, home: Path) -> None:
    config = home / ".codex" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('model = "gpt-5-codex"\nmodel_provider = "tierlm"\n\n[model_providers.tierlm]\n'
                      f'name = "tierlm"\nbase_url = "{srv.v1}"\nwire_api = "responses"\nenv_key = "TIERLM_API_KEY"\n')


# the Codex tests' instructions: one text, so the second test's first turn finds
# the first's instructions and tools (the bulk of its prompt) in the cache
CODEX_INSTRUCTIONS = ("You are a coding agent working in the current directory. You do each task by running a "
                      "shell command with exec_command.")


def _short_instructions(home: Path, text: str = CODEX_INSTRUCTIONS) -> list[str]:
    """Codex's options for a one-line instruction file instead of its own ~6k
    tokens of instructions (its tools stay): the prompt a 2-core CPU prefills."""
    instructions = home / "instructions.md"
    instructions.write_text(text + "\n")
    return ["-c", f'model_instructions_file="{instructions}"']


def codex_events(agents: Path, srv, home: Path, prompt: str, *args: str) -> list[dict]:
    """One `codex exec` turn's events; it completed."""
    _codex_config(srv, home)
    done = _run([agents / "codex", "exec", *args, "--skip-git-repo-check", "--json", prompt], home,
                {"TIERLM_API_KEY": KEY})
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    failures = [e for e in events if e.get("type") in ("turn.failed", "error")]
    assert not failures, failures
    return events


def codex_turn(agents: Path, srv, home: Path, prompt: str, *args: str) -> dict:
    """One `codex exec` turn; the usage of its turn.completed event."""
    events = codex_events(agents, srv, home, prompt, *args)
    return next(e for e in events if e.get("type") == "turn.completed")["usage"]


# Codex's tools for a model it has no metadata for, less those a coding task
# here has no use for (sub-agents, goals, images, apps, plugins, web search):
# exec_command, write_stdin and request_user_input stay
_FEW_TOOLS = [arg for feature in ("multi_agent", "goals", "view_image", "image_generation", "apps", "plugins",
                                  "skill_search", "tool_suggest", "sleep_tool")
              for arg in ("--disable", feature)] + ["-c", 'web_search="disabled"']


def test_codex_runs_a_command_that_writes_a_file(agents, qwen_server, tmp_path):
    """The file is checked on disk. The 0.5B model fills every optional field
    of exec_command, sandbox_permissions "require_escalated" among them, which
    `codex exec` refuses unless approvals are routed to its automatic review
    (--approve-for-me): Codex then asks the same model, with a JSON schema for
    the verdict, whether to allow the command. Told what to do in words ("create
    the file ..."), the model runs `touch` or `echo` without the redirection, so
    the task names the command."""
    short = _short_instructions(tmp_path)
    events = codex_events(agents, qwen_server, tmp_path, "Run this shell command: echo 'hello world' > notes.txt",
                          *short, "--approve-for-me", *_FEW_TOOLS)
    assert (tmp_path / "project" / "notes.txt").read_text() == "hello world\n"
    commands = [e["item"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"]
    assert any("notes.txt" in c["command"] and c["exit_code"] == 0 for c in commands), commands


def test_codex_completes_turns_and_the_second_reads_the_first_from_cache(agents, qwen_server, tmp_path):
    short = [*_short_instructions(tmp_path), *_FEW_TOOLS]
    first = codex_turn(agents, qwen_server, tmp_path, "Say hello in one short sentence.", *short)
    assert first["input_tokens"] > 1500 and first["output_tokens"] > 0  # its tools were there (~1.8k tokens)
    second = codex_turn(agents, qwen_server, tmp_path, "Thank you.", *short, "resume", "--last")
    assert second["cached_input_tokens"] >= first["input_tokens"] - 256, (first, second)

