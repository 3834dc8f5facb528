"""Refuse a prefill that would not fit, instead of letting the process die.

The estimate is deliberately simple and a little pessimistic:
  weights + KV of the prompt + attention/MLP scratch of one prefill chunk
  + the KV of every token the request may generate (its max_tokens),
on top of what the other running requests hold and may still grow into. A
request that fits alone but not beside the others waits for them to finish.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from tierlm.backends import describe
from tierlm.engine.half_kv import batch_slots
from tierlm.engine.request import MemoryGuardError

_FP32 = 4


@dataclass
class ModelProfile:
    """Sizes of one loaded model that drive the memory estimate."""

    weight_bytes: int  # MLX's arrays plus native_bytes
    kv_bytes_per_token: int
    fixed_cache_bytes: int  # recurrent / sliding-window state that does not grow
    num_heads: int
    hidden_size: int
    intermediate_size: int
    native_bytes: int = 0  # held outside MLX's allocator: what the backend adds (tierlm.backends)
    tail_bytes: int = 0  # a decoding sequence's 16-bit tail beside its quantized KV (engine.quantized_kv)


def _arg(model, *names: str, default: int = 0) -> int:
    args = getattr(model, "args", None)
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, int):
            return value
    return default


def profile_model(model, kv_bits: int = 16, kv_tail: int = 0, kv_half: bool = False) -> ModelProfile:
    """Measure the model on its own worker thread: one token through a fresh
    cache (its attention KV quantized where the batch keeps it at `kv_bits`,
    besides up to `kv_tail` decode steps at 16 bits; at float16 where
    `kv_half`: engine.half_kv)."""
    from mlx.utils import tree_flatten

    native_bytes = describe(model).extra_bytes
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters())) + native_bytes
    per_token, fixed = _kv_bytes(model, kv_bits, kv_half)
    tail_bytes = _kv_bytes(model, 16)[0] * kv_tail if kv_bits != 16 and kv_tail else 0
    hidden = _arg(model, "hidden_size", "d_model", default=4096)
    return ModelProfile(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=per_token,
        fixed_cache_bytes=fixed,
        num_heads=_arg(model, "num_attention_heads", "n_heads", default=32),
        hidden_size=hidden,
        intermediate_size=_arg(model, "intermediate_size", default=4 * hidden),
        native_bytes=native_bytes,
        tail_bytes=tail_bytes,
    )


def _kv_bytes(model, kv_bits: int, kv_half: bool = False) -> tuple[int, int]:
    """The KV bytes a token adds, and those of state that does not grow."""
    cache = batch_slots(make_prompt_cache(model), kv_bits, kv_half)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    per_token, fixed = 0, 0
    for c in cache:
        keys = getattr(c, "keys", None)
        if keys is not None and getattr(c, "max_size", None) is None:
            allocated = (keys[0] if isinstance(keys, tuple) else keys).shape[2]  # a length, not the offset
            per_token += c.nbytes // allocated
        else:
            fixed += c.nbytes
    return per_token, fixed


def default_memory_limit() -> int:
    """What MLX may use on this device, minus a margin for the rest of the process."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key] * 0.9)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)


class MemoryGuard:
    def __init__(self, profile: ModelProfile, limit: int, prefill_step: int, stores_blocks: bool = False):
        """`stores_blocks`: the prefix cache copies a request's KV when it stores its
        blocks (the whole cache taken out of the batch, then each block), beside
        the KV itself: twice its KV more, for a moment (measured: a 60 MB limit
        peaked at 87 MB without this, 45 MB with no prefix cache)."""
        self.profile, self.limit, self.prefill_step = profile, limit, prefill_step
        self.kv_copies = 3 if stores_blocks else 1

    def prefill_bytes(self, prompt_tokens: int) -> int:
        """KV of the prompt plus the peak scratch of its largest prefill chunk."""
        p = self.profile
        chunk = min(prompt_tokens, self.prefill_step)
        scores = chunk * prompt_tokens * p.num_heads * _FP32
        activations = chunk * (4 * p.hidden_size + 3 * p.intermediate_size) * _FP32
        return p.kv_bytes_per_token * prompt_tokens + p.fixed_cache_bytes + scores + activations

    def decode_bytes(self, tokens: int) -> int:
        """The KV that `tokens` more generated tokens will add (and the 16-bit
        tail a decoding sequence holds where the batch keeps KV quantized)."""
        tail = self.profile.tail_bytes if tokens > 0 else 0
        return self.profile.kv_bytes_per_token * max(0, tokens) + tail

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """All a request may come to hold: its prefill, every token it may generate,
        and the copies made to store its blocks."""
        extra_copies = (self.kv_copies - 1) * self.profile.kv_bytes_per_token * (prompt_tokens + max_tokens)
        return self.prefill_bytes(prompt_tokens) + self.decode_bytes(max_tokens) + extra_copies

    def check_alone(self, prompt_tokens: int, max_tokens: int = 0) -> None:
        """Raise if this request cannot fit even with nothing else running."""
        needed = self.profile.weight_bytes + self.request_bytes(prompt_tokens, max_tokens)
        if needed > self.limit:
            raise MemoryGuardError(needed, self.limit, prompt_tokens, max_tokens)

    def shortfall(self, request_bytes: int, pending_bytes: int = 0) -> int:
        """Bytes missing for a request of `request_bytes` beside what is held now
        (running requests, cached blocks) plus `pending_bytes`: what running
        requests may still grow into, and what requests admitted in this same step
        were promised; 0 when it fits."""
        held = mx.get_active_memory() + self.profile.native_bytes
        in_use = max(held, self.profile.weight_bytes) + pending_bytes
        return max(0, in_use + request_bytes - self.limit)
