"""An independent reference for BERT encoders: a plain numpy forward pass (float64)
of a model folder's safetensors, tokenized by the `tokenizers` library from its
tokenizer.json with the file's own padding and truncation turned off. It shares
no code with tierlm.models.encoder, so the tests compare two implementations.

- `BertReference(folder).embed(texts)`: a sentence-transformers folder
  (modules.json, 1_Pooling/config.json): embeddings (word + position + token
  type) and LayerNorm; each layer's self-attention with the padding mask, the
  output dense + residual + LayerNorm, the feed-forward with the exact (erf)
  GELU + residual + LayerNorm; pooling as 1_Pooling says (CLS, mean, max,
  mean-sqrt-len, concatenated in sentence-transformers' order); L2-normalized
  where modules.json lists a Normalize module. Texts past the model's
  max_seq_length (sentence_bert_config.json, else max_position_embeddings) are
  a ValueError unless `truncate=True`, which keeps [CLS], the first tokens and
  [SEP] as sentence-transformers' tokenizer call does.
- `BertReference(folder).rerank(query, documents)`: a cross-encoder
  (BertForSequenceClassification: weights under `bert.`, `classifier.`): the
  pair [CLS] query [SEP] document [SEP] with token types 0/1, the pooler
  (dense + tanh on [CLS]), the classifier, and sigmoid for one label
  (sentence-transformers' CrossEncoder default).
- `build_cross_encoder(folder, tokenizer_folder)`: a tiny random cross-encoder
  (hidden 32, 2 layers, 2 heads, one label) with Hugging Face's weight names and
  a real tokenizer copied in, for the rerank tests.

Checked against sentence-transformers itself, outside CI (its torch is not a
dependency of this project): `python tests/bert_reference.py --check
--python /tmp/st-venv/bin/python` (sentence-transformers 6.3.0, transformers
5.24.0, torch 2.14.1 on CPU, in their own venv) on all-MiniLM-L6-v2 and the 31
TEXTS below (code, unicode, CJK, Arabic, emoji, digits, one letter, empty, up
to 1,500 characters, two past 256 tokens, truncated as sentence-transformers
does), and on the random cross-encoder with CrossEncoder.predict on 8 pairs:

    embeddings: max |cos - 1| = 4.0e-13, max |element difference| = 1.5e-7
                (sentence-transformers computes in float32; this in float64)
    rerank:     max |score - CrossEncoder.predict's| = 1.6e-7

sentence-transformers normalizes all-MiniLM-L6-v2's embeddings although the
folder has no 2_Normalize (modules.json names it; the module has no files),
and truncates at its max_seq_length, 256, although tokenizer.json says
padding and truncation at 128: its tokenizer call overrides the file's.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU, x * Phi(x), with the error function itself."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


class BertReference:
    def __init__(self, folder: Path | str):
        folder = Path(folder)
        self.config = json.loads((folder / "config.json").read_text())
        tensors = {}
        for path in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(path))
        self.cross_encoder = "classifier.weight" in tensors
        # a BertModel's names, whether saved bare (sentence-transformers) or under bert.
        self.w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in tensors.items()
                  if v.dtype.kind == "f"}
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        st_config = folder / "sentence_bert_config.json"
        self.max_tokens = (json.loads(st_config.read_text())["max_seq_length"] if st_config.is_file()
                           else self.config["max_position_embeddings"])
        pooling = folder / "1_Pooling" / "config.json"
        self.pooling = json.loads(pooling.read_text()) if pooling.is_file() else {"pooling_mode_cls_token": True}
        modules = folder / "modules.json"
        self.normalize = modules.is_file() and any(
            m["type"].endswith(".Normalize") for m in json.loads(modules.read_text()))
        self._seen: dict[tuple[str, bool], np.ndarray] = {}  # (text, truncate) -> its embedding

    # ---- tokens ------------------------------------------------------------------

    def tokenize(self, text: str, pair: str | None = None, truncate: bool = False) -> tuple[list[int], list[int]]:
        """Token ids and token types, [CLS] and [SEP] included."""
        if truncate:
            self.tokenizer.enable_truncation(self.max_tokens)
        try:
            enc = self.tokenizer.encode(text, pair) if pair is not None else self.tokenizer.encode(text)
        finally:
            self.tokenizer.no_truncation()
        if len(enc.ids) > self.max_tokens:
            raise ValueError(f"{len(enc.ids)} tokens, past the model's {self.max_tokens}")
        return enc.ids, enc.type_ids

    # ---- the encoder -------------------------------------------------------------

    def hidden_states(self, ids: list[list[int]], types: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The last layer's states (batch, longest, hidden) of right-padded
        sequences, and the padding mask (batch, longest) of 1 and 0."""
        w, c = self.w, self.config
        n, length = len(ids), max(len(s) for s in ids)
        tok = np.zeros((n, length), dtype=np.int64)
        typ = np.zeros((n, length), dtype=np.int64)
        mask = np.zeros((n, length))
        for i, seq in enumerate(ids):
            tok[i, : len(seq)] = seq
            typ[i, : len(seq)] = types[i] if types else 0
            mask[i, : len(seq)] = 1
        x = (w["embeddings.word_embeddings.weight"][tok] + w["embeddings.position_embeddings.weight"][:length]
             + w["embeddings.token_type_embeddings.weight"][typ])
        eps = c.get("layer_norm_eps", 1e-12)
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        heads = c["num_attention_heads"]
        d = c["hidden_size"] // heads
        lengths = [len(s) for s in ids]

        def dense(v, name):  # as one 2-D product: numpy's stacked matmul is ~10x slower
            out = v.reshape(-1, v.shape[-1]) @ w[name + ".weight"].T + w[name + ".bias"]
            return out.reshape(*v.shape[:-1], -1)

        valid = mask > 0

        def split(v):
            return v.reshape(n, length, heads, d).transpose(0, 2, 1, 3)

        for i in range(c["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            q, k, v = (split(dense(x, p + f"attention.self.{m}")) for m in ("query", "key", "value"))
            attended = np.zeros((n, heads, length, d))
            for b, real in enumerate(lengths):  # 2-D products: numpy's stacked ones are slow
                for h in range(heads):
                    # the padding mask: a row's queries attend to its own `real` keys only
                    # (what adding -inf to padding's scores does), its padding to nothing
                    scores = q[b, h, :real] @ k[b, h, :real].T / math.sqrt(d)
                    probs = np.exp(scores - scores.max(-1, keepdims=True))
                    attended[b, h, :real] = probs / probs.sum(-1, keepdims=True) @ v[b, h, :real]
            attended = attended.transpose(0, 2, 1, 3).reshape(n, length, heads * d)
            x = layer_norm(dense(attended, p + "attention.output.dense") + x,
                           w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
            inner = dense(x, p + "intermediate.dense")
            inner[valid] = gelu(inner[valid])  # padding's rows are never attended to: left as they are
            x = layer_norm(dense(inner, p + "output.dense") + x,
                           w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        return x, mask

    # ---- embeddings ----------------------------------------------------------------

    def embed_ids(self, ids: list[list[int]]) -> np.ndarray:
        """Sentence embeddings (n, dim) of token-id sequences taken as they are."""
        states, mask = self.hidden_states(ids)
        m = mask[:, :, None]
        counts = np.maximum(m.sum(1), 1e-9)
        pooled = []  # sentence-transformers' order
        if self.pooling.get("pooling_mode_cls_token"):
            pooled.append(states[:, 0])
        if self.pooling.get("pooling_mode_max_tokens"):
            pooled.append(np.where(m > 0, states, -1e9).max(1))
        if self.pooling.get("pooling_mode_mean_tokens"):
            pooled.append((states * m).sum(1) / counts)
        if self.pooling.get("pooling_mode_mean_sqrt_len_tokens"):
            pooled.append((states * m).sum(1) / np.sqrt(counts))
        if not pooled:
            raise ValueError(f"no pooling mode this reference knows in {self.pooling}")
        out = np.concatenate(pooled, axis=-1)
        if self.normalize:
            out /= np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        return out

    def embed(self, texts: list[str], truncate: bool = False, batch: int = 16) -> np.ndarray:
        """Embeddings (n, dim), in batches of similar lengths; each text's row is
        kept, so asking again costs nothing."""
        todo = sorted({t for t in texts if (t, truncate) not in self._seen},
                      key=lambda t: len(self.tokenize(t, truncate=truncate)[0]))
        for i in range(0, len(todo), batch):
            chunk = todo[i : i + batch]
            rows = self.embed_ids([self.tokenize(t, truncate=truncate)[0] for t in chunk])
            self._seen.update({(t, truncate): row for t, row in zip(chunk, rows)})
        return np.stack([self._seen[(t, truncate)] for t in texts])

    # ---- rerank -------------------------------------------------------------------

    def logits(self, query: str, documents: list[str]) -> np.ndarray:
        """The classifier's logits (documents, labels) of each (query, document) pair."""
        pairs = [self.tokenize(query, doc, truncate=True) for doc in documents]
        states, _ = self.hidden_states([p[0] for p in pairs], [p[1] for p in pairs])
        w = self.w
        pooled = np.tanh(states[:, 0] @ w["pooler.dense.weight"].T + w["pooler.dense.bias"])
        return pooled @ w["classifier.weight"].T + w["classifier.bias"]

    def rerank(self, query: str, documents: list[str]) -> np.ndarray:
        """Relevance scores: sigmoid of the one label's logit."""
        logits = self.logits(query, documents)
        if logits.shape[1] != 1:
            raise ValueError(f"{logits.shape[1]} labels; the reference scores one-label cross-encoders")
        return 1.0 / (1.0 + np.exp(-logits[:, 0]))


def build_cross_encoder(folder: Path, tokenizer_folder: Path, seed: int = 0, hidden: int = 32, layers: int = 2,
                        heads: int = 2, intermediate: int = 64) -> Path:
    """A random-weight BertForSequenceClassification with one label, saved as
    Hugging Face saves one (config.json, model.safetensors with bert.* and
    classifier.* names), with `tokenizer_folder`'s tokenizer files copied in.
    Weights are scaled so that the scores of different documents differ."""
    tokenizer = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    vocab = len(tokenizer["model"]["vocab"])
    config = {
        "architectures": ["BertForSequenceClassification"], "model_type": "bert",
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "intermediate_size": intermediate, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
        "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0,
        "position_embedding_type": "absolute", "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
        "torch_dtype": "float32",
    }
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {}

    def linear(name, n_in, n_out, gain=1.0):
        w[name + ".weight"] = normal((n_out, n_in), gain / math.sqrt(n_in))
        w[name + ".bias"] = normal((n_out,), 0.1)

    def norm(name, n):
        w[name + ".weight"] = 1.0 + normal((n,), 0.1)
        w[name + ".bias"] = normal((n,), 0.1)

    w["bert.embeddings.word_embeddings.weight"] = normal((vocab, hidden), 1.0)
    w["bert.embeddings.position_embeddings.weight"] = normal((512, hidden), 0.5)
    w["bert.embeddings.token_type_embeddings.weight"] = normal((2, hidden), 0.5)
    norm("bert.embeddings.LayerNorm", hidden)
    for i in range(layers):
        p = f"bert.encoder.layer.{i}."
        for m in ("query", "key", "value"):
            linear(p + f"attention.self.{m}", hidden, hidden, gain=2.0 if m != "value" else 1.0)
        linear(p + "attention.output.dense", hidden, hidden)
        norm(p + "attention.output.LayerNorm", hidden)
        linear(p + "intermediate.dense", hidden, intermediate)
        linear(p + "output.dense", intermediate, hidden)
        norm(p + "output.LayerNorm", hidden)
    linear("bert.pooler.dense", hidden, hidden, gain=2.0)
    linear("classifier", hidden, 1, gain=3.0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if (tokenizer_folder / name).is_file():
            shutil.copy(tokenizer_folder / name, folder / name)
    return folder


# ---- texts the tests and the check share ---------------------------------------

TEXTS = [
    "Hello, world!",
    "a",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY name LIMIT 10;",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "import numpy as np\nx = np.linspace(0, 1, 101)\nprint(x.mean())",
    "Größenverhältnisse der Straße in München: ÄÖÜ äöü ß",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "東京は日本の首都です。人口は約1400万人です。",
    "北京欢迎你，上海也欢迎你。",
    "Привет, как дела? Всё хорошо, спасибо.",
    "مرحبا بالعالم",
    "🎉🚀 emoji test 😀 with text 👍🏽",
    "3.14159 2.71828 1.41421 6.02214076e23 -273.15",
    "Order #12345 shipped on 2023-11-05 at 14:32 UTC; total $1,299.99.",
    "0x7fff_ffff 0b1010 0o755 1e-9",
    "   leading and trailing spaces   ",
    "TAB\tSEPARATED\tVALUES\nNEW\tLINE",
    "MiXeD CaSe WoRdS and ALLCAPS",
    "https://example.com/path?query=value&other=1#fragment",
    "user@example.com wrote: <b>bold</b> & <i>italic</i>",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "Machine learning models map inputs to outputs by learning from data. " * 4,
    "A sentence of moderate length that talks about embeddings, retrieval and search over code.",
    " ".join(f"word{i}" for i in range(60)),
    "naïve café résumé coöperate façade jalapeño",
    "The mitochondria is the powerhouse of the cell. " * 30,  # past 256 tokens: truncated
    "def f(x):\n" + "    x = x + 1\n" * 120,  # past 256 tokens: truncated
]

QUERY = "How do I sort a list in Python?"
DOCUMENTS = [
    "Use sorted(xs) for a new list or xs.sort() to sort in place.",
    "The Eiffel Tower is in Paris.",
    "Python lists have a sort method that takes a key function.",
    "Bananas are rich in potassium.",
    "Quicksort is a divide and conquer algorithm.",
    "",
    "東京は日本の首都です。",
    "SELECT * FROM t ORDER BY x;",
]


# ---- the check against sentence-transformers (outside CI) ---------------------

_ST_SCRIPT = r"""
import json, sys
import numpy as np
from sentence_transformers import CrossEncoder, SentenceTransformer
import sentence_transformers, torch
args = json.loads(sys.stdin.read())
st = SentenceTransformer(args["encoder"], device="cpu")
emb = st.encode(args["texts"], convert_to_numpy=True, normalize_embeddings=False).astype("float64")
ce = CrossEncoder(args["cross_encoder"], device="cpu")
scores = ce.predict([(args["query"], d) for d in args["documents"]])
print(json.dumps({"embeddings": emb.tolist(), "scores": np.asarray(scores, dtype="float64").tolist(),
                  "versions": [sentence_transformers.__version__, torch.__version__],
                  "max_seq_length": st.max_seq_length}))
"""


def check(encoder: Path, python: str) -> dict:
    """This reference against sentence-transformers, run by `python` in a subprocess."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cross = build_cross_encoder(Path(tmp) / "cross", encoder)
        payload = {"encoder": str(encoder), "cross_encoder": str(cross), "texts": TEXTS, "query": QUERY,
                   "documents": DOCUMENTS}
        done = subprocess.run([python, "-c", _ST_SCRIPT], input=json.dumps(payload), capture_output=True,
                              text=True, check=True)
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
        ours = BertReference(encoder).embed(TEXTS, truncate=True)
        mine = np.asarray(theirs["embeddings"])
        cos = (ours * mine).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(mine, axis=1)
        scores = BertReference(cross).rerank(QUERY, DOCUMENTS)
        return {"versions": theirs["versions"], "max_seq_length": theirs["max_seq_length"],
                "max_abs_cos_minus_1": float(np.abs(cos - 1).max()),
                "max_norm_diff": float(np.abs(np.linalg.norm(mine, axis=1) - 1).max()),
                "max_abs_elem_diff": float(np.abs(ours - mine).max()),
                "rerank_max_abs_diff": float(np.abs(scores - np.asarray(theirs["scores"])).max()),
                "scores": scores.round(4).tolist(), "their_scores": np.round(theirs["scores"], 4).tolist(),
                "tokens": [len(BertReference(encoder).tokenize(t, truncate=True)[0]) for t in TEXTS]}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with sentence-transformers")
    parser.add_argument("--python", default="/tmp/st-venv/bin/python",
                        help="a python that has sentence-transformers and torch")
    parser.add_argument("--model", type=Path, default=Path.home() / ".tierlm/models/all-MiniLM-L6-v2")
    args = parser.parse_args()
    if args.check:
        print(json.dumps(check(args.model, args.python), indent=1))
