/* Attention's two small products, computed the same way wherever a row or a
 * column sits, so that batching does not change a single bit.
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
 * sgemm_route.c sends products of these shapes here (B not a packed weight).
 *
 * A long prompt's products (a chunk's queries against every key before them)
 * are blocked for the registers and the cache (6 rows by 64 keys or columns)
 * and shared over the cores (threads.c); a decode step's few rows take the
 * row-at-a-time kernels. Either way each element is the same chain, so the
 * tiling and the threads change no bit. The weighted sums once ran a row at a
 * time over every key for Gemma's 256-wide heads, ~5-15 GFLOP/s, which made
 * attention most of a 20k-token prefill. */
#include <stdlib.h>
#include <string.h>

#include "cpu_features.h"
#include "threads.h"

#define MAX_SMALL 512 /* the head dimension and the value width handled here */

#if defined(__x86_64__)
#include <immintrin.h>

/* 1 when the CPU has AVX-512F (under TIERLM_MAX_CPU_ISA): the route's exact
 * kernels, and softmax.c and swiglu.c (route.py asks). */
int tierlm_avx512_available(void) { return tierlm_cpu_has(CPU_AVX512F); }

#pragma GCC push_options
#pragma GCC target("avx512f")

static void store(float *dst, __m512 acc, float alpha, float beta, __mmask16 lanes) {
  __m512 out = _mm512_mul_ps(acc, _mm512_set1_ps(alpha));
  if (beta != 0.0f) out = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, dst), _mm512_set1_ps(beta), out);
  _mm512_mask_storeu_ps(dst, lanes, out);
}

/* Products big enough to share out: below this many multiply-adds a helper
 * thread's wake-up costs more than it saves (decode's products stay on the
 * caller's thread). */
#define PARALLEL_MIN_FMAS (1L << 21)

/* scores, 64 keys x 6 rows at a time: bt holds the 64 keys transposed
 * (bt[d * 64 + lane]); each lane's sum runs the head dimension in order from
 * 0, as every path here does, so tiling and threads change no bit. */
