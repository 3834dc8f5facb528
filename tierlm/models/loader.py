"""Loading an mlx-lm model folder and reading what the server needs to know of it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from tierlm.models.model_folder import is_model_folder, max_seq_length

log = logging.getLogger(__name__)

_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


@dataclass
class ModelInfo:
    name: str
    path: Path
    context_length: int
    model_type: str


def read_model_info(path: Path, name: str | None = None) -> ModelInfo:
    if not is_model_folder(path):
        raise FileNotFoundError(f"{path} is not a model folder (config.json + *.safetensors)")
    config = json.loads((path / "config.json").read_text())
    text_config = config.get("text_config", {})
    context = next(
        (c[k] for c in (config, text_config) for k in _CONTEXT_KEYS if isinstance(c.get(k), int)),
        4096,
    )
    context = min(context, max_seq_length(path) or context)
    return ModelInfo(
        name=name or path.name,
        path=path,
        context_length=context,
        model_type=config.get("model_type", "unknown"),
    )


def load_model(path: Path, cpu_weights_dtype: str = "auto", memory_bytes: int | None = None,
               use_cpu_kernels: bool = True, use_amx: bool = True, tokenizer=None, shard_group=None):
    """mlx-lm's own loader: (model, tokenizer wrapper), with what the device's
    backend adds set up (tierlm.backends.prepare; on MLX's CPU backend the
    `cpu_*` settings: --cpu-weights-dtype, --cpu-kernels, --cpu-amx). The
    backend's description is `tierlm.backends.describe(model)`. Call on the
    engine's thread. `tokenizer`: one loaded before (`load_tokenizer`), or a
    function that returns it once the weights are in (one loading beside them);
    None loads it here. `shard_group`: an mx.distributed group this rank holds its
    shard of the model for (mlx-lm's tensor-parallel `shard`, before the backend
    sets up: the CPU backend's own kernels are left out then, see
    serving/assembly.py)."""
    from mlx_lm import load
    from mlx_lm.utils import load_model as load_weights

    from tierlm import backends
    from tierlm.config import total_memory

    if tokenizer is None:
        model, tokenizer = load(str(path))
    else:
        model, _ = load_weights(Path(path))
        tokenizer = tokenizer() if callable(tokenizer) else tokenizer
    if shard_group is not None:
        shard_model(model, shard_group)
    backend = backends.prepare(model, cpu_weights_dtype=cpu_weights_dtype,
                               memory_bytes=memory_bytes or total_memory(),
                               cpu_kernels=use_cpu_kernels, cpu_amx=use_amx,
                               probe_tokens=_probe_tokens(tokenizer))
    for line in backend.log:
        log.info("%s", line)
    for line in backend.warnings:
        log.warning("%s", line)
    _evaluate_all(model)
    _settle_random_state()
    return model, tokenizer


def _probe_tokens(tokenizer) -> list[int] | None:
    """The reference text the CPU backend probes int8 activations with, as this
    model's tokenizer encodes it (cpu.int8); None where it cannot encode."""
    from tierlm.backends.cpu.int8 import probe_tokens

    try:
        return probe_tokens(tokenizer)
    except Exception:  # noqa: BLE001  a tokenizer that cannot: float32 products
        return None


def shard_model(model, group) -> None:
    """This rank's share of every layer (mlx-lm's tensor-parallel `shard`); a model
    mlx-lm cannot shard, or whose heads do not divide among the ranks, is refused."""
    if not hasattr(model, "shard"):
        raise ValueError(f"mlx-lm cannot shard {type(model).__module__} models over several ranks")
    args, ranks = getattr(model, "args", None), group.size()
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(args, name, None)
        if isinstance(heads, int) and heads % ranks:
            raise ValueError(f"the model's {heads} {name.replace('num_', '').replace('_', ' ')} do not divide "
                             f"among {ranks} ranks")
    model.shard(group)


def _settle_random_state() -> None:
    """Building the model drew its initial weights from MLX's global random key
    (one split per parameter), lazily; the loaded weights replaced them unseen,
    so the key was left a graph of those splits, which every load lengthened:
    about 1 MiB of native memory per load of SmolLM2, never given back.
    Evaluated, the key is one array again."""
    import mlx.core as mx

    mx.eval(mx.random.state)


def load_tokenizer(path: Path):
    """The model's tokenizer wrapper as mlx-lm's `load` makes it (the end-of-sequence
    ids of config.json and generation_config.json), without its weights: touches
    no MLX array, any thread may call it."""
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    path = Path(path)
    return mlx_load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))


def tokenizer_stamp(path: Path) -> tuple:
    """What a cached tokenizer of `path` was made from: every file of the folder
    but the weights (names, sizes, modification times). A changed one (a model
    imported again under the same name) makes another stamp."""
    files = sorted(p for p in Path(path).iterdir() if p.is_file() and p.suffix != ".safetensors")
    return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)


def _evaluate_all(model) -> None:
    """Every array the model holds, private ones too: RoPE's `_freqs` (kept in the
    module's dict but left out of `parameters()`) would stay a lazy graph on the
    loading thread's stream, which another thread cannot run on CUDA (`There is
    no Stream(gpu, 0) in current thread`). Evaluated, any thread can use the model."""
    import mlx.core as mx

    held = [v for m in model.modules() for v in m.values() if isinstance(v, mx.array)]
    mx.eval(model.parameters(), held)


def usable_vocab_size(tokenizer, model, name: str = "model") -> int:
    """Token ids a request may use: known to the tokenizer *and* given a row by the
    model's embedding. A model folder whose tokenizer lists more tokens than the
    embedding has rows would otherwise read past the table (NaN logits, or worse)."""
    return vocab_bounds(tokenizer, model, name)[0]


def vocab_bounds(tokenizer, model, name: str = "model") -> tuple[int, bool]:
    """`usable_vocab_size`, and whether every id the tokenizer makes is below it
    (then a prompt the tokenizer made needs no check of its ids)."""
    vocab = tokenizer.vocab  # once: building this dict takes ~17 ms and holds the GIL
    known = len(vocab)
    rows = getattr(getattr(model, "args", None), "vocab_size", None) or known
    if rows < known:
        log.warning("%s: the tokenizer knows %d tokens, the embedding has %d rows; "
                    "prompts holding ids past %d are refused", name, known, rows, rows - 1)
    usable = min(known, rows)
    return usable, max(vocab.values(), default=-1) < usable
