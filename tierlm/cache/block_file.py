"""One block as one safetensors file: its arrays, its token ids, and metadata
that lets a reader refuse anything that is not exactly what it asked for.

Format v2 (`tierlm-block-v2`): a plain safetensors file (any safetensors reader
opens it) whose metadata names the format, the model fingerprint, the block's
key and parent, its token count, the cache layout (`signature`), the payload's
structure (`layout`) and a checksum: XXH3-128 over the whole file with the
checksum's own hex digits zeroed, so the header (every field above, the
tensors' dtypes, shapes and offsets) is covered as well as the data. XXH3 runs
at memory speed (~10 GB/s a core, vs ~1.2 GB/s for SHA-256); it guards against
damage, not forgery: identity is the key chain's and the stored token ids'
(both checked on every read). Files of format v1 (SHA-256 over the tensors)
fail the format check and are deleted on first read, like any invalid file:
their tokens are computed once more and stored as v2.

The work is split by thread (DESIGN: every MLX call on the engine's worker):
- `encode` (worker): MLX arrays -> numpy, one copy of the block's bytes;
- `to_bytes` (SSD writer thread): header plus the tensors' own buffers, no
  concatenation; the writer writes them one after another;
- `check_header` (any thread, e.g. the SSD tier's read pool): every check that
  needs only the header (format, model, key, token count, layout, sizes);
- `check_data` (any thread): the checksum and the token ids, here over the
  memory of the arrays that `mx.load` read straight from the file into MLX
  (`loaded_parts`, worker: no copy of ours), then `payload_of` (worker);
- `verify`: both checks over a whole file's bytes (a file read some other way).
A packed KV block (PrefixCache: every layer plain attention KV of one shape) is
one array of shape (2 x layers, kv heads, block tokens, head dim); other blocks
are a tree of per-layer payloads (`layout`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import xxhash

FORMAT = "tierlm-block-v2"
_CHECKSUM_PREFIX = "xxh3_128:"
_PLACEHOLDER = _CHECKSUM_PREFIX + "0" * 32

_ST_DTYPE = {  # numpy dtype -> safetensors dtype code
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16", np.dtype(np.int16): "I16", np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32", np.dtype(np.uint64): "U64", np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
}
_NP_DTYPE = {code: dtype for dtype, code in _ST_DTYPE.items()}


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


def _unflatten(template, arrays: dict[str, mx.array]):
    if "a" in template:
        array = arrays[f"a{template['a']}"]
        return array.view(mx.bfloat16) if template["dtype"] == "bfloat16" else array
    if "seq" in template:
        items = [_unflatten(t, arrays) for t in template["items"]]
        return tuple(items) if template["seq"] == "tuple" else items
    return template["v"]


def encode(key: bytes, parent: bytes, tokens: tuple[int, ...], payload, fingerprint: bytes,
           signature: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Worker thread: the block as numpy tensors plus metadata (checksum added by
    `to_bytes`). `payload`: a packed KV array (or a quantized one, a tuple), or
    the per-layer payload list."""
    arrays: list[mx.array] = []
    template = _flatten(payload if isinstance(payload, (mx.array, tuple)) else list(payload), arrays)
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