static void scores_block(int m, int cols, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc, float *bt) {
  int vecs = (cols + 15) / 16;
  __mmask16 last = (__mmask16)((1u << (cols - 16 * (vecs - 1))) - 1);
  memset(bt, 0, sizeof(float) * k * 64);
  for (int j = 0; j < cols; j++)
    for (int d = 0; d < k; d++) bt[d * 64 + j] = b[(size_t)j * ldb + d];
  int i = 0;
  if (vecs == 4)
    for (; i + 6 <= m; i += 6) {
      const float *a0 = a + (size_t)i * lda;
      __m512 acc[6][4];
#pragma GCC unroll 6
      for (int r = 0; r < 6; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
      for (int d = 0; d < k; d++) {
        const float *keys = bt + d * 64;
        __m512 k0 = _mm512_load_ps(keys), k1 = _mm512_load_ps(keys + 16), k2 = _mm512_load_ps(keys + 32),
               k3 = _mm512_load_ps(keys + 48);
#pragma GCC unroll 6
        for (int r = 0; r < 6; r++) {
          __m512 q = _mm512_set1_ps(a0[(size_t)r * lda + d]);
          acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
          acc[r][2] = _mm512_fmadd_ps(q, k2, acc[r][2]);
          acc[r][3] = _mm512_fmadd_ps(q, k3, acc[r][3]);
        }
      }
#pragma GCC unroll 6
      for (int r = 0; r < 6; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
          store(c + (size_t)(i + r) * ldc + 16 * v, acc[r][v], alpha, beta, v == 3 ? last : (__mmask16)0xFFFF);
    }
  for (; i < m; i++) /* the same chains, one row at a time */
    for (int v = 0; v < vecs; v++) {
      __m512 s = _mm512_setzero_ps();
      for (int d = 0; d < k; d++)
        s = _mm512_fmadd_ps(_mm512_set1_ps(a[(size_t)i * lda + d]), _mm512_load_ps(bt + d * 64 + 16 * v), s);
      store(c + (size_t)i * ldc + 16 * v, s, alpha, beta, v == vecs - 1 ? last : (__mmask16)0xFFFF);
    }
}

typedef struct {
  int m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *a, *b;
  float *c;
  int *lo, *hi; /* weighted sums: each row's nonzero span */
} product_t;

/* Part `part` of `parts` of the scores: a share of the 64-key blocks. */
static void scores_part(void *arg, int part, int parts) {
  product_t *p = arg;
  float bt[MAX_SMALL * 64] __attribute__((aligned(64)));
  int blocks = (p->n + 63) / 64, first = (int)((long)blocks * part / parts),
      end = (int)((long)blocks * (part + 1) / parts);
  for (int nb = first; nb < end; nb++) {
    int n0 = nb * 64, cols = p->n - n0 < 64 ? p->n - n0 : 64;
    scores_block(p->m, cols, p->k, p->alpha, p->a, p->lda, p->b + (size_t)n0 * p->ldb, p->ldb, p->beta,
                 p->c + n0, p->ldc, bt);
  }
}
/* C (m x n) = alpha * A (m x k) . B^T (B is n x k) + beta * C, for k <= MAX_SMALL. */
static void scores(int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                   float beta, float *c, int ldc) {
  float bt[MAX_SMALL * 16] __attribute__((aligned(64))); /* 16 keys, transposed: bt[d * 16 + lane] */
  for (int n0 = 0; n0 < n; n0 += 16) {
    int cols = n - n0 < 16 ? n - n0 : 16;
    __mmask16 lanes = (__mmask16)((1u << cols) - 1);
    memset(bt, 0, sizeof(float) * k * 16);
    for (int j = 0; j < cols; j++)
      for (int d = 0; d < k; d++) bt[d * 16 + j] = b[(size_t)(n0 + j) * ldb + d];
    int i = 0;
    for (; i + 8 <= m; i += 8) { /* eight rows: eight independent chains */
      const float *a0 = a + (size_t)i * lda;
      __m512 acc[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
      for (int d = 0; d < k; d++) {
        __m512 keys = _mm512_load_ps(bt + d * 16);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a0[(size_t)r * lda + d]), keys, acc[r]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < 8; r++) store(c + (size_t)(i + r) * ldc + n0, acc[r], alpha, beta, lanes);
    }
    for (; i < m; i++) { /* the same chain, one row at a time */
      __m512 s = _mm512_setzero_ps();
      for (int d = 0; d < k; d++)
        s = _mm512_fmadd_ps(_mm512_set1_ps(a[(size_t)i * lda + d]), _mm512_load_ps(bt + d * 16), s);
      store(c + (size_t)i * ldc + n0, s, alpha, beta, lanes);
    }
  }
}

/* [first, last) of the nonzero weights of a row. Zero weights add exact zeros
 * (acc + 0 * v = acc), so leaving them out changes nothing, and causal rows are
 * half zeros. */
static void nonzero_span(const float *w, int k, int *first, int *last) {
  const __m512 zero = _mm512_setzero_ps();
  int lo = 0, hi = k;
  for (; lo + 16 <= hi; lo += 16) { /* 16 at a time from the front ... */
    __mmask16 nonzero = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + lo), zero, _CMP_NEQ_UQ);
    if (nonzero) {
      lo += __builtin_ctz(nonzero);
      break;
    }
  }
  while (lo < hi && w[lo] == 0.0f) lo++;
  for (; hi - 16 >= lo; hi -= 16) { /* ... and from the back */
    __mmask16 nonzero = _mm512_cmp_ps_mask(_mm512_loadu_ps(w + hi - 16), zero, _CMP_NEQ_UQ);
    if (nonzero) {
      hi = hi - 16 + 32 - __builtin_clz((unsigned)nonzero);
      break;
    }
  }
  while (hi > lo && w[hi - 1] == 0.0f) hi--;
  *first = lo, *last = hi;
}

