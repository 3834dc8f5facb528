"""Attention of a few queries over KV kept at 8 or 4 bits, as one CUDA kernel.

A decode step (and a verification of drafts) over the running batch's
quantized KV (`batch_kv_bits`, engine.quantized_kv) ran as two products in
backends.gpu: the scores over the keys dequantized into a new 16-bit array
(MLX 0.32.4's CUDA product of stacked quantized matrices, transposed, returns
wrong scores), the weights times the values quantized. Every step wrote and
read the whole context's keys at 16 bits besides reading them at 8, and the
scores besides: slower than 16-bit KV, whose attention reads its keys once.

Here each thread block reads one KV head's keys and values of one sequence
once, at their bits, and serves every query head of its group: a warp takes
32 keys at a time, a key a lane (each lane's dot products with every query
head, the queries in shared memory), keeps one running softmax (maximum,
sum, weighted values) in float32 a query head, and sums the 32 keys' values
into the answer, each lane its share of the vector. (A key a warp, its
lanes splitting the vector, left each key waiting on memory and on five
shuffles a query head: 0.9 ms a layer at batch 32 over 8k keys on an H100.)
The keys after the cache's quantized ones (a decode step's tokens, kept at
16 bits until a tail of them is quantized together: engine.quantized_kv)
are read as they are, and the quantized keys are multiplied by the factors
they are kept divided by (engine.key_scaling). A block takes one of `splits`
spans of the keys; the spans' partial sums are joined after (a long context
of one sequence still fills the GPU); with one span the kernel writes the
answer itself.

A small model's decode step at a large batch waits on the host, a few
microseconds an operation, not on the GPU: so the kernel reads mlx-lm's mask
as it is (made once a step for every layer), and the scale, the factors and
the tail's start from arrays made once.

MLX compiles the kernel once per (bits, head width, group) with NVRTC
(`mx.fast.cuda_kernel`); shapes are arguments, so no length builds anything.
"""

from __future__ import annotations

import math

import mlx.core as mx

