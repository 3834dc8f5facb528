"""Attention of a prefix-cache hit's remainder on tensor cores, as one CUDA kernel.

An agent's every turn leaves a remainder (the new message: tens to hundreds of
queries) to run over a long cached context. MLX's CUDA backend offers cuDNN,
which builds a graph for each new shape (36-80 ms on an H100, and every turn's
shape is new), or the products of backends.gpu, two cuBLAS matmuls around a
softmax: their scores (heads x queries x keys) are written and read several
times, and cuBLAS looks up a kernel for each new shape (~3 ms each the first
time in a process), and they are ~10 operations a layer where MLX spends
~10 µs of the host's time on each. On an H100 (random Llama-3.2-1B shapes,
40-66 new tokens over 20k), a remainder's pass took 9.4-10.1 ms as products
(20-60 ms the first time at a length) and 3-5 ms with the attention skipped;
8.0-9.2 ms with this kernel (12.5-42 the first time; docs/prefix-cache.md).

Here a warp takes 16 rows (a query and a query head of the KV head's group),
a block 64, and runs over its span of the keys 64 at a time (32 for heads
wider than 64): the keys and values of a chunk are copied once into shared
memory for all its rows (`cp.async`, the next chunk while this one is
computed), the scores of 16 rows x 64 keys come from `mma.sync` (bfloat16 or
float16, float32 sums; `ldmatrix` feeds it), the softmax runs online in
registers (maximum, sum, weighted values a row, base 2), and the weights go
back into `mma.sync` with the values. No score reaches memory; only chunks
at a row's edges look at the mask (or its causal end and left padding). A
long context is cut into `splits` spans, so that a few rows still fill the
GPU's one wave of blocks; each block writes its rows' partial sums, and the
block that finishes a row block's last span (a counter a row block, zeroed
by the caller) joins them, a warp a row: one operation a layer. On the
H100, 16 layers' calls for 40 queries over 20k keys 2.6 ms (5.1 before the
join by warps and the double buffer; docs/prefix-cache.md).

MLX compiles it once per (head width, group, dtype, mask or causal) with NVRTC
(`mx.fast.cuda_kernel`); lengths are arguments, so no turn builds anything.
The queries, keys, values and mask are read through their strides (the batch
cache's views of its buffers are not copied); a key's and a value's vector
must be contiguous (16-byte loads), as mlx-lm's caches keep them.
"""

from __future__ import annotations

import math

import mlx.core as mx

from tierlm.backends.cuda_kv_attention import constant

ROWS = 64  # rows (query x query head) a block: 16 a warp, 4 warps
KEYS = 64  # keys a block reads into shared memory at a time
# blocks a call aims for at most: one wave (an H100 and an H200 have 132 SMs,
# each runs 3 blocks at once: ~150 registers a thread, 36 KiB of shared memory);
# a second, partly filled wave would cost a whole block's time again
TARGET_BLOCKS = 3 * 132
MIN_SPAN = 512  # keys a split takes at least
MAX_SPLITS = 32  # spans a row block's keys are cut into at most: a lane each when they are joined

_HEADER = """
#define TIERLM_MMA(c, a, b0, b1, TYPE) \\
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 " \\
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n" \\
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) \\
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

__device__ __forceinline__ unsigned tierlm_pack(float lo, float hi, __nv_bfloat16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned tierlm_pack(float lo, float hi, __half) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}
template <typename T>
__device__ __forceinline__ unsigned tierlm_pair(T lo, T hi) {
    unsigned short l = *reinterpret_cast<unsigned short*>(&lo), h = *reinterpret_cast<unsigned short*>(&hi);
    return (unsigned)l | ((unsigned)h << 16);
}
// four 8x8 16-bit matrices from shared memory, a lane's row address each (lanes 8m..8m+7: matrix m);
// TRANS: each lane gets a column's pair instead of a row's
template <bool TRANS>
__device__ __forceinline__ void tierlm_ldmatrix4(unsigned (&r)[4], const void* row) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
// 16 bytes global -> shared without passing through registers; `bytes` 0 writes zeros
__device__ __forceinline__ void tierlm_copy16(void* to, const void* from, int bytes) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(to));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(at), "l"(from), "r"(bytes));
}
"""

