"""Attention of a few queries over KV kept at 8 or 4 bits, as one CUDA kernel.

A decode step (and a verification of drafts) over the running batch's
quantized KV (`batch_kv_bits`, engine.quantized_kv) ran as two products in
backends.gpu: the scores over the keys dequantized into a new 16-bit array
(MLX 0.32.4's CUDA product of stacked quantized matrices, transposed, returns
wrong scores), the weights times the values quantized. Every step wrote and
read the whole context's keys at 16 bits besides reading them at 8, and the
scores besides: slower than 16-bit KV, whose attention reads its keys once.

Here each thread block reads one KV head's keys and values of one sequence
once, at their bits, and serves every query head of its group: each lane of a
warp dequantizes its share of a key's vector, the warp sums the dot products,
and each query head keeps a running softmax (maximum, sum, weighted values) in
float32. A block takes one of `splits` spans of the keys; the spans' partial
sums are joined after (a long context of one sequence still fills the GPU).

MLX compiles the kernel once per (bits, head width, group) with NVRTC
(`mx.fast.cuda_kernel`); shapes are arguments, so no length builds anything.
"""

from __future__ import annotations

import math

import mlx.core as mx

WARPS = 8  # warps a block: each takes every WARPS-th key of its span
TARGET_WARPS = 8192  # warps a call aims for (an H100 keeps 64 an SM, 132 SMs)
MIN_SPAN = 256  # keys a split takes at least
MAX_QUERIES = 32  # queries a sequence feeds at most (decode, verification of drafts)
GROUP = 64  # values per scale and bias (engine.quantized_kv.GROUP)

_SOURCE = """
    constexpr int VPT = D / 32;                  // a lane's values of a vector
    constexpr int WORDS = D * BITS / 32;         // uint32 words a quantized vector
    constexpr int GROUPS = D / GROUP_SIZE;       // scales (and biases) a vector
    constexpr unsigned LEVELS = (1u << BITS) - 1u;
    const float NEG_INF = __int_as_float(0xff800000);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int splits = gridDim.x, split = blockIdx.x;
    const int kv_heads = kw_shape[1], span = kw_shape[2];
    const int length = q_shape[2];
    const int kv_head = blockIdx.y / length, row = blockIdx.y % length;
    const int b = blockIdx.z;
    const int heads = kv_heads * G;

    const int per_split = (span + splits - 1) / splits;
    const int first = split * per_split;
    const int last = min(span, first + per_split);

    const int d0 = lane * VPT;
    const int word = d0 * BITS / 32, shift = d0 * BITS % 32, group = d0 / GROUP_SIZE;
    const float sc = scale[0];

    float qv[G][VPT], acc[G][VPT], top[G], total[G];
    for (int g = 0; g < G; g++) {
        const size_t at = (((size_t)b * heads + kv_head * G + g) * length + row) * D + d0;
        for (int i = 0; i < VPT; i++) { qv[g][i] = sc * static_cast<float>(q[at + i]); acc[g][i] = 0.f; }
        top[g] = NEG_INF;
        total[g] = 0.f;
    }

    const size_t rows = ((size_t)b * kv_heads + kv_head) * span;
    const bool* visible = mask + ((size_t)b * length + row) * span;
    for (int j = first + warp; j < last; j += WARPS) {
        if (!visible[j]) continue;                 // the same key for the whole warp
        const size_t r = rows + j;
        const unsigned kword = kw[r * WORDS + word], vword = vw[r * WORDS + word];
        const float kscale = static_cast<float>(ks[r * GROUPS + group]), kbias = static_cast<float>(kb[r * GROUPS + group]);
        const float vscale = static_cast<float>(vs[r * GROUPS + group]), vbias = static_cast<float>(vb[r * GROUPS + group]);
        float kv[VPT], vv[VPT];
        for (int i = 0; i < VPT; i++) {
            kv[i] = kscale * static_cast<float>((kword >> (shift + i * BITS)) & LEVELS) + kbias;
            vv[i] = vscale * static_cast<float>((vword >> (shift + i * BITS)) & LEVELS) + vbias;
        }
        for (int g = 0; g < G; g++) {
            float score = 0.f;
            for (int i = 0; i < VPT; i++) score += qv[g][i] * kv[i];
            for (int o = 16; o > 0; o /= 2) score += __shfl_xor_sync(0xffffffffu, score, o);
            const float high = fmaxf(top[g], score);
            const float fade = __expf(top[g] - high), weight = __expf(score - high);
            total[g] = total[g] * fade + weight;
            for (int i = 0; i < VPT; i++) acc[g][i] = acc[g][i] * fade + weight * vv[i];
            top[g] = high;
        }
    }

    // join the block's warps: one partial (maximum, sum, weighted values) a query head
    __shared__ float w_top[WARPS], w_total[WARPS], w_acc[WARPS][D];
    for (int g = 0; g < G; g++) {
        if (lane == 0) { w_top[warp] = top[g]; w_total[warp] = total[g]; }
        for (int i = 0; i < VPT; i++) w_acc[warp][d0 + i] = acc[g][i];
        __syncthreads();
        for (int t = threadIdx.x; t < D; t += blockDim.x) {
            float high = NEG_INF;
            for (int w = 0; w < WARPS; w++) high = fmaxf(high, w_top[w]);
            float sum = 0.f, value = 0.f;
            for (int w = 0; w < WARPS; w++) {
                const float f = w_top[w] == NEG_INF ? 0.f : __expf(w_top[w] - high);
                sum += w_total[w] * f;
                value += w_acc[w][t] * f;
            }
            const size_t at = (((size_t)b * heads + kv_head * G + g) * length + row) * splits + split;
            part_acc[at * D + t] = value;
            if (t == 0) { part_top[at] = high; part_total[at] = sum; }
        }
        __syncthreads();
    }
"""