WARPS = 8  # warps a block: each takes every WARPS-th key of its span
TARGET_WARPS = 8192  # warps a call aims for (an H100 keeps 64 an SM, 132 SMs)
MIN_SPAN = 2048  # keys a split takes at least
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
    const int kv_heads = kw_shape[1], span = kw_shape[2], tail_span = tk_shape[2];
    const int length = q_shape[2];
    const int width = mask_shape[3];             // the keys: the mask's, up to the batch's end
    const int kv_head = blockIdx.y / length, row = blockIdx.y % length;
    const int b = blockIdx.z;
    const int heads = kv_heads * G;
    const int quantized = HAS_TAIL ? min(start[0], width) : width;  // keys before the 16-bit tail

    const int per_split = (width + splits - 1) / splits;
    const int first = split * per_split;
    const int last = min(width, first + per_split);

    const int d0 = lane * VPT;                   // the values of an answer a lane keeps
    const int word = d0 * BITS / 32, shift = d0 * BITS % 32, group = d0 / GROUP_SIZE;

    // the queries (times the scale) and the keys' factors, for every lane's dot products
    __shared__ float q_s[G][D], f_s[D];
    for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
        const int g = e / D, d = e % D;
        q_s[g][d] = scale[0] * static_cast<float>(q[(((size_t)b * heads + kv_head * G + g) * length + row) * D + d]);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        f_s[d] = HAS_FACTORS ? static_cast<float>(factors[kv_head * D + d]) : 1.f;
    __syncthreads();

    float acc[G][VPT], top[G], total[G];
    for (int g = 0; g < G; g++) {
        for (int i = 0; i < VPT; i++) acc[g][i] = 0.f;
        top[g] = NEG_INF;
        total[g] = 0.f;
    }

    const size_t rows = ((size_t)b * kv_heads + kv_head) * span;
    const size_t tail_rows = ((size_t)b * kv_heads + kv_head) * tail_span;
    const int mask_rows = mask_shape[2];
    const bool* visible = mask + ((size_t)(mask_shape[0] == 1 ? 0 : b) * mask_rows + (mask_rows == 1 ? 0 : row)) * width;
    // a warp takes 32 keys at a time, a key a lane: each lane's dot products
    // with every query head, one running softmax a warp, then the 32 keys'
    // values summed into the answer, each lane its VPT values of it
    for (int base = first + warp * 32; base < last; base += WARPS * 32) {
        const int j = base + lane;
        const bool seen = j < last && visible[j];
        float dot[G];
        for (int g = 0; g < G; g++) dot[g] = 0.f;
        if (seen && j < quantized) {
            const uint4* words = reinterpret_cast<const uint4*>(kw + (rows + j) * WORDS);
            for (int w4 = 0; w4 < WORDS / 4; w4++) {
                const uint4 four = words[w4];
                const unsigned packed[4] = {four.x, four.y, four.z, four.w};
                for (int k = 0; k < 4; k++) {
                    const int d_first = (w4 * 4 + k) * (32 / BITS);
                    const size_t at = (rows + j) * GROUPS + d_first / GROUP_SIZE;
                    const float kscale = static_cast<float>(ks[at]), kbias = static_cast<float>(kb[at]);
                    for (int i = 0; i < 32 / BITS; i++) {
                        const int d = d_first + i;
                        const float key = (kscale * static_cast<float>((packed[k] >> (i * BITS)) & LEVELS) + kbias) * f_s[d];
                        for (int g = 0; g < G; g++) dot[g] += q_s[g][d] * key;
                    }
                }
            }
        } else if (seen) {                         // a decode step's token, not yet quantized
            const size_t t = (tail_rows + (j - quantized)) * D;
            for (int d = 0; d < D; d++) {
                const float key = static_cast<float>(tk[t + d]);
                for (int g = 0; g < G; g++) dot[g] += q_s[g][d] * key;
            }
        }
        float weight[G];
        for (int g = 0; g < G; g++) {
            float high = seen ? dot[g] : NEG_INF;
            for (int o = 16; o > 0; o /= 2) high = fmaxf(high, __shfl_xor_sync(0xffffffffu, high, o));
            high = fmaxf(high, top[g]);
            weight[g] = seen ? __expf(dot[g] - high) : 0.f;
            float sum = weight[g];
            for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            const float fade = top[g] == NEG_INF ? 0.f : __expf(top[g] - high);
            total[g] = total[g] * fade + sum;
            for (int i = 0; i < VPT; i++) acc[g][i] *= fade;
            top[g] = high;
        }
        const int keys = min(32, last - base);
        for (int k = 0; k < keys; k++) {
            const int jk = base + k;
            float w[G];
            for (int g = 0; g < G; g++) w[g] = __shfl_sync(0xffffffffu, weight[g], k);
            float value[VPT];
            if (jk < quantized) {
                const size_t r = rows + jk;
                const unsigned packed = vw[r * WORDS + word];
                const float vscale = static_cast<float>(vs[r * GROUPS + group]), vbias = static_cast<float>(vb[r * GROUPS + group]);
                for (int i = 0; i < VPT; i++) value[i] = vscale * static_cast<float>((packed >> (shift + i * BITS)) & LEVELS) + vbias;
            } else {
                const size_t t = (tail_rows + (jk - quantized)) * D + d0;
                for (int i = 0; i < VPT; i++) value[i] = static_cast<float>(tv[t + i]);
            }
            for (int g = 0; g < G; g++)
                for (int i = 0; i < VPT; i++) acc[g][i] += w[g] * value[i];
        }
    }

    // join the block's warps: one (maximum, sum, weighted values) a query head
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
            const size_t at = ((size_t)b * heads + kv_head * G + g) * length + row;
            WRITE
        }
        __syncthreads();
    }
