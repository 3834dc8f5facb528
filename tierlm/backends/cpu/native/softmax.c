/* Row softmax in place, for attention on MLX's CPU backend (and the row
 * log-sum-exp mlx-lm takes of every step's logits). Written once over simd.h's
 * vectors and compiled for AVX-512 and for AVX2 (float_avx512.c,
 * float_avx2.c); float_kernels.c exports the one this CPU runs.
 *
 * MLX's Linux CPU build computes exp one element at a time, and its compiled
 * kernels split a polynomial exp into several passes over memory: the softmax of
 * a 500-token prefill's attention scores took ~25 ms a layer, more than all of
 * the layer's matmuls. Here one pass per row finds the maximum, a second takes
 * exp (range reduction, a degree-6 polynomial, the exponent put back) and sums,
 * a third normalizes, all while the row sits in cache: ~30x faster (AVX-512).
 * kernels.py calls it on evaluated scores. */
#include <math.h>
#include <string.h>

#include "threads.h"

/* 1 + the index of the last column above -inf (0 when there is none). */
static long last_seen(const float *row, long n) {
  long j = n;
  for (; j >= VL; j -= VL) {
    unsigned seen = vf_differs_bits(vf_load(row + j - VL), -INFINITY);
    if (seen) return j - VL + 32 - __builtin_clz(seen);
  }
  while (j > 0 && row[j - 1] == -INFINITY) j--;
  return j;
}

static float row_max(const float *row, long n) {
  vf best = vf_set1(-INFINITY);
  long j = 0;
  for (; j + VL <= n; j += VL) best = vf_max(best, vf_load(row + j));
  vmask tail = vmask_first(n - j);
  best = vf_select(tail, vf_max(best, vf_load_masked(tail, row + j)), best);
  return vf_reduce_max(best);
}

/* The sum of exp(row[j] - shift) for j < n, the terms written to row when
 * `store` (in place). The VL partial sums take elements by their distance from
 * the row's end (the first, partial vector is loaded from before the row, its
 * missing lanes masked), so masked-out columns at the start (left padding in a
 * batch) only add zeros. With the row cut after its last visible column, the
 * sum, and so the output, is bit for bit the same alone and batched. */
static float exp_row(float *row, long n, float shift, int store) {
  vf sum = vf_zero(), s = vf_set1(shift);
  for (long j = n - VL; j >= 0; j -= VL) {
    vf e = vf_exp(vf_sub(vf_load(row + j), s));
    if (store) vf_store(row + j, e);
    sum = vf_add(sum, e);
  }
  long head = n % VL;
  if (head) {
    vmask lanes = vmask_last(head); /* row[0 .. head) in the top lanes */
    float *start = row + head - VL;
    vf e = vf_keep(lanes, vf_exp(vf_sub(vf_load_masked(lanes, start), s)));
    if (store) vf_store_masked(start, lanes, e);
    sum = vf_add(sum, e);
  }
  return vf_reduce_add(sum);
}

static void scale_row(float *row, long n, float factor) {
  vf f = vf_set1(factor);
  for (long j = 0; j < n; j += VL) {
    vmask m = vmask_first(n - j);
    vf_store_masked(row + j, m, vf_mul(vf_load_masked(m, row + j), f));
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
void SIMD_NAME(tierlm_softmax_rows)(float *x, long rows, long cols, long causal) {
  rows_job j = {x, rows, cols, causal, 0, 0, 0, 0};
  tierlm_parallel(softmax_part, &j, parts_for(rows, cols));
}

static void masked_softmax_part(void *arg, int part, int parts) {
  const rows_job *j = arg;
  const vf masked = vf_set1(-INFINITY);
  long cols = j->cols;
  for (long r = j->rows * part / parts; r < j->rows * (part + 1) / parts; r++) {
    float *row = j->x + r * cols;
    long b = r / (j->heads * j->length), i = r % j->length;
    const unsigned char *m = j->mask + (b * j->mask_batch * j->length + i) * cols;
    long c = 0;
    for (; c + VL <= cols; c += VL) vf_store_masked(row + c, vmask_zero_bytes(m + c), masked);
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
void SIMD_NAME(tierlm_softmax_rows_masked)(float *x, long rows, long cols, const unsigned char *mask, long heads,
                                           long length, long mask_batch) {
  rows_job j = {x, rows, cols, 0, mask, heads, length, mask_batch};
  tierlm_parallel(masked_softmax_part, &j, parts_for(rows, cols));
}

/* out[r] = log(sum_j exp(x[r][j])) over each of `rows` rows of `cols` floats:
 * the normalizer mlx-lm's BatchGenerator subtracts from every step's logits. */
void SIMD_NAME(tierlm_logsumexp_rows)(float *x, long rows, long cols, float *out) {
  for (long r = 0; r < rows; r++) {
    float *row = x + r * cols, top = row_max(row, cols);
    out[r] = top == -INFINITY ? -INFINITY : top + logf(exp_row(row, cols, top, 0));
  }
}
