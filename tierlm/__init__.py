"""tierlm: an LLM inference server on MLX.

The Python API, for offline batch work without HTTP: `LLM`, `SamplingParams`,
`Completion` (tierlm.llm). They are imported when first used, so that
`import tierlm.config` and the command line do not load MLX."""

__all__ = ["LLM", "Completion", "SamplingParams"]


def __getattr__(name: str):
    if name in __all__:
        from tierlm import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tierlm' has no attribute {name!r}")
