"""Encoder models: BERT-family embedding models (sentence-transformers folders)
and cross-encoders for rerank, in MLX.

mlx-lm has no encoders, and the MLX embedding library other servers use is
GPL-licensed; a BERT encoder is small enough to write here. A folder is read
as sentence-transformers writes it: config.json (model_type "bert"),
model.safetensors with Hugging Face's names, tokenizer.json, modules.json (a
Pooling module with its 1_Pooling/config.json, and a Normalize module or not),
sentence_bert_config.json (max_seq_length). A cross-encoder is the same
encoder under `bert.` with a pooler and a classifier (architectures
["BertForSequenceClassification"]); its score is the classifier's logit
through a sigmoid, as sentence-transformers' CrossEncoder scores one label.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import Tokenizer

from tierlm.backends.cpu.kernels import attention as cpu_attention
from tierlm.backends.cpu.kernels import gelu_erf
from tierlm.models.model_folder import CHAT, EMBEDDING, RERANK, max_seq_length, model_kind

log = logging.getLogger(__name__)

# ---- the network ----------------------------------------------------------------------


@dataclass
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    num_labels: int = 1

    @classmethod
    def read(cls, config: dict) -> BertConfig:
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {config.get('hidden_act')!r}: only BERT's exact GELU is supported")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        labels = config.get("num_labels") or len(config.get("id2label") or {}) or 1
        names = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "max_position_embeddings", "type_vocab_size", "layer_norm_eps")
        return cls(**{n: config[n] for n in names if n in config}, num_labels=labels)


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, ids: mx.array, types: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None]
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(types)
        return self.LayerNorm(x)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape

        def split(t):
            return t.reshape(b, n, self.heads, d // self.heads).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scale = 1 / math.sqrt(d // self.heads)
        if x.dtype == mx.float32 and mx.default_device() == mx.cpu:  # MLX's CPU softmax is scalar
            out = cpu_attention(q, k, v, scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(b, n, d)


class _Dense(nn.Module):
    """A dense layer, then a residual LayerNorm: BERT's attention.output and output."""

    def __init__(self, c: BertConfig, inputs: int):
        super().__init__()
        self.dense = nn.Linear(inputs, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class _AttentionBlock(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        setattr(self, "self", _Attention(c))  # Hugging Face's name: attention.self.query
        self.output = _Dense(c, c.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(getattr(self, "self")(x, mask), x)


class _Intermediate(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        return _gelu(self.dense(x))


def _gelu(x: mx.array) -> mx.array:
    """The exact (erf) GELU, as BERT's "gelu": on the CPU in float32 through
    numpy's vector units, as MLX's CPU erf is scalar."""
    if x.dtype == mx.float32 and mx.default_device() == mx.cpu:
        return gelu_erf(x)
    return nn.gelu(x)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = _AttentionBlock(c)
        self.intermediate = _Intermediate(c)
        self.output = _Dense(c, c.intermediate_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.layer = [_Layer(c) for _ in range(c.num_hidden_layers)]


class _Pooler(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.tanh(self.dense(x[:, 0]))


class Bert(nn.Module):
    """BertModel under Hugging Face's weight names; with `pooler` for a cross-encoder."""

    def __init__(self, c: BertConfig, pooler: bool = False):
        super().__init__()
        self.embeddings = _Embeddings(c)
        self.encoder = _Encoder(c)
        if pooler:
            self.pooler = _Pooler(c)

    def __call__(self, ids: mx.array, types: mx.array, lengths: mx.array) -> mx.array:
        """Hidden states of a right-padded batch; `lengths`: each row's tokens."""
        width = ids.shape[1]
        valid = mx.arange(width)[None] < lengths[:, None]
        # padding is never attended to: one row of keys per sequence, as each query sees it
        mask = mx.broadcast_to(valid[:, None, None, :], (ids.shape[0], 1, width, width))
        x = self.embeddings(ids, types)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


class CrossEncoder(nn.Module):
    """BertForSequenceClassification: the encoder under `bert.`, the classifier."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.bert = Bert(c, pooler=True)
        self.classifier = nn.Linear(c.hidden_size, c.num_labels)

    def __call__(self, ids: mx.array, types: mx.array, lengths: mx.array) -> mx.array:
        return self.classifier(self.bert.pooler(self.bert(ids, types, lengths)))


# ---- a folder, loaded -------------------------------------------------------------------


@dataclass
class Pooling:
    mode: str  # "mean", "cls" or "max"
    normalize: bool


class Encoder:
    """A loaded encoder: its tokenizer, network and pooling. Call it from one
    thread (the MLX calls run on the caller's stream)."""

    def __init__(self, path: Path, kind: str, config: BertConfig, network: nn.Module, tokenizer: Tokenizer,
                 pooling: Pooling | None, max_tokens: int):
        self.path, self.kind, self.config, self.network = path, kind, config, network
        self.tokenizer, self.pooling, self.max_tokens = tokenizer, pooling, max_tokens
        self.dimensions = config.hidden_size

    # ---- tokens ---------------------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, [CLS] and [SEP] included, not truncated."""
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def tokenize_pairs(self, query: str, documents: list[str]) -> list[tuple[list[int], list[int]]]:
        """(ids, token type ids) of [CLS] query [SEP] document [SEP], per
        document, each cut to max_tokens (at its end, keeping the last [SEP])."""
        pairs = self.tokenizer.encode_batch([(query, d) for d in documents])
        return [(self.truncate(e.ids), self.truncate(e.type_ids)) for e in pairs]

    def truncate(self, ids: list[int], limit: int | None = None) -> list[int]:
        """`ids` cut to `limit` tokens (at most max_tokens), keeping the last one
        (the closing [SEP])."""
        limit = min(limit or self.max_tokens, self.max_tokens)
        return ids if len(ids) <= limit else ids[: limit - 1] + ids[-1:]

    # ---- forward passes ------------------------------------------------------------

    def embed_ids(self, sequences: list[list[int]]) -> np.ndarray:
        """Embeddings (n, dimensions) of token-id sequences, each at most
        max_tokens, in their order (computed in length-sorted batches)."""
        return _in_batches([(s, [0] * len(s)) for s in sequences], self._embed_batch)

    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> np.ndarray:
        """Relevance scores of (ids, type ids) pairs: the first label's logit,
        through a sigmoid."""
        return _in_batches(pairs, self._score_batch)

    def _embed_batch(self, ids: mx.array, types: mx.array, lengths: mx.array) -> mx.array:
        hidden = self.network(ids, types, lengths)
        valid = (mx.arange(ids.shape[1])[None] < lengths[:, None])[..., None]
        if self.pooling.mode == "cls":
            pooled = hidden[:, 0]
        elif self.pooling.mode == "max":
            pooled = mx.where(valid, hidden, -mx.inf).max(axis=1)
        else:
            pooled = (hidden * valid).sum(axis=1) / lengths[:, None].astype(hidden.dtype)
        if self.pooling.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled

    def _score_batch(self, ids: mx.array, types: mx.array, lengths: mx.array) -> mx.array:
        return mx.sigmoid(self.network(ids, types, lengths)[:, 0])

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.embed_ids([self.truncate(ids) for ids in self.tokenize(texts)])

    def rerank(self, query: str, documents: list[str]) -> np.ndarray:
        return self.score_pairs(self.tokenize_pairs(query, documents))


# A batch's size, in padded tokens, and rows: on the CPU small batches of like
# lengths (attention grows with the square of the longest; batches of 8 of
# ~100 tokens ran 2x faster a text than one of 64 padded to 194 here); on a GPU
# large ones, with attention's scores kept to ~200 MB at 12 heads.
CPU_BATCH_TOKENS = 1024
GPU_BATCH_ROWS, GPU_ATTENTION = 256, 1 << 22


def _in_batches(items: list[tuple[list[int], list[int]]], run) -> np.ndarray:
    """`run(ids, types, lengths)` over length-sorted, right-padded batches of
    (ids, type ids) items; the rows back in the items' order."""
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    out: list[np.ndarray | None] = [None] * len(items)
    for batch in _batches(order, [len(ids) for ids, _ in items]):
        rows = np.array(run(*_padded([items[i] for i in batch])).astype(mx.float32))
        for i, row in zip(batch, rows):
            out[i] = row
    return np.stack(out)


def _batches(order: list[int], lengths: list[int]) -> list[list[int]]:
    """`order` (indices, shortest first) cut into batches within the device's bounds."""
    cpu = mx.default_device() == mx.cpu
    batches, current = [], []
    for i in order:
        rows, width = len(current) + 1, lengths[i]  # the longest so far: sorted
        full = rows * width > CPU_BATCH_TOKENS if cpu else \
            rows > GPU_BATCH_ROWS or rows * width * width > GPU_ATTENTION
        if current and full:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def _padded(batch: list[tuple[list[int], list[int]]]) -> tuple[mx.array, mx.array, mx.array]:
    """A right-padded batch: ids, token types and lengths."""
    width = max(len(ids) for ids, _ in batch)
    ids = np.zeros((len(batch), width), np.int32)
    types = np.zeros((len(batch), width), np.int32)
    for row, (seq, kinds) in enumerate(batch):
        ids[row, : len(seq)], types[row, : len(kinds)] = seq, kinds
    return mx.array(ids), mx.array(types), mx.array([len(s) for s, _ in batch])


def load_encoder(path: Path | str, cpu_weights_dtype: str = "auto", memory_bytes: int | None = None,
                 use_cpu_kernels: bool = True, use_amx: bool = True) -> Encoder:
    """The encoder in a sentence-transformers or cross-encoder folder, with what
    the device's backend adds (on MLX's CPU backend its BLAS route: MLX's own
    CPU matmul is a reference one; the `cpu_*` settings as for a chat model).
    A folder that is not one is a ValueError saying why."""
    from tierlm import backends
    from tierlm.config import total_memory

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    kind = model_kind(config)
    if kind == CHAT:
        raise ValueError(f"{path}: not a BERT encoder (model_type {config.get('model_type')!r})")
    c = BertConfig.read(config)
    network = CrossEncoder(c) if kind == RERANK else Bert(c)
    weights = _weights(path, kind)
    network.load_weights(list(weights.items()), strict=True)
    backend = backends.prepare(network, cpu_weights_dtype=cpu_weights_dtype,
                               memory_bytes=memory_bytes or total_memory(), cpu_kernels=use_cpu_kernels,
                               cpu_amx=use_amx)
    for line in backend.warnings:
        log.warning("%s", line)
    mx.eval(network.parameters())
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_padding()  # the folder's own padding and truncation are for training; batches are ours
    tokenizer.no_truncation()
    pooling = _pooling(path) if kind == EMBEDDING else None
    return Encoder(path, kind, c, network, tokenizer, pooling, _max_tokens(path, c))


def _weights(path: Path, kind: str) -> dict[str, mx.array]:
    """The folder's weights under this module's names: sentence-transformers
    sometimes saves the encoder under `bert.` (dropped for an embedding model),
    older checkpoints name LayerNorm's weight and bias gamma and beta; an
    embedding model's unused pooler is left out."""
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    out = {}
    for name, value in weights.items():
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if kind == EMBEDDING:
            name = name.removeprefix("bert.")
            if name.startswith("pooler.") or name.endswith("position_ids"):
                continue
        elif name.endswith("position_ids"):
            continue
        out[name] = value
    return out


def _pooling(path: Path) -> Pooling:
    modules = path / "modules.json"
    listed = json.loads(modules.read_text()) if modules.is_file() else []
    normalize = any(m.get("type", "").endswith("Normalize") for m in listed)
    pooling_dir = next((path / m["path"] for m in listed if m.get("type", "").endswith("Pooling")),
                       path / "1_Pooling")
    config = json.loads((pooling_dir / "config.json").read_text()) if (pooling_dir / "config.json").is_file() else {}
    if config.get("pooling_mode_cls_token"):
        mode = "cls"
    elif config.get("pooling_mode_max_tokens"):
        mode = "max"
    else:
        mode = "mean"  # sentence-transformers' default
    return Pooling(mode, normalize)


def _max_tokens(path: Path, c: BertConfig) -> int:
    """What sentence-transformers truncates to (max_seq_length), else the positions."""
    return min(max_seq_length(path) or c.max_position_embeddings, c.max_position_embeddings)
