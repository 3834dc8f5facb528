"""tierlm reads GGUF files through gguf's GGUFReader with one change: its memory
map seen as a plain ndarray (gguf_dequant._Reader). That reaches inside gguf; if
gguf stops keeping the map in `data`, this fails rather than the reads going
slow without a word."""

from __future__ import annotations

import numpy as np
from gguf import GGUFWriter

from tierlm.models import gguf_dequant


def test_a_written_gguf_reads_back_through_a_plain_view_of_its_map(tmp_path):
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("test.count", 7)
    writer.add_token_list([f"tok{i}" for i in range(1000)])
    weight = np.arange(24, dtype=np.float32).reshape(4, 6)
    writer.add_tensor("w", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf_dequant._Reader(str(path))
    assert type(reader.data) is np.ndarray  # not an np.memmap: the hook took effect
    meta, tensors = gguf_dequant.read_gguf(path)
    assert meta["test.count"] == 7 and meta["tokenizer.ggml.tokens"][999] == "tok999"
    (w,) = tensors
    assert w.name == "w" and w.shape == (4, 6)
    np.testing.assert_array_equal(w.to_float32(), weight)
