/* The float kernels this CPU runs: softmax, log-sum-exp, SwiGLU, GELU and
 * attention's exact products, each built for AVX-512 (float_avx512.c) and for
 * AVX2 + FMA (float_avx2.c) from one source, chosen at the first call by what
 * the CPU reports under TIERLM_MAX_CPU_ISA (cpu_features.h). A CPU with
 * neither has none of them: tierlm_float_lanes() is 0 and route.py leaves
 * attention and SwiGLU to MLX (kernels.py's fallbacks). */
#include "counters.h"
#include "cpu_features.h"
#include <stdint.h>

static int lanes = -1;

/* 1 when the CPU (under the cap) runs the build of `width` lanes: 16 needs
 * AVX-512F, and both builds are compiled with AVX2 and FMA. qgemm.c asks the
 * same for its float paths. */
int tierlm_float_width_available(int width) {
  int avx2 = tierlm_cpu_has(CPU_AVX2) && tierlm_cpu_has(CPU_FMA);
  return width == 8 ? avx2 : width == 16 ? avx2 && tierlm_cpu_has(CPU_AVX512F) : 0;
}

/* 16 (AVX-512F), 8 (AVX2 and FMA) or 0 (neither): the lanes the kernels use. */
int tierlm_float_lanes(void) {
  if (lanes < 0) lanes = tierlm_float_width_available(16) ? 16 : tierlm_float_width_available(8) ? 8 : 0;
  return lanes;
}

/* For tests and benchmarks: the kernels of `width` lanes (16 or 8) when the CPU
 * has them, the CPU's own choice for -1; returns the width in use, or -1 (and
 * changes nothing) when the CPU lacks it. */
int tierlm_float_select(int width) {
  if (width >= 0 && !tierlm_float_width_available(width)) return -1;
  lanes = width; /* -1: chosen again below */
  return tierlm_float_lanes();
}

#if defined(__x86_64__)
#define DECLARE(ret, name, params)                         \
  ret name##_avx512 params;                                \
  ret name##_avx2 params;
DECLARE(void, tierlm_softmax_rows, (float *x, long rows, long cols, long causal))
DECLARE(void, tierlm_softmax_rows_masked,
        (float *x, long rows, long cols, const unsigned char *mask, long heads, long length, long mask_batch))
DECLARE(void, tierlm_logsumexp_rows, (float *x, long rows, long cols, float *out))
DECLARE(void, tierlm_swiglu, (float *gate, const float *x, long n))
DECLARE(void, tierlm_gelu_approx, (const float *x, float *out, long n))
DECLARE(void, tierlm_gelu_erf, (const float *x, float *out, long n))
DECLARE(int, tierlm_exact_sgemm,
        (int trans_b, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta,
         float *c, int ldc))
DECLARE(int, tierlm_exact_sgemm_half,
        (int trans_b, int m, int n, int k, float alpha, const float *a, int lda, const uint16_t *b, int ldb,
         float beta, float *c, int ldc))
/* this CPU's build of `name` (call only when tierlm_float_lanes() is not 0) */
#define CHOOSE(name) (tierlm_float_lanes() == 16 ? name##_avx512 : name##_avx2)
#define DISPATCH(name, args) \
  if (tierlm_float_lanes()) CHOOSE(name) args
#else
#define DISPATCH(name, args)
#endif

void tierlm_softmax_rows(float *x, long rows, long cols, long causal) {
  TIERLM_COUNT(COUNT_SOFTMAX);
  DISPATCH(tierlm_softmax_rows, (x, rows, cols, causal));
}

void tierlm_softmax_rows_masked(float *x, long rows, long cols, const unsigned char *mask, long heads, long length,
                                long mask_batch) {
  TIERLM_COUNT(COUNT_SOFTMAX);
  DISPATCH(tierlm_softmax_rows_masked, (x, rows, cols, mask, heads, length, mask_batch));
}

void tierlm_logsumexp_rows(float *x, long rows, long cols, float *out) {
  TIERLM_COUNT(COUNT_LOGSUMEXP);
  DISPATCH(tierlm_logsumexp_rows, (x, rows, cols, out));
}

void tierlm_swiglu(float *gate, const float *x, long n) {
  TIERLM_COUNT(COUNT_SWIGLU);
  DISPATCH(tierlm_swiglu, (gate, x, n));
}

void tierlm_gelu_approx(const float *x, float *out, long n) {
  TIERLM_COUNT(COUNT_GELU);
  DISPATCH(tierlm_gelu_approx, (x, out, n));
}

void tierlm_gelu_erf(const float *x, float *out, long n) {
  TIERLM_COUNT(COUNT_GELU);
  DISPATCH(tierlm_gelu_erf, (x, out, n));
}

int tierlm_exact_sgemm(int trans_b, int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                       int ldb, float beta, float *c, int ldc) {
#if defined(__x86_64__)
  if (tierlm_float_lanes()) return CHOOSE(tierlm_exact_sgemm)(trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
  return 0;
}

/* tierlm_exact_sgemm over float16 B; 0 where it does not take the product. */
int tierlm_exact_sgemm_half(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                            const uint16_t *b, int ldb, float beta, float *c, int ldc) {
#if defined(__x86_64__)
  if (tierlm_float_lanes())
    return CHOOSE(tierlm_exact_sgemm_half)(trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
  return 0;
}