_kernel = None


def _compiled():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="tierlm_quantized_kv_attention",
            input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", "mask", "scale"],
            output_names=["part_top", "part_total", "part_acc"],
            source=_SOURCE,
        )
    return _kernel


def usable(queries: mx.array, keys: tuple, bits: int, group_size: int, mask) -> bool:
    """Whether the kernel takes this call: a CUDA GPU, few queries, KV in
    groups of 64 at 8 or 4 bits, a head width of 64 to 256 in steps of 64, up
    to 8 query heads a KV head (what its shared memory holds), and a mask that
    only shows or hides keys."""
    batch, heads, length, width = queries.shape
    kv_heads = keys[0].shape[1]
    return (mx.default_device() != mx.cpu and mx.cuda.is_available()
            and bits in (8, 4) and group_size == GROUP and length <= MAX_QUERIES
            and width % GROUP == 0 and width <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 8
            and (mask is None or isinstance(mask, str)
                 or mask.dtype == mx.bool_ and (mask.ndim < 4 or mask.shape[1] == 1)))


def attention(queries: mx.array, keys: tuple, values: tuple, scale: float, mask, bits: int) -> mx.array:
    """softmax(q kᵀ · scale, hidden where `mask` is False) v for (B, heads, L, D)
    queries and (B, kv_heads, S, ...) quantized keys and values (MLX's
    (values, scales, biases)); `mask` None, "causal" (query i at S - L + i) or
    boolean, broadcastable to (B, 1, L, S)."""
    batch, heads, length, width = queries.shape
    kv_heads, span = keys[0].shape[1:3]
    visible = _visible(mask, batch, length, span)
    splits = _splits(batch * kv_heads * length, span)
    parts = (batch, heads, length, splits)
    top, total, acc = _compiled()(
        inputs=[queries, *keys, *values, visible, mx.array(scale, dtype=mx.float32)],
        output_shapes=[parts, parts, (*parts, width)],
        output_dtypes=[mx.float32] * 3,
        grid=(32 * WARPS * splits, kv_heads * length, batch),
        threadgroup=(32 * WARPS, 1, 1),
        template=[("BITS", bits), ("D", width), ("G", heads // kv_heads), ("GROUP_SIZE", GROUP),
                  ("WARPS", WARPS)],
    )
    return _joined(top, total, acc).astype(queries.dtype)


def _visible(mask, batch: int, length: int, span: int) -> mx.array:
    """The mask as booleans (B, L, S), row-contiguous as the kernel reads it."""
    if mask is None:
        return mx.ones((batch, length, span), dtype=mx.bool_)
    if isinstance(mask, str):
        mask = mx.arange(span)[None] <= mx.arange(span - length, span)[:, None]
    if mask.ndim == 4:
        mask = mask[:, 0]
    return mx.contiguous(mx.broadcast_to(mask, (batch, length, span)))


def _splits(blocks: int, span: int) -> int:
    """Spans of the keys a (sequence, KV head, query) is cut into: enough
    blocks to fill the GPU, none shorter than MIN_SPAN keys."""
    wanted = math.ceil(TARGET_WARPS / (blocks * WARPS))
    return max(1, min(wanted, span // MIN_SPAN))


def _joined(top: mx.array, total: mx.array, acc: mx.array) -> mx.array:
    """The splits' partial softmax sums joined: each scaled to the highest
    score of all (a split that saw no key weighs nothing)."""
    if top.shape[-1] == 1:
        return acc[..., 0, :] / mx.maximum(total, 1e-30)
    high = top.max(axis=-1, keepdims=True)
    fade = mx.where(top == -mx.inf, 0.0, mx.exp(top - high))
    value = (acc * fade[..., None]).sum(axis=-2)
    return value / mx.maximum((total * fade).sum(axis=-1, keepdims=True), 1e-30)
