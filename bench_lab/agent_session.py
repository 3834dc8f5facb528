"""An agent's session over HTTP: `python -m bench_lab.agent_session`.

A coding agent's first request holds a long context (here a source file of
`--first` tokens); each later turn appends its answer and a tool output, so
every turn is a hot hit whose remainder (the tool output and the part block
before it) has a new number of tokens over a new number of keys: on a CUDA
GPU, shapes the process has not run yet. For each setting (`--setting NAME`
or `NAME:VAR=VALUE,...`, as bench_lab.new_lengths takes them) a fresh, warm
`tierlm serve`; on it `--sessions` sessions one after another, each of new
lengths (`--same-shapes`: each of the first's, so that what is built per
shape shows apart from the rest), `--turns` tool outputs each. Per turn: the
time to the first token, the cached tokens, the remainder and the server's
prefill stage. Medians over the turns after the first of sessions after the
first (a warm process meeting new shapes).

    python -m bench_lab.agent_session --preset llama-1b --tokenizer TOKENIZER_DIR --first 20000 \\
        --setting products --setting cudnn:TIERLM_HIT_SCORES=0
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
from pathlib import Path

from bench_lab import add_model_args, lab_parser, model_folder, write_result
from bench_lab.new_lengths import setting
from bench_lab.request_path import source_file, turn
from tierlm.bench.report import markdown_table
from tierlm.bench.servers import RunningServer, tierlm_server

TOOL_OUTPUT_TOKENS = [60, 150, 300, 500, 900, 1400]  # what a tool call brings back: a grep, a file, a test run


def session_texts(tokenizer, first: int, turns: int, session: int, same_shapes: bool) -> tuple[str, list[str]]:
    """The session's first file and its tool outputs (lengths drawn per session)."""
    shape = 0 if same_shapes else session
    rnd = random.Random(7 + shape)
    source = source_file(tokenizer, first + 97 * shape, 1000 + session)
    return source, [source_file(tokenizer, rnd.choice(TOOL_OUTPUT_TOKENS), 10 * session + t) for t in range(turns)]


def run_session(server: RunningServer, source: str, outputs: list[str], session: int) -> list[dict]:
    messages = [{"role": "system", "content": f"You are coding agent {session}. Answer briefly."},
                {"role": "user", "content": f"Here is server.py:\n\n{source}\n\nWhat does handler_0 do?"}]
    rows = []
    for t, output in enumerate([None, *outputs]):
        if output is not None:
            messages += [{"role": "assistant", "content": f"Let me run the tool {t}."},
                         {"role": "user", "content": f"Tool output {t}:\n{output}"}]
        r = turn(server, messages)
        rows.append({"session": session, "turn": t, "prompt_tokens": r["prompt_tokens"],
                     "cached_tokens": r["cached_tokens"], "remainder": r["prompt_tokens"] - r["cached_tokens"],
                     "ttft_s": r["ttft_s"],
                     "prefill_ms": r["stages_ms"].get("prefill"), "before_engine_ms": r["before_engine_ms"]})
    return rows


def one_setting(model: Path, tokenizer, name: str, env: dict, args, work: Path) -> dict:
    spec = tierlm_server(model, 4)
    spec.env = {**spec.env, **env}
    rows = []
    with RunningServer(spec, log_dir=work) as server:
        server.wait_warm()
        for session in range(args.sessions):
            source, outputs = session_texts(tokenizer, args.first, args.turns, session, args.same_shapes)
            rows += run_session(server, source, outputs, session)
    later = [r for r in rows if r["turn"] > 0 and (r["session"] > 0 or args.sessions == 1)]
    print(f"{name}: " + " ".join(f"{r['remainder']}/{r['prefill_ms']:.0f}" for r in later), flush=True)
    return {"name": name, "env": env, "turns": rows,
            "median_hot_ttft_s": statistics.median(r["ttft_s"] for r in later),
            "median_hot_prefill_ms": statistics.median(r["prefill_ms"] for r in later),
            "median_cold_ttft_s": statistics.median(r["ttft_s"] for r in rows if r["turn"] == 0)}


def title(result: dict) -> str:
    model = f"random weights of {result['preset']}'s shapes" if result.get("preset") else Path(result["model"]).name
    shapes = "the same shapes" if result["same_shapes"] else "new shapes"
    return (f"An agent's session over HTTP, {model}: a {result['first']}-token file, {result['turns']} tool "
            f"outputs, {result['sessions']} sessions of {shapes}")


def table(result: dict) -> str:
    header = ["setting", "first turn (cold), median s", "later turns (hot hits), median s", "their prefill, median ms"]
    return markdown_table(header, [[s["name"], f"{s['median_cold_ttft_s']:.3f}", f"{s['median_hot_ttft_s']:.3f}",
                                    f"{s['median_hot_prefill_ms']:.0f}"] for s in result["settings"]])


def main(argv=None) -> int:
    p = lab_parser("bench_lab.agent_session", __doc__)
    add_model_args(p)
    p.add_argument("--setting", action="append", default=[], help="NAME or NAME:VAR=VALUE,... (repeatable)")
    p.add_argument("--first", type=int, default=20000, help="tokens of the first message's file")
    p.add_argument("--turns", type=int, default=8, help="tool outputs a session")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--same-shapes", action="store_true", help="every session of the first's lengths")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="tierlm-agent-session-"))
    model = model_folder(args, work)
    tokenizer = AutoTokenizer.from_pretrained(model)
    result = {"model": str(model), "preset": args.preset, "first": args.first, "turns": args.turns,
              "sessions": args.sessions, "same_shapes": args.same_shapes,
              "settings": [one_setting(model, tokenizer, *setting(s), args, work) for s in args.setting or ["this"]]}
    print(title(result))
    print(table(result))
    write_result(args, p, "agent_session", result)
    shutil.rmtree(work, ignore_errors=True)  # a preset's weights
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
