"""The lab's instruments: benchmarks and diagnostics for working on tierlm, kept
out of the installed package. Each runs from the repository root as
`python -m bench_lab.<name> --help`: streaming, constrained, embeddings, roofline,
make_model, soak, models_bench, docs, cache_figures, replicas, distributed,
request_path, agent_session, new_lengths, kv_bits, kv_quality, decode_step, hit_profile,
hit_trace, speculation_batch, speculation_steps, speculation_trace. They import tierlm and tierlm.bench (what users run);
nothing in tierlm imports them."""

from __future__ import annotations

import argparse
from pathlib import Path


def lab_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of `python -m <module>`, the module's docstring its help."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def write_result(args: argparse.Namespace, parser: argparse.ArgumentParser, kind: str, result: dict) -> None:
    """The result into --json's file, where given, with the machine and this command line."""
    if args.json:
        from tierlm.bench import runs
        from tierlm.bench.report import write_json

        write_json(args.json, kind, result, runs.command_line(parser.prog))


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, or --preset with --tokenizer: what `model_folder` gives."""
    p.add_argument("--model", default=None, help="model folder (default: the built-in default model)")
    p.add_argument("--preset", default=None, help="random weights of this preset's shapes instead")
    p.add_argument("--tokenizer", default=None, help="with --preset: a model folder whose tokenizer it takes")


def model_folder(args: argparse.Namespace, work: Path) -> Path:
    """--model's folder, or random weights of --preset's shapes written under
    `work` (with --tokenizer's tokenizer); else the default model's folder."""
    if args.preset:
        from tierlm.models.random_model import make_random_model

        return make_random_model(args.preset, work / "model", Path(args.tokenizer))
    from tierlm.bench.servers import default_model_folder

    return Path(args.model).expanduser() if args.model else default_model_folder()
