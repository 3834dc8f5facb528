"""Block keys: a SHA-256 chain over the model fingerprint, the parent block's key,
the block's token ids and any extra keys. The same in every process."""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from pathlib import Path

import numpy as np

# the token ids as hashed: 4-byte little-endian unsigned integers (keys on SSD outlive a process)
assert array("I").itemsize == 4 and sys.byteorder == "little"


def token_bytes(tokens) -> bytes:
    """Token ids as the keys hash them. A list through `array` (a 20k-token
    prompt: ~0.3 ms, against ~0.7 for numpy's conversion of its blocks)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.uint32).tobytes()
    return array("I", tokens).tobytes()


def block_key(parent: bytes, tokens, extra: bytes = b"") -> bytes:
    return _key(parent, token_bytes(tokens), extra)


def _key(parent: bytes, data, extra: bytes) -> bytes:
    h = hashlib.sha256(parent)
    h.update(data)
    h.update(extra)
    return h.digest()


def block_keys(root: bytes, tokens: list[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """Keys of every full block of `tokens`; the first block's parent is `root`.
    The ids are converted once, each block's bytes a view of them."""
    data = memoryview(token_bytes(tokens[: len(tokens) // block_size * block_size]))
    keys, parent, step = [], root, 4 * block_size
    for start in range(0, len(data), step):
        parent = _key(parent, data[start : start + step], extra)
        keys.append(parent)
    return keys


def part_keys(parent: bytes, tokens, shortest: int, extra: bytes) -> list[tuple[int, bytes]]:
    """(n, `block_key(parent, tokens[:n], extra)`) for n from len(tokens) down to
    `shortest`: the keys a part block of the prompt's next tokens could have."""
    data = token_bytes(tokens)
    start = hashlib.sha256(parent)
    out = []
    for n in range(len(tokens), shortest - 1, -1):
        h = start.copy()
        h.update(data[: 4 * n])
        h.update(extra)
        out.append((n, h.digest()))
    return out


def model_fingerprint(model_path: Path, runtime: dict) -> bytes:
    """What makes two models' KV interchangeable: the config, the weight files'
    headers (names, shapes, dtypes) and sizes, and how the weights run here
    (`runtime`: e.g. the dtype they were cast to)."""
    h = hashlib.sha256(b"tierlm-model-v1")
    h.update((model_path / "config.json").read_bytes())
    for weights in sorted(model_path.glob("*.safetensors")):
        with open(weights, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(header_len))
        h.update(str(weights.stat().st_size).encode())
    h.update(json.dumps(runtime, sort_keys=True).encode())
    return h.digest()
