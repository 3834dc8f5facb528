"""Command line: `tierlm serve`, `tierlm pull`, `tierlm bench`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tierlm.config import Settings, load_settings, setting_fields
from tierlm.models.default_model import ensure_default_model

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


def _settings(args: argparse.Namespace) -> Settings:
    cli = {f.name: getattr(args, f.name, None) for f in setting_fields()}
    return load_settings(cli, args.config)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def resolve_model(settings: Settings) -> Path:
    if settings.model and settings.model != "default":
        path = Path(settings.model).expanduser()
        if not path.is_dir():
            candidate = Path(settings.model_dir).expanduser() / settings.model
            path = candidate if candidate.is_dir() else path
        return path
    return ensure_default_model(Path(settings.model_dir).expanduser())


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _setup_logging(settings.log_level)
    import uvicorn

    from tierlm.api.app import create_app
    from tierlm.engine.allocator import configure_allocator

    configure_allocator()  # the C heap's free pages go back when idle; started before the model loads

    model_path = resolve_model(settings)
    app = create_app(settings, model_path)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=5)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _setup_logging(settings.log_level)
    if args.name != "default":
        print(f"unknown model {args.name!r}: only 'default' can be pulled", file=sys.stderr)
        return 2
    path = ensure_default_model(Path(settings.model_dir).expanduser())
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierlm", description="LLM inference server on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    _add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)
    pull = sub.add_parser("pull", help="fetch and import a model without serving it")
    pull.add_argument("name", nargs="?", default="default")
    _add_settings_flags(pull)
    pull.set_defaults(func=cmd_pull)
    from tierlm.bench.cli import add_bench_parser  # the harness; the server never imports it

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