_SOURCE = """
    // KEYS keys a chunk, two chunks in shared memory (one computed while the next arrives)
    constexpr int ROWS = 64, KEYS = D <= 64 ? 64 : 32, DS = D + 8;  // a shared row padded: no bank conflicts
    constexpr float LOG2E = 1.4426950408889634f;
    const float NEG_INF = __int_as_float(0xff800000);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane >> 2, tig = lane & 3;       // mma's fragment coordinates
    const int splits = gridDim.x, split = blockIdx.x;
    const int heads = q_shape[1], length = q_shape[2];
    const int width = k_shape[2];                     // the keys
    const int rows_total = length * G;
    const int row_blocks = (rows_total + ROWS - 1) / ROWS;
    const int kv_head = blockIdx.y / row_blocks, row_block = blockIdx.y % row_blocks;
    const int b = blockIdx.z;

    const int per_split = ((width + splits - 1) / splits + KEYS - 1) / KEYS * KEYS;
    const int first = split * per_split;
    const int last = min(width, first + per_split);

    __shared__ __align__(16) T ks[2][KEYS * DS];
    __shared__ __align__(16) T vs[2][KEYS * DS];

    // this thread's two rows of its warp's 16: row r is query r / G, query head kv_head * G + r % G
    const int r0 = row_block * ROWS + warp * 16 + gid, r1 = r0 + 8;
    const bool live0 = r0 < rows_total, live1 = r1 < rows_total;
    const int i0 = r0 / G, i1 = r1 / G;

    unsigned qa[D / 16][4];                           // the rows' queries, mma's A fragments
#pragma unroll
    for (int kt = 0; kt < D / 16; kt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int d = kt * 16 + half * 8 + 2 * tig;
#pragma unroll
            for (int which = 0; which < 2; which++) {
                const int r = which ? r1 : r0;
                unsigned word = 0u;
                if (which ? live1 : live0) {
                    const T* p = q + (size_t)b * q_strides[0] + (size_t)(kv_head * G + r % G) * q_strides[1]
                                 + (size_t)(r / G) * q_strides[2] + (size_t)d * q_strides[3];
                    word = tierlm_pair(p[0], p[q_strides[3]]);
                }
                qa[kt][half * 2 + which] = word;
            }
        }
    }
    const float scale2 = scale[0] * LOG2E;            // scores in base 2

    float o[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    const T* k_rows = k + (size_t)b * k_strides[0] + (size_t)kv_head * k_strides[1];
    const T* v_rows = v + (size_t)b * v_strides[0] + (size_t)kv_head * v_strides[1];
    // which keys a row sees: with a mask, the mask's rows of this thread's queries (read
    // through its strides: it may be broadcast); else from its row's left padding up to itself
    const bool* seen0 = nullptr;
    const bool* seen1 = nullptr;
    int64_t mask_step = 0;
    if (HAS_MASK) {
        const bool* rows = mask + (mask_shape[0] == 1 ? 0 : (int64_t)b * mask_strides[0]);
        const int64_t row_step = mask_shape[2] == 1 ? 0 : mask_strides[2];
        seen0 = rows + min(i0, length - 1) * row_step;
        seen1 = rows + min(i1, length - 1) * row_step;
        mask_step = mask_strides[3];
    }
    const int pad = HAS_MASK ? 0 : pads[pads_shape[0] == 1 ? 0 : b];
    const int end0 = width - length + i0, end1 = width - length + i1;  // the last key a row sees
    // the keys every row of the block sees (no mask): a chunk inside needs no check
    const int shown_from = pad, shown_to = width - length + row_block * ROWS / G;

    auto fetch = [&](int buffer, int base) {
        constexpr int VEC = 8;                        // 16 bytes
        for (int e = threadIdx.x; e < KEYS * D / VEC; e += blockDim.x) {
            const int kk = e / (D / VEC), d = (e % (D / VEC)) * VEC;
            const int j = base + kk;
            const int bytes = j < last ? 16 : 0;
            const int jj = j < last ? j : first;
            tierlm_copy16(&ks[buffer][kk * DS + d], k_rows + (size_t)jj * k_strides[2] + d, bytes);
            tierlm_copy16(&vs[buffer][kk * DS + d], v_rows + (size_t)jj * v_strides[2] + d, bytes);
        }
        asm volatile("cp.async.commit_group;\\n" ::);
    };
    if (first < last) fetch(0, first);

    for (int base = first, chunk = 0; base < last; base += KEYS, chunk++) {
        const int buffer = chunk & 1;
        if (base + KEYS < last) {
            fetch(buffer ^ 1, base + KEYS);
            asm volatile("cp.async.wait_group 1;\\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\\n" ::);
        }
        __syncthreads();
        const T* kb = ks[buffer];
        const T* vb = vs[buffer];

        float s[KEYS / 8][4];                         // 16 rows x KEYS keys, 8 keys an mma
#pragma unroll
        for (int nt = 0; nt < KEYS / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kt = 0; kt < D / 16; kt += 2) {  // two 16-wide slices of the keys' vectors a load
                unsigned f[4];
                const int slice = kt + (lane >> 4) < D / 16 ? kt + (lane >> 4) : kt;
                tierlm_ldmatrix4<false>(f, kb + (nt * 8 + (lane & 7)) * DS + slice * 16 + ((lane >> 3) & 1) * 8);
                if (BF16) TIERLM_MMA(s[nt], qa[kt], f[0], f[1], "bf16");
                else TIERLM_MMA(s[nt], qa[kt], f[0], f[1], "f16");
                if (kt + 1 < D / 16) {
                    if (BF16) TIERLM_MMA(s[nt], qa[kt + 1], f[2], f[3], "bf16");
                    else TIERLM_MMA(s[nt], qa[kt + 1], f[2], f[3], "f16");
                }
            }
        }
        const bool whole = !HAS_MASK && base >= shown_from && base + KEYS <= last && base + KEYS - 1 <= shown_to;
        float high0 = NEG_INF, high1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < KEYS / 8; nt++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                if (whole) {
                    s[nt][c] *= scale2;
                    s[nt][2 + c] *= scale2;
                } else {
                    const int j = base + nt * 8 + 2 * tig + c;
                    const bool in = j < last;
                    const bool see0 = live0 && in && (HAS_MASK ? seen0[j * mask_step] : j >= pad && j <= end0);
                    const bool see1 = live1 && in && (HAS_MASK ? seen1[j * mask_step] : j >= pad && j <= end1);
                    s[nt][c] = see0 ? s[nt][c] * scale2 : NEG_INF;
                    s[nt][2 + c] = see1 ? s[nt][2 + c] * scale2 : NEG_INF;
                }
                high0 = fmaxf(high0, s[nt][c]);
                high1 = fmaxf(high1, s[nt][2 + c]);
            }
        }
#pragma unroll
        for (int x = 1; x < 4; x *= 2) {              // a row's keys are over its quad's 4 lanes
            high0 = fmaxf(high0, __shfl_xor_sync(0xffffffffu, high0, x));
            high1 = fmaxf(high1, __shfl_xor_sync(0xffffffffu, high1, x));
        }
        const float new0 = fmaxf(m0, high0), new1 = fmaxf(m1, high1);
        // a row that has seen no key yet keeps 0s (exp2 of -inf - -inf would be NaN)
        const float top0 = new0 == NEG_INF ? 0.f : new0, top1 = new1 == NEG_INF ? 0.f : new1;
        const float fade0 = exp2f(m0 - top0), fade1 = exp2f(m1 - top1);
        m0 = new0;
        m1 = new1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int nt = 0; nt < KEYS / 8; nt++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                s[nt][c] = exp2f(s[nt][c] - top0);
                s[nt][2 + c] = exp2f(s[nt][2 + c] - top1);
                sum0 += s[nt][c];
                sum1 += s[nt][2 + c];
            }
        }
        l0 = l0 * fade0 + sum0;
        l1 = l1 * fade1 + sum1;
#pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            o[nt][0] *= fade0; o[nt][1] *= fade0;
            o[nt][2] *= fade1; o[nt][3] *= fade1;
        }
#pragma unroll
        for (int kt = 0; kt < KEYS / 16; kt++) {      // the weights (mma's A) times the values
            unsigned pa[4];
            pa[0] = tierlm_pack(s[2 * kt][0], s[2 * kt][1], T());
            pa[1] = tierlm_pack(s[2 * kt][2], s[2 * kt][3], T());
            pa[2] = tierlm_pack(s[2 * kt + 1][0], s[2 * kt + 1][1], T());
            pa[3] = tierlm_pack(s[2 * kt + 1][2], s[2 * kt + 1][3], T());
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {   // two 8-wide slices of the values a load
                unsigned f[4];
                tierlm_ldmatrix4<true>(f, vb + (kt * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * DS
                                           + (nt + (lane >> 4)) * 8);
                if (BF16) { TIERLM_MMA(o[nt], pa, f[0], f[1], "bf16"); TIERLM_MMA(o[nt + 1], pa, f[2], f[3], "bf16"); }
                else { TIERLM_MMA(o[nt], pa, f[0], f[1], "f16"); TIERLM_MMA(o[nt + 1], pa, f[2], f[3], "f16"); }
            }
        }
        __syncthreads();                              // this chunk's reads are done before it is refilled
    }

    for (int x = 1; x < 4; x *= 2) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, x);
        l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    }
    // one span: the answer; several: each span's partial sums, and the block
    // that finishes its rows' last span joins them (no second operation)
#pragma unroll
    for (int which = 0; which < 2; which++) {
        if (!(which ? live1 : live0)) continue;
        const int r = which ? r1 : r0;
        const size_t at = ((size_t)b * heads + kv_head * G + r % G) * length + r / G;
        const float l = which ? l1 : l0, m = which ? m1 : m0;
#pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int d = nt * 8 + 2 * tig + c;
                const float value = o[nt][which * 2 + c];
                if (splits == 1) {
                    out[at * D + d] = static_cast<T>(l > 0.f ? value / l : 0.f);
                } else {
                    part_acc[(at * splits + split) * D + d] = value;
                    if (d == 0) { part_top[at * splits + split] = m; part_total[at * splits + split] = l; }
                }
            }
        }
    }
    if (splits == 1) return;
    __threadfence();
    __syncthreads();
    __shared__ bool last_span;
    if (threadIdx.x == 0)
        last_span = atomicAdd(const_cast<int*>(&counters[b * gridDim.y + blockIdx.y]), 1) == splits - 1;
    __syncthreads();
    if (!last_span) return;
    __threadfence();
    // A warp joins a row at a time: lane s holds span s's maximum and sum (at most
    // 32 spans), and the lanes read the row's partial sums along d, a few spans'
    // loads in flight at once. (One thread an element, each span's loads one
    // after another, took ~0.2 ms: the tail of every call.)
    constexpr int PER_LANE = (D + 31) / 32;
    for (int rr = warp; rr < ROWS; rr += blockDim.x / 32) {
        const int r = row_block * ROWS + rr;
        if (r >= rows_total) break;
        const size_t at = ((size_t)b * heads + kv_head * G + r % G) * length + r / G;
        const float top = lane < splits ? __ldcg(&part_top[at * splits + lane]) : NEG_INF;
        const float total = lane < splits ? __ldcg(&part_total[at * splits + lane]) : 0.f;
        float high = top;
        for (int x = 16; x > 0; x /= 2) high = fmaxf(high, __shfl_xor_sync(0xffffffffu, high, x));
        const float fade = top == NEG_INF ? 0.f : exp2f(top - high);
        float sum = total * fade;
        for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
        float value[PER_LANE];
        for (int i = 0; i < PER_LANE; i++) value[i] = 0.f;
        const float* acc = part_acc + at * splits * D;
        #pragma unroll 4
        for (int sp = 0; sp < splits; sp++) {
            const float f = __shfl_sync(0xffffffffu, fade, sp);
            for (int i = 0; i < PER_LANE; i++)
                if (lane + 32 * i < D) value[i] += __ldcg(&acc[sp * D + lane + 32 * i]) * f;
        }
        for (int i = 0; i < PER_LANE; i++)
            if (lane + 32 * i < D) out[at * D + lane + 32 * i] = static_cast<T>(sum > 0.f ? value[i] / sum : 0.f);
    }
"""