"""
# one split: the answer, in the queries' type; several: each split's partial sums, joined after
_WRITE_ANSWER = "out[at * D + t] = static_cast<T>(value / fmaxf(sum, 1e-30f));"
_WRITE_PARTS = """part_acc[(at * splits + split) * D + t] = value;
            if (t == 0) { part_top[at * splits + split] = high; part_total[at * splits + split] = sum; }"""

_kernels: dict[bool, object] = {}  # whole (one split) or not -> the kernel
_constants: dict[tuple, mx.array] = {}  # small arrays the kernel reads, made once


def _compiled(whole: bool):
    if whole not in _kernels:
        _kernels[whole] = mx.fast.cuda_kernel(
            name="tierlm_quantized_kv_attention" + ("_whole" if whole else "_split"),
            input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", "tk", "tv", "start", "mask", "factors", "scale"],
            output_names=["out"] if whole else ["part_top", "part_total", "part_acc"],
            source=_SOURCE.replace("WRITE", _WRITE_ANSWER if whole else _WRITE_PARTS),
        )
    return _kernels[whole]


def constant(key: tuple, make) -> mx.array:
    """`make()`, evaluated once per key: a step's layers read the same one (an
    array made per call was an upload a layer)."""
    if key not in _constants:
        _constants[key] = make()
        mx.eval(_constants[key])  # now: a lazy array belongs to the stream of the thread that made it
    return _constants[key]


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


def attention(queries: mx.array, keys: tuple, values: tuple, scale: float, mask: mx.array, bits: int,
              tail: tuple | None = None, factors: mx.array | None = None) -> mx.array:
    """softmax(q kᵀ · scale, hidden where `mask` is False) v for (B, heads, L, D)
    queries over the keys the boolean `mask` (B or 1, 1, L or 1, S) spans:
    positions up to `tail`'s start read from `keys` and `values`, quantized
    (MLX's (values, scales, biases), (B, kv_heads, at least that many, ...)),
    the rest from `tail` (16-bit keys and values (B, kv_heads, n, D) and, an
    int32 array of one element, the position of their first). `factors`
    (1, kv_heads, 1, D): what the quantized keys are kept divided by."""
    batch, heads, length, width = queries.shape
    kv_heads, span = keys[0].shape[1], mask.shape[-1]
    splits = _splits(batch * kv_heads * length, span)
    none = constant(("none", queries.dtype, width), lambda: mx.zeros((1, 1, 1, width), queries.dtype))
    tail_keys, tail_values, start = tail or (none, none, constant(("start",), lambda: mx.zeros((1,), mx.int32)))
    inputs = [queries, *keys, *values, tail_keys, tail_values, start, mask,
              constant(("ones",), lambda: mx.ones((1,))) if factors is None else factors,
              constant(("scale", scale), lambda: mx.array([scale], dtype=mx.float32))]
    template = [("BITS", bits), ("D", width), ("G", heads // kv_heads), ("GROUP_SIZE", GROUP), ("WARPS", WARPS),
                ("HAS_TAIL", tail is not None), ("HAS_FACTORS", factors is not None)]
    grid, threads = (32 * WARPS * splits, kv_heads * length, batch), (32 * WARPS, 1, 1)
    if splits == 1:
        (out,) = _compiled(True)(inputs=inputs, output_shapes=[queries.shape], output_dtypes=[queries.dtype],
                                 grid=grid, threadgroup=threads, template=template + [("T", queries.dtype)])
        return out
    parts = (batch, heads, length, splits)
    top, total, acc = _compiled(False)(inputs=inputs, output_shapes=[parts, parts, (*parts, width)],
                                       output_dtypes=[mx.float32] * 3, grid=grid, threadgroup=threads,
                                       template=template)
    return _joined(top, total, acc).astype(queries.dtype)


def _splits(blocks: int, span: int) -> int:
    """Spans of the keys a (sequence, KV head, query) is cut into: enough
    blocks to fill the GPU, none shorter than MIN_SPAN keys. One split is one
    operation; more add the join's, and where the keys are few a batch's
    decode step waits on the host's time per operation, not on the GPU."""
    wanted = math.ceil(TARGET_WARPS / (blocks * WARPS))
    return max(1, min(wanted, span // MIN_SPAN))


def _joined(top: mx.array, total: mx.array, acc: mx.array) -> mx.array:
    """The splits' partial softmax sums joined: each scaled to the highest
    score of all (a split that saw no key weighs nothing)."""
    high = top.max(axis=-1, keepdims=True)
    fade = mx.where(top == -mx.inf, 0.0, mx.exp(top - high))
    value = (acc * fade[..., None]).sum(axis=-2)
    return value / mx.maximum((total * fade).sum(axis=-1, keepdims=True), 1e-30)
