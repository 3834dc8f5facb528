"""The lab's instruments: benchmarks and diagnostics for working on tierlm, kept
out of the installed package. Each runs from the repository root as
`python -m bench_lab.<name> --help`: streaming, constrained, embeddings, roofline,
make_model, soak, models_bench, docs, cache_figures, replicas, distributed,
request_path, new_lengths, kv_bits, kv_quality, speculation_batch,
speculation_steps, speculation_trace. They import tierlm and tierlm.bench (what users run);
nothing in tierlm imports them."""

from __future__ import annotations

import argparse


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