_kernel = None


def _splits(blocks: int, span: int) -> int:
    """Spans of the keys each block's rows are cut into: enough blocks to fill
    the GPU, none shorter than MIN_SPAN keys, at most MAX_SPLITS."""
    return max(1, min(TARGET_BLOCKS // blocks, span // MIN_SPAN, MAX_SPLITS))


def _compiled():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="tierlm_hit_attention", input_names=["q", "k", "v", "mask", "pads", "scale", "counters"],
            output_names=["out", "part_top", "part_total", "part_acc"],
            source=_SOURCE, header=_HEADER, ensure_row_contiguous=False)
    return _kernel


def usable(queries: mx.array, keys: mx.array, mask) -> bool:
    """Whether the kernel takes this call: a CUDA GPU, 16-bit queries, keys and
    values alike, a head width that is a multiple of 16 up to 128 (what a
    warp's registers hold), and a mask that is "causal", None or booleans over
    every key."""
    batch, heads, length, width = queries.shape
    kv_heads = keys.shape[1]
    return (mx.default_device() != mx.cpu and mx.cuda.is_available()
            and queries.dtype in (mx.bfloat16, mx.float16) and keys.dtype == queries.dtype
            and width % 16 == 0 and width <= 128 and heads % kv_heads == 0 and _mask_fits(mask, keys.shape[2]))


def _mask_fits(mask, span: int) -> bool:
    if mask is None or isinstance(mask, str):
        return mask in (None, "causal")
    return mask.dtype == mx.bool_ and mask.shape[-1] == span and (mask.ndim == 2 or mask.ndim == 4 and mask.shape[1] == 1)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask,
              left_padding: mx.array | None = None) -> mx.array:
    """softmax(q kᵀ · scale, hidden where `mask` is False) v for (B, heads, L, D)
    queries over (B, kv_heads, S, D) keys and values; `mask`: None (every key),
    "causal" (query i at position S - L + i) or booleans (B or 1, 1, L or 1, S).
    With `left_padding` (B,), "causal" hides each row's first keys too: what
    mlx-lm's batch cache's mask says, computed instead of read."""
    batch, heads, length, width = queries.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    if mask is None and length == 1:
        mask = "causal"  # the one query sees every key either way
    has_mask = isinstance(mask, mx.array)
    if has_mask and mask.ndim == 2:
        mask = mask[None, None]
    if mask is None:  # every key: a mask that shows them all (broadcast: one value)
        has_mask = True
        mask = mx.broadcast_to(constant(("every",), lambda: mx.ones((1, 1, 1, 1), dtype=mx.bool_)), (1, 1, 1, span))
    elif not has_mask:
        mask = constant(("unread",), lambda: mx.zeros((1, 1, 1, 1), dtype=mx.bool_))  # the kernel computes "causal"
    if has_mask or left_padding is None:
        pads = constant(("no padding",), lambda: mx.zeros((1,), dtype=mx.int32))
    else:
        pads = left_padding if left_padding.dtype == mx.int32 else left_padding.astype(mx.int32)
    row_blocks = math.ceil(length * group / ROWS)
    splits = _splits(batch * kv_heads * row_blocks, span)
    # Each row block's count of the spans done, zeroed: the kernel counts in it
    # (an input written to: a fresh array of this call alone). Every output is
    # written whole, so none is filled first (MLX's init_value fills them all:
    # 80 more operations a 16-layer pass; on an H100 at 20k keys, 1.2-1.4 ms
    # for the float32 partials alone).
    counters = mx.zeros((batch * kv_heads * row_blocks,), dtype=mx.int32)
    inputs = [queries, keys, values, mask, pads, constant(("scale", scale), lambda: mx.array([scale], dtype=mx.float32)),
              counters]
    template = [("D", width), ("G", group), ("HAS_MASK", has_mask), ("T", queries.dtype),
                ("BF16", queries.dtype == mx.bfloat16)]
    parts = (batch, heads, length, splits) if splits > 1 else (1, 1, 1, 1)  # unwritten with one span
    out, *_ = _compiled()(
        inputs=inputs, output_shapes=[queries.shape, parts, parts, (*parts, width)],
        output_dtypes=[queries.dtype, mx.float32, mx.float32, mx.float32],
        grid=(32 * 4 * splits, kv_heads * row_blocks, batch), threadgroup=(32 * 4, 1, 1), template=template,
)
    return out
