"""A tokenizer's chat pieces kept in a file, so that a restarted server
tokenizes only text it has never seen.

The prompt tokenizer (prompt_pieces) keeps the ids of every piece of chat text
it tokenized, in memory. After a restart it had none: an agent's next turn,
an SSD hit for the engine, was tokenized whole again (a 20k-token prompt:
~7 ms on the H100's host, of a ~50 ms answer). The pieces now go to a file
beside the SSD tier's blocks (`pieces/<key>.bin`, one per tokenizer: the key
is made from its folder and its files' names, sizes and times), written at
most every SAVE_EVERY_S while new pieces come, and when the server stops;
a new encoder of the same tokenizer reads it before its first prompt.

A file: MAGIC, then one record a piece, oldest first: its CRC-32 (of what
follows), the text's length in bytes, its ids' count, the text (UTF-8), the
ids (uint32, little-endian). A record that does not check out ends the read:
a file cut short keeps what came before. The encoder still checks its first
prompts against the whole text tokenized (prompt_pieces), pieces read from
here included.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import sys
import zlib
from array import array
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"tierlm-pieces-1\n"
SAVE_EVERY_S = 60.0
_HEAD = struct.Struct("<III")  # crc32, text bytes, ids


def path_for(folder: str | Path, tokenizer_path: Path, stamp: tuple) -> Path:
    """The file of the tokenizer at `tokenizer_path` (as `stamp` describes its
    files) in the SSD tier's `folder`."""
    key = hashlib.sha256(repr((str(Path(tokenizer_path).resolve()), stamp)).encode()).hexdigest()[:32]
    return Path(folder).expanduser() / "pieces" / f"{key}.bin"


def read(path: Path) -> list[tuple[str, array]]:
    """The pieces in the file, oldest first; none where there is no file or it
    is not one (a bad record ends the read)."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    if not data.startswith(MAGIC):
        return []
    pieces, at = [], len(MAGIC)
    while at + _HEAD.size <= len(data):
        crc, text_bytes, count = _HEAD.unpack_from(data, at)
        body = data[at + 4 : at + _HEAD.size + text_bytes + 4 * count]  # what the CRC covers
        if len(body) != 8 + text_bytes + 4 * count or zlib.crc32(body) != crc:
            log.warning("prompt pieces %s: a bad record after %d pieces; the rest is not read", path, len(pieces))
            break
        start = at + _HEAD.size
        ids = array("I")
        ids.frombytes(data[start + text_bytes : start + text_bytes + 4 * count])
        if sys.byteorder != "little":
            ids.byteswap()
        pieces.append((data[start : start + text_bytes].decode("utf-8"), ids))
        at = start + text_bytes + 4 * count
    return pieces


def write(path: Path, pieces: list[tuple[str, array]]) -> None:
    """The pieces, oldest first, as the whole file (written aside, then moved in
    place: a reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    chunks = [MAGIC]
    for text, ids in pieces:
        encoded = text.encode("utf-8")
        if sys.byteorder != "little":
            ids = array("I", ids)
            ids.byteswap()
        body = struct.pack("<II", len(encoded), len(ids)) + encoded + ids.tobytes()
        chunks += [struct.pack("<I", zlib.crc32(body)), body]
    aside = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        aside.write_bytes(b"".join(chunks))
        os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)