/* Two rows of weights by a 64-wide B (the common head size): eight chains. */
static void weighted_pair_64(const float *w0, const float *w1, int k, const float *b, int ldb, __m512 out[8]) {
  int lo0, hi0, lo1, hi1;
  nonzero_span(w0, k, &lo0, &hi0);
  nonzero_span(w1, k, &lo1, &hi1);
  int lo = lo0 < lo1 ? lo0 : lo1, hi = hi0 > hi1 ? hi0 : hi1;
  for (int v = 0; v < 8; v++) out[v] = _mm512_setzero_ps();
  for (int j = lo; j < hi; j++) {
    const float *row = b + (size_t)j * ldb;
    __m512 r0 = _mm512_loadu_ps(row), r1 = _mm512_loadu_ps(row + 16), r2 = _mm512_loadu_ps(row + 32),
           r3 = _mm512_loadu_ps(row + 48), p = _mm512_set1_ps(w0[j]), q = _mm512_set1_ps(w1[j]);
    out[0] = _mm512_fmadd_ps(p, r0, out[0]);
    out[1] = _mm512_fmadd_ps(p, r1, out[1]);
    out[2] = _mm512_fmadd_ps(p, r2, out[2]);
    out[3] = _mm512_fmadd_ps(p, r3, out[3]);
    out[4] = _mm512_fmadd_ps(q, r0, out[4]);
    out[5] = _mm512_fmadd_ps(q, r1, out[5]);
    out[6] = _mm512_fmadd_ps(q, r2, out[6]);
    out[7] = _mm512_fmadd_ps(q, r3, out[7]);
  }
}

/* One row of weights by any B up to MAX_SMALL wide, in the same order. */
static void weighted_row(const float *w, int k, const float *b, int ldb, int n, float alpha, float beta, float *c) {
  int vectors = (n + 15) / 16, lo, hi;
  __mmask16 last = (__mmask16)((1u << (n - 16 * (vectors - 1))) - 1);
  __m512 acc[MAX_SMALL / 16];
  nonzero_span(w, k, &lo, &hi);
  for (int v = 0; v < vectors; v++) acc[v] = _mm512_setzero_ps();
  for (int j = lo; j < hi; j++) {
    __m512 p = _mm512_set1_ps(w[j]);
    for (int v = 0; v < vectors; v++) {
      __mmask16 lanes = v == vectors - 1 ? last : (__mmask16)0xFFFF;
      acc[v] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(lanes, b + (size_t)j * ldb + 16 * v), acc[v]);
    }
  }
  for (int v = 0; v < vectors; v++) store(c + 16 * v, acc[v], alpha, beta, v == vectors - 1 ? last : (__mmask16)0xFFFF);
}

/* C (m x n) = alpha * A (m x k) . B (k x n) + beta * C, for n <= MAX_SMALL. */
static void weighted_sum(int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                         float beta, float *c, int ldc) {
  int i = 0;
  if (n == 64)
    for (; i + 2 <= m; i += 2) {
      __m512 out[8];
      weighted_pair_64(a + (size_t)i * lda, a + (size_t)(i + 1) * lda, k, b, ldb, out);
      for (int v = 0; v < 8; v++)
        store(c + (size_t)(i + v / 4) * ldc + 16 * (v % 4), out[v], alpha, beta, (__mmask16)0xFFFF);
    }
  for (; i < m; i++) weighted_row(a + (size_t)i * lda, k, b, ldb, n, alpha, beta, c + (size_t)i * ldc);
}

/* Weighted sums, 6 rows x 64 columns at a time, keys in blocks of KEY_BLOCK so
 * that a block of B stays in cache while every row passes over it; the sums
 * wait in C between blocks (a float32 stored and loaded back is the same
 * float32). Each element still adds p_j * v_j for j in order from its row's
 * first nonzero weight, starting from 0: a group of rows runs the union of
 * their spans, and a zero weight adds an exact zero. So the result is
 * weighted_row's, bit for bit. Needs beta == 0 (MLX's matmuls pass 0). */
