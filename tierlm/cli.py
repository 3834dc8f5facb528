"""Command line: `tierlm serve`, `tierlm pull`, `tierlm import`, `tierlm list`, `tierlm bench`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

from tierlm.config import Settings, load_settings, setting_fields, settings_file_path

log = logging.getLogger("tierlm")


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, from its declaration in config.Settings."""
    for f in setting_fields():
        flag = "--" + f.name.replace("_", "-")
        help_text = (f.metadata["help"] + _default_text(f.default)).replace("%", "%%")  # argparse formats %
        if f.type.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        kind = str if "str" in f.type else int if f.type.startswith("int") else float
        parser.add_argument(flag, type=kind, default=None, help=help_text)
    parser.add_argument("--config", help="settings file (TOML; default ~/.tierlm/settings.toml)")


def _default_text(default) -> str:
    if isinstance(default, bool):
        return " (default on)" if default else " (default off)"
    return "" if default is None else f" (default {default})"


def _cli_values(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name, None) for f in setting_fields()}


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings a command line gives: its flags over the environment and the
    settings file. A value a setting refuses ends the command with its reason
    (exit status 2), not a traceback."""
    try:
        return load_settings(_cli_values(args), args.config)
    except ValueError as e:
        print(f"tierlm: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    _setup_logging(settings.log_level)
    from tierlm.admin.access import Access, check_bind

    try:  # before anything loads: a server open to the network without a key does not start
        Access(settings.api_key, settings.admin_key)
        check_bind(settings.host, settings.api_key, settings.insecure_no_auth)
    except ValueError as e:
        print(f"tierlm serve: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from tierlm.api.app import create_app
    from tierlm.backends import choose_cuda_graphs, keep_compiled_kernels
    from tierlm.distributed import ranks
    from tierlm.engine.allocator import configure_allocator
    from tierlm.serving.assembly import resolve_model
    from tierlm.settings_watch import SettingsWatcher

    configure_allocator()  # the C heap's free pages go back when idle; started before the model loads
    keep_compiled_kernels(settings.kernel_cache_dir)
    choose_cuda_graphs(settings.cuda_graphs)

    model_path = resolve_model(settings)
    lockstep = ranks.join()  # started by mlx.launch: this rank's place
    if lockstep is not None and not lockstep.leader:
        from tierlm.distributed import follower

        return follower.run(settings, model_path, lockstep)
    # the settings file's changes apply while the server runs (the command line still wins)
    watch = SettingsWatcher(args.config or settings_file_path(), lambda new: None, cli=_cli_values(args))
    app = create_app(settings, model_path, watch, lockstep)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=5)
    return 0


@contextlib.contextmanager
def _progress_bar():
    """A rich progress bar fed by import/pull's (stage, done, total) reports."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), transient=False) as bar:
        tasks: dict[str, int] = {}

        def report(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total or None)
            bar.update(tasks[stage], completed=done if total else 0, total=total or None)
            for other in tasks.values():  # a new stage finishes the earlier ones
                if other != tasks[stage] and not bar.tasks[other].finished:
                    bar.update(other, total=bar.tasks[other].total or 1, completed=bar.tasks[other].total or 1)

        yield report
        for task in tasks.values():
            bar.update(task, total=bar.tasks[task].total or 1, completed=bar.tasks[task].total or 1)


