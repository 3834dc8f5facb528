"""Command line: `tierlm serve`, `tierlm pull`, `tierlm bench`."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from pathlib import Path

from tierlm.config import Settings, load_settings
from tierlm.models.default_model import ensure_default_model

log = logging.getLogger("tierlm")

_HELP = {
    "host": "address to listen on",
    "port": "port to listen on",
    "model": "an mlx-lm model folder to serve (default: the built-in SmolLM2-135M-Instruct)",
    "model_dir": "where models are kept (default ~/.tierlm/models)",
    "served_model_name": "the model id clients use (default: the folder name)",
    "api_key": "require this key as 'Authorization: Bearer KEY'",
    "max_concurrent_requests": "requests decoded together at most; more wait in a queue",
    "prefill_step_size": "prompt tokens per prefill chunk (default 256 on CPU, 2048 on a GPU)",
    "memory_limit": "refuse prefills that would pass this (bytes, 8GB, or 75%%)",
    "cpu_weights_dtype": "weights' dtype on the CPU backend: auto (float32 when it fits), float32, "
                         "bfloat16, float16, or stored",
    "cpu_kernels": "on the CPU backend in float32, tierlm's attention and SwiGLU (default on)",
    "cpu_amx": "on CPUs with AMX, float32 weights multiply as bfloat16 on the tile unit (default on)",
    "decode_burst_ms": "decode time per hand-off to the event loop with one request (0: off)",
    "decode_burst_ms_batched": "the same per 8 requests running, with several (up to the larger of the two)",
    "stream_interval": "tokens per streamed chunk",
    "prefix_cache": "reuse the KV of prompt prefixes seen before (default on)",
    "cache_block_size": "tokens per prefix-cache block",
    "hot_cache_size": "memory for cached blocks (bytes, 4GB, or 10%%)",
    "ssd_cache": "keep blocks on disk too, across restarts (default on)",
    "ssd_cache_dir": "folder of the SSD tier (default ~/.tierlm/cache)",
    "ssd_cache_size": "disk for cached blocks (bytes, 50GB, or 10%% of the disk)",
    "ssd_write_through": "write every block to SSD at once instead of when it leaves memory",
    "sse_keepalive_s": "seconds between SSE keep-alive comments while waiting",
    "max_body_bytes": "largest request body accepted, chunked or not",
    "allow_client_chat_template": "render a chat_template sent in a request (bounded to 2 s and 16M "
                                  "characters; default off: a template is code)",
    "stall_timeout_s": "a request, or the engine's worker, with no progress this long ends with an "
                       "error (and /health says degraded while the worker is stuck)",
    "log_level": "debug, info, warning or error",
}


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=_HELP.get(f.name))
            continue
        kind = str if "str" in f.type else int if f.type.startswith("int") else float
        parser.add_argument(flag, type=kind, default=None, help=_HELP.get(f.name))
    parser.add_argument("--config", help="settings file (TOML; default ~/.tierlm/settings.toml)")


def _settings(args: argparse.Namespace) -> Settings:
    cli = {f.name: getattr(args, f.name, None) for f in fields(Settings)}
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
