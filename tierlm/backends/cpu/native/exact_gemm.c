/* Attention's two small products, computed the same way wherever a row or a
 * column sits, so that batching does not change a single bit. Written once
 * over simd.h's vectors and compiled for AVX-512 and for AVX2 (float_avx512.c,
 * float_avx2.c; float_kernels.c exports the one this CPU runs).
 *
 * In a batch, mlx-lm pads shorter sequences on the left: a sequence's keys move
 * to later columns of the scores, its queries to later rows, and the softmax
 * weights gain leading zeros. OpenBLAS computes the edge tiles of a product with
 * other kernels than the inner ones, so the same dot product can come out one
 * bit different at another position, and a bit can flip a greedy token or make
 * a cached KV block differ from a recomputed one. Here every output element is
 * summed in one fixed order that depends on nothing but its own operands:
 * - scores = Q . K^T (K^T as "B transposed", k = the head dimension): each lane
 *   of a vector holds one key and runs the head dimension in order;
 * - out = P . V (V as "B", k = the keys): each output row adds p_k * v_k key by
 *   key in order, so leading zero weights add exact zeros.
 * sgemm_route.c sends products of these shapes here (B not a packed weight);
 * graph_ops.cpp calls tierlm_exact_sgemm_half for attention over KV kept at
 * float16, which reads B as float16 and sums the same chains.
 *
 * The products are blocked for the registers and the cache (up to 6 rows by
 * TILE_VECS vectors of keys or columns: 64 with AVX-512's 32 registers, 16
 * with AVX2's 16; the keys of a tile transposed in registers) and a long
 * prompt's are shared over the cores (threads.c; a decode step's are shared
 * a KV head each, by graph_ops.cpp). Either way each element is the same
 * chain, so the tiling and the threads change no bit. The weighted sums once
 * ran a row at a time over every key for Gemma's 256-wide heads, ~5-15
 * GFLOP/s, which made attention most of a 20k-token prefill. */
#include <stdlib.h>

#include "threads.h"

#define MAX_SMALL 512 /* the head dimension and the value width handled here */
#define TILE_VECS (VL == 16 ? 4 : 2) /* a tile's width in vectors: 6 x TILE_VECS accumulators fit the registers */
#define TILE_COLS (TILE_VECS * VL)
#define PAIR_VECS 4                  /* two rows by 4 vectors of columns: 8 accumulators */
#define PAIR_COLS (PAIR_VECS * VL)

static void store(float *dst, vf acc, float alpha, float beta, vmask lanes) {
  vf out = vf_mul(acc, vf_set1(alpha));
  if (beta != 0.0f) out = vf_fmadd(vf_load_masked(lanes, dst), vf_set1(beta), out);
  vf_store_masked(dst, lanes, out);
}

/* How far ahead the products fetch the keys and values they read next: a
 * decode step reads a long context's KV once, from memory, and the hardware's
 * prefetcher alone left its loads waiting (~5 GB/s a core). */
#define KEYS_AHEAD TILE_COLS /* the next tile's keys */
#define VALUES_AHEAD 32      /* rows of values */

/* B of a product (the keys or the values): float32 (`f`) or float16 (`h`),
 * exactly one of them set. A KV cache kept at float16 is read here as it is,
 * half the bytes of float32 (a long context's decode step is bound by reading
 * them); a float16 read as a float32 is exact, so a product over float16 B has
 * the bits of the same product over those values held as float32. */
typedef struct {
  const float *f;
  const uint16_t *h;
} operand_t;

static inline operand_t operand_at(operand_t b, size_t at) {
  if (b.h) b.h += at;
  else b.f += at;
  return b;
}

/* The n (at most VL) values at b + at as float32, lanes from n on 0 (`lanes`:
 * the first n). `half` says which of b's pointers is set: the callers pass a
 * constant, so each loop is compiled for one type, without a test per load. */
static inline __attribute__((always_inline)) vf operand_load(operand_t b, size_t at, long n, vmask lanes, int half) {
  return half ? vf_load_half_first(n, b.h + at) : vf_load_masked(lanes, b.f + at);
}

/* a prefetch never faults, past the end or not */
static inline __attribute__((always_inline)) void operand_prefetch(operand_t b, size_t at, int half) {
  _mm_prefetch(half ? (const char *)(b.h + at) : (const char *)(b.f + at), _MM_HINT_T0);
}