#define KEY_BLOCK 256

static void weighted_tile(const float *a, int lda, const float *b, int ldb, float *c, int ldc, int rows, int j0,
                          int j1, int c0, int cols) {
  int vecs = (cols + 15) / 16;
  __mmask16 mask[4];
  for (int v = 0; v < 4; v++) {
    int left = cols - 16 * v;
    mask[v] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
  }
  if (rows == 6 && vecs == 4) {
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
#pragma GCC unroll 4
      for (int v = 0; v < 4; v++) acc[r][v] = _mm512_maskz_loadu_ps(mask[v], c + (size_t)r * ldc + c0 + 16 * v);
    for (int j = j0; j < j1; j++) {
      const float *row = b + (size_t)j * ldb + c0;
      __m512 v0 = _mm512_maskz_loadu_ps(mask[0], row), v1 = _mm512_maskz_loadu_ps(mask[1], row + 16),
             v2 = _mm512_maskz_loadu_ps(mask[2], row + 32), v3 = _mm512_maskz_loadu_ps(mask[3], row + 48);
#pragma GCC unroll 6
      for (int r = 0; r < 6; r++) {
        __m512 p = _mm512_set1_ps(a[(size_t)r * lda + j]);
        acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < 6; r++)
#pragma GCC unroll 4
      for (int v = 0; v < 4; v++) _mm512_mask_storeu_ps(c + (size_t)r * ldc + c0 + 16 * v, mask[v], acc[r][v]);
    return;
  }
  for (int r = 0; r < rows; r++)
    for (int v = 0; v < vecs; v++) {
      float *out = c + (size_t)r * ldc + c0 + 16 * v;
      __m512 acc = _mm512_maskz_loadu_ps(mask[v], out);
      for (int j = j0; j < j1; j++)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(a[(size_t)r * lda + j]),
                              _mm512_maskz_loadu_ps(mask[v], b + (size_t)j * ldb + c0 + 16 * v), acc);
      _mm512_mask_storeu_ps(out, mask[v], acc);
    }
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
      for (int c0 = 0; c0 < p->n; c0 += 64)
        weighted_tile(p->a + (size_t)i * p->lda, p->lda, p->b, p->ldb, p->c + (size_t)i * p->ldc, p->ldc, rows,
                      from, to, c0, p->n - c0 < 64 ? p->n - c0 : 64);
    }
  }
  if (p->alpha != 1.0f)
    for (int i = first * 6; i < end * 6 && i < p->m; i++)
      for (int col = 0; col < p->n; col++) p->c[(size_t)i * p->ldc + col] *= p->alpha;
}

/* Row-major, A not transposed: scores when B is transposed and k is small,
 * weighted sums when B is not and n is small; returns 0 for anything else. */
int tierlm_exact_sgemm(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc) {
  int big = (long)m * n * k >= PARALLEL_MIN_FMAS;
  if (trans_b && k <= MAX_SMALL) {
    if (m < 6) {
      scores(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return 1;
    }
    product_t p = {m, n, k, lda, ldb, ldc, alpha, beta, a, b, c, 0, 0};
    tierlm_parallel(scores_part, &p, big ? (n + 63) / 64 : 1);
    return 1;
  }
  if (!trans_b && n <= MAX_SMALL) {
    if (m < 6 || beta != 0.0f || !(alpha == alpha)) {
      weighted_sum(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return 1;
    }
    int *spans = malloc(sizeof(int) * 2 * (size_t)m);
    if (!spans) {
      weighted_sum(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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

#pragma GCC pop_options
#else
int tierlm_avx512_available(void) { return 0; }

int tierlm_exact_sgemm(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc) {
  return 0;
}
#endif