def cmd_pull(args: argparse.Namespace) -> int:
    from tierlm.models import catalog

    settings = settings_from_args(args)
    _setup_logging(settings.log_level)
    if args.name not in catalog.CATALOG:
        print(f"unknown model {args.name!r}: known are {', '.join(catalog.CATALOG)}", file=sys.stderr)
        return 2
    with _progress_bar() as report:
        path = catalog.pull(args.name, Path(settings.model_dir).expanduser(), bits=args.bits, progress=report)
    print(path)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    import tempfile

    from tierlm.models.default_model import _publish
    from tierlm.models.gguf_import import import_gguf
    from tierlm.models.model_folder import is_model_folder

    settings = settings_from_args(args)
    _setup_logging(settings.log_level)
    source = Path(args.file).expanduser()
    if not source.is_file():
        print(f"no such file: {source}", file=sys.stderr)
        return 2
    model_dir = Path(settings.model_dir).expanduser()
    target = model_dir / (args.name or source.stem)
    if is_model_folder(target):
        print(f"{target} already exists: remove it or choose another --name", file=sys.stderr)
        return 2
    model_dir.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=model_dir, prefix=".import-") as tmp, _progress_bar() as report:
            built = import_gguf(source, Path(tmp) / target.name, report, bits=args.bits)
            _publish(built, target)
    except ValueError as e:  # an unreadable file, an unknown architecture or vocabulary
        print(f"cannot import {source.name}: {e}", file=sys.stderr)
        return 2
    print(target)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Every model a server with these settings can serve, as `ollama list`."""
    from rich.table import Column, Table

    from tierlm.serving.assembly import hf_cache_of, model_dirs_of
    from tierlm.pool.discovery import discover

    settings = settings_from_args(args)
    dirs = model_dirs_of(settings)
    table = Table("size", "context", "quantization", "type", title=", ".join(str(d) for d in dirs))
    table.columns.insert(0, Column("name", no_wrap=True))
    for m in discover(dirs, hf_cache_of(settings)).values():
        table.add_row(m.name, f"{m.size_bytes / 2**20:.0f} MiB", str(m.context_length), m.quantization or "float",
                      m.model_type)
    _console().print(table)
    return 0


def cmd_ps(args: argparse.Namespace) -> int:
    """The models a running server has loaded, as `ollama ps`."""
    import httpx
    from rich.table import Table

    settings = settings_from_args(args)
    url = f"http://{settings.host}:{settings.port}/v1/models"
    from tierlm.admin.access import secret_of

    headers = {"Authorization": f"Bearer {secret_of(settings.api_key[0])}"} if settings.api_key else {}
    try:
        listed = httpx.get(url, headers=headers, timeout=10).raise_for_status().json()["data"]
    except httpx.HTTPError as e:
        print(f"no tierlm server answers at {url}: {e}", file=sys.stderr)
        return 1
    table = Table("name", "state", "memory", "requests", "until", title=url)
    for m in listed:
        if m["state"] in ("loaded", "pinned", "loading"):
            memory = f"{m['memory_bytes'] / 2**20:.0f} MiB" if m.get("memory_bytes") else "-"
            until = "forever" if m.get("expires_in_s") is None else f"{m['expires_in_s']:.0f} s"
            table.add_row(m["id"], m["state"], memory, str(m.get("in_flight", 0)), until)
    _console().print(table)
    return 0


def _console():
    from rich.console import Console

    return Console(width=max(100, Console().width))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierlm", description="LLM inference server on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    _add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)
    pull = sub.add_parser("pull", help="fetch and import a model without serving it")
    pull.add_argument("name", nargs="?", default="default",
                      help="default, gemma-3-270m, qwen2.5-coder-0.5b or all-minilm-l6-v2 (embeddings)")
    pull.add_argument("--bits", type=int, choices=(4, 8, 16), default=None,
                      help="MLX bits for re-quantized weights (default: the model's own choice)")
    _add_settings_flags(pull)
    pull.set_defaults(func=cmd_pull)
    imp = sub.add_parser("import", help="convert a GGUF file into a model folder")
    imp.add_argument("file", help="the .gguf file")
    imp.add_argument("--name", help="folder name in the models dir (default: the file's stem)")
    imp.add_argument("--bits", type=int, choices=(4, 8, 16), default=None,
                     help="4 or 8: every matrix re-quantized to MLX affine; 16: bfloat16 (default: each "
                          "tensor in the fewest MLX bits that hold its GGUF type: Q4_* 4, Q5_* 5, Q8_0/Q6_K 8)")
    _add_settings_flags(imp)
    imp.set_defaults(func=cmd_import)
    lst = sub.add_parser("list", help="the models in the models dir")
    _add_settings_flags(lst)
    lst.set_defaults(func=cmd_list)
    ps = sub.add_parser("ps", help="the models a running server has loaded")
    _add_settings_flags(ps)
    ps.set_defaults(func=cmd_ps)
    from tierlm.bench.cli import add_bench_parser  # the harness; the server never imports it

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