/* bt[d * stride + j] = b[j * ldb + d], keys j < cols (at most VL) by d < k,
 * lanes past cols 0: VL keys at a time through a transpose in registers (copied
 * element by element, this was most of a decode step's scores, ~2.5 cycles a
 * key's value). The same values, so no bit of the products moves. Each load
 * fetches the same place KEYS_AHEAD keys on (a prefetch past the end never faults). */
static inline __attribute__((always_inline)) void transpose_keys(operand_t b, int ldb, int cols, int k, float *bt,
                                                                  int stride, int half) {
  for (int d0 = 0; d0 < k; d0 += VL) {
    int dims = k - d0 < VL ? k - d0 : VL;
    vmask lanes = vmask_first(dims);
    vf r[VL];
    for (int j = 0; j < VL; j++) {
      operand_prefetch(b, (size_t)(j + KEYS_AHEAD) * ldb + d0, half);
      r[j] = j < cols ? operand_load(b, (size_t)j * ldb + d0, dims, lanes, half) : vf_zero();
    }
    vf_transpose(r);
    for (int d = 0; d < dims; d++) vf_store(bt + (size_t)(d0 + d) * stride, r[d]);
  }
}

/* Products big enough to share out: below this many multiply-adds a helper
 * thread's wake-up costs more than it saves (a decode step's products stay
 * on one thread; graph_ops.cpp shares its KV heads instead). */
#define PARALLEL_MIN_FMAS (1L << 21)

/* The lanes of each of a tile's TILE_VECS vectors that hold one of its `cols` columns. */
static void tile_lanes(int cols, vmask lanes[TILE_VECS]) {
  for (int v = 0; v < TILE_VECS; v++) lanes[v] = vmask_first(cols - VL * v > 0 ? cols - VL * v : 0);
}

/* `rows` (at most 6) rows of scores against a tile of keys transposed in bt
 * (bt[d * TILE_COLS + lane]): rows x TILE_VECS independent chains at once,
 * unrolled where `rows` is a constant. Each lane's sum runs the head dimension
 * in order from 0, as every path here does, so tiling and threads change no bit. */