def to_bytes(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> list[memoryview]:
    """Writer thread, plain CPU work: the file as a list of buffers to write in
    order (the header, then each tensor's own bytes: nothing is concatenated)."""
    header: dict = {"__metadata__": {**meta, "checksum": _PLACEHOLDER}}
    offset, parts = 0, []
    for name, t in tensors.items():
        t = np.ascontiguousarray(t)
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
        parts.append(memoryview(t).cast("B"))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    head = bytearray(len(text).to_bytes(8, "little") + text)
    h = xxhash.xxh3_128(head)
    for p in parts:
        h.update(p)
    at = head.index(_PLACEHOLDER.encode())
    head[at : at + len(_PLACEHOLDER)] = (_CHECKSUM_PREFIX + h.hexdigest()).encode()
    return [memoryview(head), *parts]


def _metadata(header: bytes) -> dict:
    """The metadata of a safetensors file from its start (8-byte length, JSON header)."""
    header_len = int.from_bytes(header[:8], "little")
    return json.loads(bytes(header[8 : 8 + header_len])).get("__metadata__", {})


def fingerprint_of(path) -> str | None:
    """The hex model fingerprint a block file was written for; None if unreadable.
    Reads only the header."""
    return (metadata_of(path) or {}).get("fingerprint")


def metadata_of(path) -> dict | None:
    """A block file's metadata (fingerprint, signature, token_count, ...), from its
    header alone, unchecked; None if unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            head += f.read(int.from_bytes(head, "little"))
        meta = _metadata(head)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def header_length(first: bytes) -> int:
    """The header's length from a file's first 8 bytes."""
    return int.from_bytes(first[:8], "little")


@dataclass
class Header:
    """A block file's header that passed every check it can answer alone."""
    parent: bytes
    template: dict  # the payload's structure (`layout`)
    tensors: dict[str, tuple[np.dtype, list[int], int, int]]  # name -> dtype, shape, data start, end
    head: bytes  # the header as its checksum covers it (its own digits zeroed)
    checksum: str
    nbytes: int  # the file's size


def check_header(head: bytes, size: int, key: bytes, tokens: tuple[int, ...], fingerprint: bytes,
                 signature: str) -> Header:
    """Any thread, no MLX: the checks of a block file's header (`head`: its first
    8 + header_length bytes; `size`: the file's), or BlockFileError. The tensors
    must fill the data after the header exactly, in order, as safetensors lays
    them out: the checksum over them is then the checksum over the file."""
    try:
        if len(head) < 8 or 8 + header_length(head) != len(head) or len(head) > size:
            raise ValueError(f"header of {len(head)} bytes in a file of {size}")
        header = json.loads(head[8:])
        meta = header.pop("__metadata__")
    except Exception as e:  # truncated, garbled, not safetensors at all
        raise BlockFileError(f"unreadable: {e}") from e
    expected = {"format": FORMAT, "fingerprint": fingerprint.hex(), "key": key.hex(),
                "token_count": str(len(tokens)), "signature": signature}
    for field, value in expected.items():
        if meta.get(field) != value:
            raise BlockFileError(f"{field} is {meta.get(field)!r}, expected {value!r}")
    checksum = meta.get("checksum", "")
    if not (checksum.startswith(_CHECKSUM_PREFIX) and len(checksum) == len(_PLACEHOLDER)
            and head.count(checksum.encode()) == 1):
        raise BlockFileError(f"checksum field {checksum!r} malformed")
    try:
        tensors, at = {}, 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype, (start, end) = _NP_DTYPE[info["dtype"]], info["data_offsets"]
            count = int(np.prod(info["shape"], dtype=np.int64))
            if start != at or end - start != count * dtype.itemsize:
                raise ValueError(f"tensor {name}: offsets {start}..{end} do not follow {at}")
            tensors[name], at = (dtype, list(info["shape"]), start, end), end
        if len(head) + at != size:
            raise ValueError(f"the tensors end at {len(head) + at}, the file at {size}")
        template = json.loads(meta["layout"])
        parent = bytes.fromhex(meta["parent"])
    except Exception as e:
        raise BlockFileError(f"inconsistent: {e}") from e
    if "tokens" not in tensors:
        raise BlockFileError("no token ids")
    return Header(parent, template, tensors, head.replace(checksum.encode(), _PLACEHOLDER.encode()),
                  checksum, size)


def check_data(header: Header, parts, stored_tokens: np.ndarray, tokens: tuple[int, ...]) -> None:
    """Any thread, no MLX: the checksum over the header and `parts` (the tensors'
    bytes in file order), then the stored token ids against the wanted ones."""
    h = xxhash.xxh3_128(header.head)
    for part in parts:
        h.update(part)
    if _CHECKSUM_PREFIX + h.hexdigest() != header.checksum:
        raise BlockFileError("checksum mismatch")
    # the checksum covers the header: what follows only guards against a writer's bug
    if not np.array_equal(stored_tokens, np.asarray(tokens, dtype=np.uint32)):
        raise BlockFileError("token ids differ")


def loaded_parts(header: Header, arrays: dict[str, mx.array]) -> tuple[list[memoryview], np.ndarray]:
    """Worker thread: what `check_data` needs of the arrays `mx.load` read from the
    file (evaluated, on a CPU stream: host memory, seen in place through the
    buffer protocol): their bytes in file order, and the stored token ids."""
    for name, (dtype, shape, _, _) in header.tensors.items():
        a = arrays.get(name)
        if a is None or list(a.shape) != shape or a.itemsize != dtype.itemsize:
            raise BlockFileError(f"inconsistent: tensor {name} loaded as {None if a is None else a.shape}")
    parts = [memoryview(arrays[name]).cast("B") for name in header.tensors]
    return parts, np.frombuffer(memoryview(arrays["tokens"]), np.uint32)


def payload_of(header: Header, arrays: dict[str, mx.array]):
    """Worker thread: the payload built from a checked file's arrays: a packed KV
    array, or the per-layer payload list."""
    return _unflatten(header.template, arrays)


def verify(data, key: bytes, tokens: tuple[int, ...], fingerprint: bytes, signature: str) -> Header:
    """Any thread, no MLX: every check of a whole block file's bytes (bytes,
    bytearray, memoryview or a uint8 array), or BlockFileError."""
    buf = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else memoryview(data)
    n = 8 + header_length(bytes(buf[:8])) if buf.nbytes >= 8 else 0
    header = check_header(bytes(buf[:n]) if 8 <= n <= buf.nbytes else bytes(buf[:8]), buf.nbytes, key, tokens,
                          fingerprint, signature)
    _, _, start, end = header.tensors["tokens"]
    stored = np.frombuffer(buf, np.uint32, (end - start) // 4, n + start)
    check_data(header, [buf[n:]], stored, tokens)
    return header
