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
 * sgemm_route.c sends products of these shapes here (B not a packed weight). */
#include <stdlib.h>
#include <string.h>

#define MAX_SMALL 512 /* the head dimension and the value width handled here */

#if defined(__x86_64__)
#include <immintrin.h>

/* 1 when the CPU has AVX-512F: the route's exact kernels, and softmax.c and
 * swiglu.c (route.py asks). */
int tierlm_avx512_available(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

#pragma GCC push_options
#pragma GCC target("avx512f")

static void store(float *dst, __m512 acc, float alpha, float beta, __mmask16 lanes) {
  __m512 out = _mm512_mul_ps(acc, _mm512_set1_ps(alpha));
  if (beta != 0.0f) out = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, dst), _mm512_set1_ps(beta), out);
  _mm512_mask_storeu_ps(dst, lanes, out);
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

/* Row-major, A not transposed: scores when B is transposed and k is small,
 * weighted sums when B is not and n is small; returns 0 for anything else. */
int tierlm_exact_sgemm(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc) {
  if (trans_b && k <= MAX_SMALL) {
    scores(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return 1;
  }
  if (!trans_b && n <= MAX_SMALL) {
    weighted_sum(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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
