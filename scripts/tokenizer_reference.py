"""Write llama.cpp's tokenization of tests/data/tokenizers/corpus.json for a
GGUF file: the reference that tests/test_qwen_coder.py holds the importer's
tokenizer to.

    python scripts/tokenizer_reference.py MODEL.gguf LLAMA_TOKENIZE OUT.json

LLAMA_TOKENIZE is llama.cpp's `llama-tokenize`, built from the llama.cpp
source in the llama-cpp-python sdist (scripts/build_llama_server.sh with the
target `llama-tokenize`). It loads the vocabulary alone, parses special tokens
and adds no BOS: the same as `Tokenizer.encode(text, add_special_tokens=False)`.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "data" / "tokenizers" / "corpus.json"


def llama_cpp_ids(gguf: Path, binary: Path, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write(text)
    try:
        done = subprocess.run([str(binary), "-m", str(gguf), "-f", f.name, "--ids", "--no-escape", "--no-bos",
                               "--log-disable"], capture_output=True, text=True, check=True)
    finally:
        Path(f.name).unlink()
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def main() -> None:
    gguf, binary, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    texts = json.loads(CORPUS.read_text())
    ids = [llama_cpp_ids(gguf, binary, text) for text in texts]
    reference = {"gguf": gguf.name, "tokenizer": f"llama.cpp: {binary}", "ids": ids}
    out.write_text(json.dumps(reference) + "\n")


if __name__ == "__main__":
    main()
