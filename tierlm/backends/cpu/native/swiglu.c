/* SwiGLU in place, with AVX-512: gate[i] = gate[i] / (1 + exp(-gate[i])) * x[i].
 *
 * MLX's compiled kernels on this backend are scalar and split the polynomial exp
 * into several passes: SwiGLU over a 500-token prefill's 1,536-wide MLP took
 * ~3.7 ms a layer. kernels.py calls this on the evaluated gate and
 * up projections instead. Element by element, so batching changes no bit. */
#include "counters.h"
#include "threads.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f")

#include "exp512.h"

typedef struct {
  float *gate;
  const float *x;
  long n;
} swiglu_job;

/* Part `part` of `parts` of n elements, in whole vectors but for the last. */
static void span_of(long n, int part, int parts, long *from, long *to) {
  long vectors = (n + 15) / 16;
  *from = vectors * part / parts * 16;
  *to = vectors * (part + 1) / parts * 16;
  if (*to > n) *to = n;
}

static void swiglu_part(void *arg, int part, int parts) {
  const swiglu_job *j = arg;
  const __m512 one = _mm512_set1_ps(1.0f);
  long from, to;
  span_of(j->n, part, parts, &from, &to);
  for (long i = from; i < to; i += 16) {
    __mmask16 lanes = to - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (to - i)) - 1);
    __m512 g = _mm512_maskz_loadu_ps(lanes, j->gate + i);
    __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_mask_storeu_ps(j->gate + i, lanes, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(lanes, j->x + i)));
  }
}

/* Shared over the cores (threads.c) for a prompt's rows; each element on its own. */
void tierlm_swiglu(float *gate, const float *x, long n) {
  TIERLM_COUNT(COUNT_SWIGLU);
  swiglu_job j = {gate, x, n};
  tierlm_parallel(swiglu_part, &j, n < (1L << 15) ? 1 : 64);
}

/* GELU, tanh approximation (mlx.nn.gelu_approx: 0.5 x (1 + tanh(y)), y =
 * sqrt(2/pi) (x + 0.044715 x^3)), of n floats into out (which may be x), written as x / (1 + exp(-2y))
 * (1 + tanh(y) = 2 sigmoid(2y)): no cancellation for negative x, relative error
 * ~3e-7. MLX's tanh on this backend is scalar: Gemma 3 270M's MLP activation
 * took ~20 ns an element, ~40 % of a prefill chunk at the start of a prompt. */
void tierlm_gelu_approx(const float *x, float *out, long n) {
  TIERLM_COUNT(COUNT_GELU);
  const __m512 one = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(-2.0f * 0.7978845608028654f),
               cubic = _mm512_set1_ps(0.044715f);
  for (long i = 0; i < n; i += 16) {
    __mmask16 lanes = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(lanes, x + i);
    __m512 y = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(cubic, v), _mm512_mul_ps(v, v), v)); /* -2y */
    _mm512_mask_storeu_ps(out + i, lanes, _mm512_div_ps(v, _mm512_add_ps(one, exp512(y))));
  }
}

/* GELU, exact (BERT's "gelu": x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))), of n floats
 * into out (which may be x). erf by Abramowitz and Stegun 7.1.26, error <= 1.5e-7:
 * 1 - t (a1 + t (a2 + ...)) exp(-z^2), t = 1 / (1 + p z), z = |x| / sqrt 2. MLX's
 * erf on this backend is scalar: an encoder's activation was ~25 % of a layer. */
void tierlm_gelu_erf(const float *x, float *out, long n) {
  TIERLM_COUNT(COUNT_GELU);
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f), p = _mm512_set1_ps(0.3275911f),
               root_half = _mm512_set1_ps(0.7071067811865476f), a1 = _mm512_set1_ps(0.254829592f),
               a2 = _mm512_set1_ps(-0.284496736f), a3 = _mm512_set1_ps(1.421413741f),
               a4 = _mm512_set1_ps(-1.453152027f), a5 = _mm512_set1_ps(1.061405429f);
  for (long i = 0; i < n; i += 16) {
    __mmask16 lanes = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(lanes, x + i);
    __m512 z = _mm512_mul_ps(_mm512_abs_ps(v), root_half);
    __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(p, z, one));
    __m512 poly = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(a5, t, a4), t, a3), t, a2), t, a1);
    __m512 tail = _mm512_mul_ps(_mm512_mul_ps(poly, t), exp512(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), z), z)));
    __m512 erf = _mm512_sub_ps(one, tail); /* erf(|x| / sqrt 2) */
    __mmask16 negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    erf = _mm512_mask_sub_ps(erf, negative, _mm512_setzero_ps(), erf);
    _mm512_mask_storeu_ps(out + i, lanes, _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_add_ps(one, erf)));
  }
}

#pragma GCC pop_options
#else
void tierlm_swiglu(float *gate, const float *x, long n) {}

void tierlm_gelu_approx(const float *x, float *out, long n) {}

void tierlm_gelu_erf(const float *x, float *out, long n) {}
#endif
