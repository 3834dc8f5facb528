/* Row softmax in place, with AVX-512, for attention on MLX's CPU backend (and
 * the row log-sum-exp mlx-lm takes of every step's logits).
 *
 * MLX's Linux CPU build computes exp one element at a time, and its compiled
 * kernels split a polynomial exp into several passes over memory: the softmax of
 * a 500-token prefill's attention scores took ~25 ms a layer, more than all of
 * the layer's matmuls. Here one pass per row finds the maximum, a second takes
 * exp (range reduction, a degree-6 polynomial, the exponent put back with
 * scalef) and sums, a third normalizes, all while the row sits in cache:
 * ~30x faster. kernels.py calls it on evaluated scores. */
#include <math.h>
#include <string.h>

#include "counters.h"
#include "threads.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f")

#include "exp512.h"

/* 1 + the index of the last column above -inf (0 when there is none). */
static long last_seen(const float *row, long n) {
  const __m512 masked = _mm512_set1_ps(-INFINITY);
  long j = n;
  for (; j >= 16; j -= 16) {
    __mmask16 seen = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j - 16), masked, _CMP_NEQ_UQ);
    if (seen) return j - 16 + 32 - __builtin_clz((unsigned)seen);
  }
  while (j > 0 && row[j - 1] == -INFINITY) j--;
  return j;
}

static float row_max(const float *row, long n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  long j = 0;
  for (; j + 16 <= n; j += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(row + j));
  __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
  best = _mm512_mask_max_ps(best, tail, best, _mm512_maskz_loadu_ps(tail, row + j));
  return _mm512_reduce_max_ps(best);
}

/* The sum of exp(row[j] - shift) for j < n, the terms written to row when
 * `store` (in place). The 16 partial sums take elements by their distance from
 * the row's end (the first, partial vector is loaded from before the row, its
 * missing lanes masked), so masked-out columns at the start (left padding in a
 * batch) only add zeros. With the row cut after its last visible column, the
 * sum, and so the output, is bit for bit the same alone and batched. */
static float exp_row(float *row, long n, float shift, int store) {
  __m512 sum = _mm512_setzero_ps(), s = _mm512_set1_ps(shift);
  for (long j = n - 16; j >= 0; j -= 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + j), s));
    if (store) _mm512_storeu_ps(row + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  long head = n % 16;
  if (head) {
    __mmask16 lanes = (__mmask16)(0xFFFF << (16 - head)); /* row[0 .. head) in the top lanes */
    float *start = row + head - 16;
    __m512 e = _mm512_maskz_mov_ps(lanes, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, start), s)));
    if (store) _mm512_mask_storeu_ps(start, lanes, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

static void scale_row(float *row, long n, float factor) {
  __m512 f = _mm512_set1_ps(factor);
  for (long j = 0; j < n; j += 16) {
    __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    _mm512_mask_storeu_ps(row + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), f));
  }
}

/* softmax in place over the first `seen` columns of a row of `cols` (the rest
 * were masked off: they become 0); a row whose seen scores are all -inf
 * becomes all 0. */
static void softmax_row(float *row, long seen, long cols) {
  float top = seen ? row_max(row, seen) : -INFINITY;
  if (top == -INFINITY) seen = 0;
  else scale_row(row, seen, 1.0f / exp_row(row, seen, top, 1));
  memset(row + seen, 0, (cols - seen) * sizeof(float));
}

typedef struct {
  float *x;
  long rows, cols, causal;
  const unsigned char *mask;
  long heads, length, mask_batch;
} rows_job;

/* Rows too few to be worth waking the other cores for stay on the caller's. */
static int parts_for(long rows, long cols) { return rows < 2 || rows * cols < (1L << 15) ? 1 : 64; }

static void softmax_part(void *arg, int part, int parts) {
  const rows_job *j = arg;
  for (long r = j->rows * part / parts; r < j->rows * (part + 1) / parts; r++) {
    float *row = j->x + r * j->cols;
    long seen = j->causal > 0 ? j->cols - j->causal + r % j->causal + 1 : j->cols;
    if (seen < 0) seen = 0;
    softmax_row(row, last_seen(row, seen), j->cols);
  }
}

/* softmax over each of `rows` rows of `cols` floats, in place. With `causal` > 0
 * the rows are the queries of blocks of `causal` consecutive positions ending at
 * the last column: row r sees columns up to cols - causal + r % causal, and the
 * rest become 0. Masked columns (-inf) at a row's end are cut off the same way,
 * so a mask array (batched prefill) gives what "causal" gives alone. A row that
 * sees nothing (all -inf) becomes all 0. The rows are shared over the cores
 * (threads.c), each row whole on one. */
void tierlm_softmax_rows(float *x, long rows, long cols, long causal) {
  TIERLM_COUNT(COUNT_SOFTMAX);
  rows_job j = {x, rows, cols, causal, 0, 0, 0, 0};
  tierlm_parallel(softmax_part, &j, parts_for(rows, cols));
}

static void masked_softmax_part(void *arg, int part, int parts) {
  const rows_job *j = arg;
  const __m512 masked = _mm512_set1_ps(-INFINITY);
  long cols = j->cols;
  for (long r = j->rows * part / parts; r < j->rows * (part + 1) / parts; r++) {
    float *row = j->x + r * cols;
    long b = r / (j->heads * j->length), i = r % j->length;
    const unsigned char *m = j->mask + (b * j->mask_batch * j->length + i) * cols;
    long c = 0;
    for (; c + 16 <= cols; c += 16) {
      __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(m + c)));
      _mm512_mask_storeu_ps(row + c, _mm512_cmpeq_epi32_mask(bytes, _mm512_setzero_si512()), masked);
    }
    for (; c < cols; c++)
      if (!m[c]) row[c] = -INFINITY;
    softmax_row(row, last_seen(row, cols), cols);
  }
}

/* tierlm_softmax_rows without `causal`, after the mask: the rows are (batch,
 * head, query) of scores whose mask is (batch or 1, 1, `length`, cols) bytes
 * (`mask_batch`: 1 when the mask has a row block per batch entry, 0 when one is
 * shared); a 0 byte makes its score -inf first. The same as MLX's
 * where(mask, scores, -inf) followed by tierlm_softmax_rows, bit for bit, in one
 * pass less over the scores. */
void tierlm_softmax_rows_masked(float *x, long rows, long cols, const unsigned char *mask, long heads, long length,
                                long mask_batch) {
  TIERLM_COUNT(COUNT_SOFTMAX);
  rows_job j = {x, rows, cols, 0, mask, heads, length, mask_batch};
  tierlm_parallel(masked_softmax_part, &j, parts_for(rows, cols));
}

/* out[r] = log(sum_j exp(x[r][j])) over each of `rows` rows of `cols` floats:
 * the normalizer mlx-lm's BatchGenerator subtracts from every step's logits. */
void tierlm_logsumexp_rows(float *x, long rows, long cols, float *out) {
  TIERLM_COUNT(COUNT_LOGSUMEXP);
  for (long r = 0; r < rows; r++) {
    float *row = x + r * cols, top = row_max(row, cols);
    out[r] = top == -INFINITY ? -INFINITY : top + logf(exp_row(row, cols, top, 0));
  }
}

#pragma GCC pop_options
#else
void tierlm_logsumexp_rows(float *x, long rows, long cols, float *out) {}

void tierlm_softmax_rows(float *x, long rows, long cols, long causal) {}

void tierlm_softmax_rows_masked(float *x, long rows, long cols, const unsigned char *mask, long heads, long length,
                                long mask_batch) {}
#endif