static inline __attribute__((always_inline)) void scores_rows(int rows, int k, float alpha, const float *a, int lda,
                                                              const float *bt, float beta, float *c, int ldc,
                                                              const vmask lanes[TILE_VECS]) {
  vf acc[6][TILE_VECS];
#pragma GCC unroll 6
  for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
    for (int v = 0; v < TILE_VECS; v++) acc[r][v] = vf_zero();
  for (int d = 0; d < k; d++) {
    vf keys[TILE_VECS];
#pragma GCC unroll 4
    for (int v = 0; v < TILE_VECS; v++) keys[v] = vf_load(bt + d * TILE_COLS + VL * v);
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++) {
      vf q = vf_set1(a[(size_t)r * lda + d]);
#pragma GCC unroll 4
      for (int v = 0; v < TILE_VECS; v++) acc[r][v] = vf_fmadd(q, keys[v], acc[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
    for (int v = 0; v < TILE_VECS; v++) store(c + (size_t)r * ldc + VL * v, acc[r][v], alpha, beta, lanes[v]);
}

/* scores, TILE_COLS keys by 6 rows at a time, then the last 1-5 rows together
 * (run a chain at a time, the seventh query row of a decode step's group of 7
 * waited on each multiply-add in turn). A last block narrower than the tile
 * runs with its missing keys zero and their lanes not stored. */
static void scores_block(int m, int cols, int k, float alpha, const float *a, int lda, operand_t b, int ldb,
                         float beta, float *c, int ldc, float *bt) {
  vmask lanes[TILE_VECS];
  tile_lanes(cols, lanes);
  for (int v = 0; v < TILE_VECS; v++) {
    int keys = cols - VL * v < VL ? cols - VL * v : VL;
    operand_t at = operand_at(b, (size_t)VL * v * ldb);
    if (keys > 0 && b.h) transpose_keys(at, ldb, keys, k, bt + VL * v, TILE_COLS, 1);
    else if (keys > 0) transpose_keys(at, ldb, keys, k, bt + VL * v, TILE_COLS, 0);
    else
      for (int d = 0; d < k; d++) vf_store(bt + (size_t)d * TILE_COLS + VL * v, vf_zero());
  }
  int i = 0;
  for (; i + 6 <= m; i += 6)
    scores_rows(6, k, alpha, a + (size_t)i * lda, lda, bt, beta, c + (size_t)i * ldc, ldc, lanes);
  const float *ai = a + (size_t)i * lda;
  float *ci = c + (size_t)i * ldc;
  switch (m - i) { /* a constant each, so each is unrolled into registers */
    case 1: scores_rows(1, k, alpha, ai, lda, bt, beta, ci, ldc, lanes); break;
    case 2: scores_rows(2, k, alpha, ai, lda, bt, beta, ci, ldc, lanes); break;
    case 3: scores_rows(3, k, alpha, ai, lda, bt, beta, ci, ldc, lanes); break;
    case 4: scores_rows(4, k, alpha, ai, lda, bt, beta, ci, ldc, lanes); break;
    case 5: scores_rows(5, k, alpha, ai, lda, bt, beta, ci, ldc, lanes); break;
  }
}

typedef struct {
  int m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *a;
  operand_t b;
  float *c;
  int *lo, *hi; /* weighted sums: each row's nonzero span */
} product_t;

/* Part `part` of `parts` of the scores: a share of the blocks of TILE_COLS keys. */
static void scores_part(void *arg, int part, int parts) {
  product_t *p = arg;
  float bt[MAX_SMALL * TILE_COLS] __attribute__((aligned(64)));
  int blocks = (p->n + TILE_COLS - 1) / TILE_COLS, first = (int)((long)blocks * part / parts),
      end = (int)((long)blocks * (part + 1) / parts);
  for (int nb = first; nb < end; nb++) {
    int n0 = nb * TILE_COLS, cols = p->n - n0 < TILE_COLS ? p->n - n0 : TILE_COLS;
    scores_block(p->m, cols, p->k, p->alpha, p->a, p->lda, operand_at(p->b, (size_t)n0 * p->ldb), p->ldb,
                 p->beta, p->c + n0, p->ldc, bt);
  }
}

/* [first, last) of the nonzero weights of a row. Zero weights add exact zeros
 * (acc + 0 * v = acc), so leaving them out changes nothing, and causal rows are
 * half zeros. */
static void nonzero_span(const float *w, int k, int *first, int *last) {
  int lo = 0, hi = k;
  for (; lo + VL <= hi; lo += VL) { /* a vector at a time from the front ... */
    unsigned nonzero = vf_differs_bits(vf_load(w + lo), 0.0f);
    if (nonzero) {
      lo += __builtin_ctz(nonzero);
      break;
    }
  }
  while (lo < hi && w[lo] == 0.0f) lo++;
  for (; hi - VL >= lo; hi -= VL) { /* ... and from the back */
    unsigned nonzero = vf_differs_bits(vf_load(w + hi - VL), 0.0f);
    if (nonzero) {
      hi = hi - VL + 32 - __builtin_clz(nonzero);
      break;
    }
  }
  while (hi > lo && w[hi - 1] == 0.0f) hi--;
  *first = lo, *last = hi;
}

/* Two rows of weights (over keys [lo, hi)) by PAIR_COLS columns of B from b:
 * eight chains. */
static void weighted_pair(const float *w0, const float *w1, int lo, int hi, const float *b, int ldb, vf out[8]) {
  for (int v = 0; v < 8; v++) out[v] = vf_zero();
  for (int j = lo; j < hi; j++) {
    const float *row = b + (size_t)j * ldb;
    vf r0 = vf_load(row), r1 = vf_load(row + VL), r2 = vf_load(row + 2 * VL), r3 = vf_load(row + 3 * VL),
       p = vf_set1(w0[j]), q = vf_set1(w1[j]);
    out[0] = vf_fmadd(p, r0, out[0]);
    out[1] = vf_fmadd(p, r1, out[1]);
    out[2] = vf_fmadd(p, r2, out[2]);
    out[3] = vf_fmadd(p, r3, out[3]);
    out[4] = vf_fmadd(q, r0, out[4]);
    out[5] = vf_fmadd(q, r1, out[5]);
    out[6] = vf_fmadd(q, r2, out[6]);
    out[7] = vf_fmadd(q, r3, out[7]);
  }
}

/* One row of weights by any B up to MAX_SMALL wide, in the same order. */
static void weighted_row(const float *w, int k, const float *b, int ldb, int n, float alpha, float beta, float *c) {
  int vectors = (n + VL - 1) / VL, lo, hi;
  vmask last = vmask_first(n - VL * (vectors - 1));
  vf acc[MAX_SMALL / VL];
  nonzero_span(w, k, &lo, &hi);
  for (int v = 0; v < vectors; v++) acc[v] = vf_zero();
  for (int j = lo; j < hi; j++) {
    vf p = vf_set1(w[j]);
    for (int v = 0; v < vectors; v++) {
      vmask lanes = v == vectors - 1 ? last : vmask_all();
      acc[v] = vf_fmadd(p, vf_load_masked(lanes, b + (size_t)j * ldb + VL * v), acc[v]);
    }
  }
  for (int v = 0; v < vectors; v++) store(c + VL * v, acc[v], alpha, beta, v == vectors - 1 ? last : vmask_all());
}

/* C (m x n) = alpha * A (m x k) . B (k x n) + beta * C, for n <= MAX_SMALL. */
static void weighted_sum(int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc) {
  int i = 0;
  if (n % PAIR_COLS == 0)
    for (; i + 2 <= m; i += 2) {
      const float *w0 = a + (size_t)i * lda, *w1 = w0 + lda;
      int lo0, hi0, lo1, hi1;
      nonzero_span(w0, k, &lo0, &hi0);
      nonzero_span(w1, k, &lo1, &hi1);
      int lo = lo0 < lo1 ? lo0 : lo1, hi = hi0 > hi1 ? hi0 : hi1;
      for (int c0 = 0; c0 < n; c0 += PAIR_COLS) {
        vf out[8];
        weighted_pair(w0, w1, lo, hi, b + c0, ldb, out);
        for (int v = 0; v < 8; v++)
          store(c + (size_t)(i + v / 4) * ldc + c0 + VL * (v % 4), out[v], alpha, beta, vmask_all());
      }
    }
  for (; i < m; i++) weighted_row(a + (size_t)i * lda, k, b, ldb, n, alpha, beta, c + (size_t)i * ldc);
}

/* Weighted sums, up to 6 rows x TILE_COLS columns at a time, keys in blocks of
 * KEY_BLOCK so that a block of B stays in cache while every row passes over
 * it; the sums wait in C between blocks (a float32 stored and loaded back is
 * the same float32). Each element still adds p_j * v_j for j in order from its
 * row's first nonzero weight, starting from 0: a group of rows runs the union
 * of their spans, and a zero weight adds an exact zero. So the result is
 * weighted_row's, bit for bit. Needs beta == 0 (MLX's matmuls pass 0). */
#define KEY_BLOCK 256

/* `rows` (at most 6) rows by a tile of columns (`lanes` of each vector), keys
 * [j0, j1): rows x TILE_VECS chains at once, unrolled where `rows` is a constant. */
static inline __attribute__((always_inline)) void weighted_rows(int rows, const float *a, int lda, operand_t b,
                                                                int ldb, float *c, int ldc, int j0, int j1, int cols,
                                                                const vmask lanes[TILE_VECS], int half) {
  vf acc[6][TILE_VECS];
#pragma GCC unroll 6
  for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
    for (int v = 0; v < TILE_VECS; v++) acc[r][v] = vf_load_masked(lanes[v], c + (size_t)r * ldc + VL * v);
  for (int j = j0; j < j1; j++) {
    size_t row = (size_t)j * ldb;
    vf vals[TILE_VECS];
#pragma GCC unroll 4
    for (int v = 0; v < TILE_VECS; v++) {
      operand_prefetch(b, row + (size_t)VALUES_AHEAD * ldb + VL * v, half);
      vals[v] = operand_load(b, row + VL * v, cols - VL * v, lanes[v], half);
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++) {
      vf p = vf_set1(a[(size_t)r * lda + j]);
#pragma GCC unroll 4
      for (int v = 0; v < TILE_VECS; v++) acc[r][v] = vf_fmadd(p, vals[v], acc[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
    for (int v = 0; v < TILE_VECS; v++) vf_store_masked(c + (size_t)r * ldc + VL * v, lanes[v], acc[r][v]);
}

static void weighted_tile(const float *a, int lda, operand_t b, int ldb, float *c, int ldc, int rows, int j0,
                          int j1, int c0, int cols) {
  vmask lanes[TILE_VECS];
  tile_lanes(cols, lanes);
  b = operand_at(b, c0), c += c0;
  /* rows and the operand's type constants in each, so each is unrolled into registers */
#define WEIGHTED_ROWS(half)                                                     \
  switch (rows) {                                                               \
    case 1: weighted_rows(1, a, lda, b, ldb, c, ldc, j0, j1, cols, lanes, half); break; \
    case 2: weighted_rows(2, a, lda, b, ldb, c, ldc, j0, j1, cols, lanes, half); break; \
    case 3: weighted_rows(3, a, lda, b, ldb, c, ldc, j0, j1, cols, lanes, half); break; \
    case 4: weighted_rows(4, a, lda, b, ldb, c, ldc, j0, j1, cols, lanes, half); break; \
    case 5: weighted_rows(5, a, lda, b, ldb, c, ldc, j0, j1, cols, lanes, half); break; \
    case 6: weighted_rows(6, a, lda, b, ldb, c, ldc, j0, j1, cols, lanes, half); break; \
  }
  if (b.h) WEIGHTED_ROWS(1)
  else WEIGHTED_ROWS(0)
#undef WEIGHTED_ROWS
}

/* Part `part` of `parts` of the weighted sums: a share of the 6-row groups. */
static void weighted_part(void *arg, int part, int parts) {
  product_t *p = arg;
  int groups = (p->m + 5) / 6, first = (int)((long)groups * part / parts),
      end = (int)((long)groups * (part + 1) / parts);
  if (first >= end) return;
  int lo = p->k, hi = 0;
  for (int i = first * 6; i < end * 6 && i < p->m; i++) {
    for (int col = 0; col < p->n; col++) p->c[(size_t)i * p->ldc + col] = 0.0f;
    if (p->lo[i] < lo) lo = p->lo[i];
    if (p->hi[i] > hi) hi = p->hi[i];
  }
  for (int j0 = lo; j0 < hi; j0 += KEY_BLOCK) {
    int j1 = j0 + KEY_BLOCK < hi ? j0 + KEY_BLOCK : hi;
    for (int g = first; g < end; g++) {
      int i = g * 6, rows = p->m - i < 6 ? p->m - i : 6, glo = p->k, ghi = 0;
      for (int r = 0; r < rows; r++) {
        if (p->lo[i + r] < glo) glo = p->lo[i + r];
        if (p->hi[i + r] > ghi) ghi = p->hi[i + r];
      }
      int from = glo > j0 ? glo : j0, to = ghi < j1 ? ghi : j1;
      if (from >= to) continue;
      for (int c0 = 0; c0 < p->n; c0 += TILE_COLS)
        weighted_tile(p->a + (size_t)i * p->lda, p->lda, p->b, p->ldb, p->c + (size_t)i * p->ldc, p->ldc, rows,
                      from, to, c0, p->n - c0 < TILE_COLS ? p->n - c0 : TILE_COLS);
    }
  }
  if (p->alpha != 1.0f)
    for (int i = first * 6; i < end * 6 && i < p->m; i++)
      for (int col = 0; col < p->n; col++) p->c[(size_t)i * p->ldc + col] *= p->alpha;
}

/* Row-major, A not transposed: scores when B is transposed and k is small,
 * weighted sums when B is not and n is small; returns 0 for anything else
 * (with float16 B, also weighted sums with beta != 0 or alpha NaN: MLX's
 * matmuls pass neither). */
static int exact_product(int trans_b, int m, int n, int k, float alpha, const float *a, int lda, operand_t b, int ldb,
                         float beta, float *c, int ldc) {
  int big = (long)m * n * k >= PARALLEL_MIN_FMAS;
  if (trans_b && k <= MAX_SMALL) {
    product_t p = {m, n, k, lda, ldb, ldc, alpha, beta, a, b, c, 0, 0};
    tierlm_parallel(scores_part, &p, big ? (n + TILE_COLS - 1) / TILE_COLS : 1);
    return 1;
  }
  if (!trans_b && n <= MAX_SMALL) {
    int *spans = beta != 0.0f || !(alpha == alpha) ? 0 : malloc(sizeof(int) * 2 * (size_t)m);
    if (!spans) {
      if (b.h) return 0;
      weighted_sum(m, n, k, alpha, a, lda, b.f, ldb, beta, c, ldc);
      return 1;
    }
    for (int i = 0; i < m; i++) nonzero_span(a + (size_t)i * lda, k, &spans[i], &spans[m + i]);
    product_t p = {m, n, k, lda, ldb, ldc, alpha, beta, a, b, c, spans, spans + m};
    tierlm_parallel(weighted_part, &p, big ? (m + 5) / 6 : 1);
    free(spans);
    return 1;
  }
  return 0;
}

int SIMD_NAME(tierlm_exact_sgemm)(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                                  const float *b, int ldb, float beta, float *c, int ldc) {
  return exact_product(trans_b, m, n, k, alpha, a, lda, (operand_t){b, 0}, ldb, beta, c, ldc);
}

/* The same product over float16 B (a KV cache kept at float16: graph_ops.cpp),
 * with the bits of the float32 one over the same values. */
int SIMD_NAME(tierlm_exact_sgemm_half)(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                                       const uint16_t *b, int ldb, float beta, float *c, int ldc) {
  return exact_product(trans_b, m, n, k, alpha, a, lda, (operand_t){0, b}, ldb, beta, c, ldc);
}
