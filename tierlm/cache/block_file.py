"""One block as one safetensors file: its arrays, its token ids, and metadata
that lets a reader refuse anything that is not exactly what it asked for.

Encoding runs on the engine's worker thread (MLX arrays -> numpy); the bytes are
then written by the SSD writer thread. Decoding checks every field and the
checksum before it builds MLX arrays.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

FORMAT = "tierlm-block-v1"


class BlockFileError(ValueError):
    """The file is not a valid block for this lookup."""


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: keep the bits
        return np.array(a.view(mx.uint16))
    return np.array(a)


def _flatten(state, arrays: list[mx.array]):
    """A JSON template of the payload's structure, arrays replaced by indices."""
    if isinstance(state, mx.array):
        arrays.append(state)
        return {"a": len(arrays) - 1, "dtype": str(state.dtype).split(".")[-1]}
    if isinstance(state, (list, tuple)):
        return {"seq": "tuple" if isinstance(state, tuple) else "list",
                "items": [_flatten(s, arrays) for s in state]}
    if state is None or isinstance(state, (int, float, bool, str)):
        return {"v": state}
    raise TypeError(f"cannot store a {type(state).__name__} in a block file")


def _unflatten(template, arrays: dict[str, np.ndarray]):
    if "a" in template:
        array = mx.array(arrays[f"a{template['a']}"])
        return array.view(mx.bfloat16) if template["dtype"] == "bfloat16" else array
    if "seq" in template:
        items = [_unflatten(t, arrays) for t in template["items"]]
        return tuple(items) if template["seq"] == "tuple" else items
    return template["v"]


def _checksum(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).tobytes())
    return h.hexdigest()


def encode(key: bytes, parent: bytes, tokens: tuple[int, ...], layers: list, fingerprint: bytes,
           signature: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Worker thread: the block as numpy tensors plus metadata (checksum added later)."""
    arrays: list[mx.array] = []
    template = _flatten(list(layers), arrays)
    tensors = {f"a{i}": _to_numpy(a) for i, a in enumerate(arrays)}
    tensors["tokens"] = np.asarray(tokens, dtype=np.uint32)
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint.hex(),
        "key": key.hex(),
        "parent": parent.hex(),
        "token_count": str(len(tokens)),
        "signature": signature,
        "layout": json.dumps(template),
    }
    return tensors, meta


def to_bytes(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> bytes:
    """Writer thread: plain CPU work, no MLX."""
    return st_save(tensors, metadata={**meta, "checksum": _checksum(tensors)})


def _metadata(header: bytes) -> dict:
    """The metadata of a safetensors file from its start (8-byte length, JSON header)."""
    header_len = int.from_bytes(header[:8], "little")
    return json.loads(header[8 : 8 + header_len]).get("__metadata__", {})


def fingerprint_of(path) -> str | None:
    """The hex model fingerprint a block file was written for; None if unreadable.
    Reads only the header."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            head += f.read(int.from_bytes(head, "little"))
        return _metadata(head).get("fingerprint")
    except (OSError, ValueError):
        return None


def decode(data: bytes, key: bytes, tokens: tuple[int, ...], fingerprint: bytes, signature: str):
    """Worker thread: (parent key, layers) of a verified block, or BlockFileError."""
    try:
        meta = _metadata(data)
        tensors = st_load(data)
    except Exception as e:  # truncated, garbled, not safetensors at all
        raise BlockFileError(f"unreadable: {e}") from e
    expected = {"format": FORMAT, "fingerprint": fingerprint.hex(), "key": key.hex(),
                "token_count": str(len(tokens)), "signature": signature}
    for field, value in expected.items():
        if meta.get(field) != value:
            raise BlockFileError(f"{field} is {meta.get(field)!r}, expected {value!r}")
    if _checksum(tensors) != meta.get("checksum"):
        raise BlockFileError("checksum mismatch")
    if tuple(tensors["tokens"].tolist()) != tuple(tokens):
        raise BlockFileError("token ids differ")
    layers = _unflatten(json.loads(meta["layout"]), tensors)
    return bytes.fromhex(meta["parent"]), layers
