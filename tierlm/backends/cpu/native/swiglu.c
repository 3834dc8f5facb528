/* SwiGLU in place (gate[i] = gate[i] / (1 + exp(-gate[i])) * x[i]) and GELU,
 * written once over simd.h's vectors and compiled for AVX-512 and for AVX2
 * (float_avx512.c, float_avx2.c; float_kernels.c exports the one this CPU runs).
 *
 * MLX's compiled kernels on this backend are scalar and split the polynomial exp
 * into several passes: SwiGLU over a 500-token prefill's 1,536-wide MLP took
 * ~3.7 ms a layer. kernels.py calls this on the evaluated gate and
 * up projections instead. Element by element, so batching changes no bit. */
#include "threads.h"

typedef struct {
  float *gate;
  const float *x;
  long n;
} swiglu_job;

/* Part `part` of `parts` of n elements, in whole vectors but for the last. */
static void span_of(long n, int part, int parts, long *from, long *to) {
  long vectors = (n + VL - 1) / VL;
  *from = vectors * part / parts * VL;
  *to = vectors * (part + 1) / parts * VL;
  if (*to > n) *to = n;
}

static void swiglu_part(void *arg, int part, int parts) {
  const swiglu_job *j = arg;
  const vf one = vf_set1(1.0f);
  long from, to;
  span_of(j->n, part, parts, &from, &to);
  for (long i = from; i < to; i += VL) {
    vmask lanes = vmask_first(to - i);
    vf g = vf_load_masked(lanes, j->gate + i);
    vf sig = vf_div(g, vf_add(one, vf_exp(vf_sub(vf_zero(), g))));
    vf_store_masked(j->gate + i, lanes, vf_mul(sig, vf_load_masked(lanes, j->x + i)));
  }
}

/* Shared over the cores (threads.c) for a prompt's rows; each element on its own. */
void SIMD_NAME(tierlm_swiglu)(float *gate, const float *x, long n) {
  swiglu_job j = {gate, x, n};
  tierlm_parallel(swiglu_part, &j, n < (1L << 15) ? 1 : 64);
}

/* GELU, tanh approximation (mlx.nn.gelu_approx: 0.5 x (1 + tanh(y)), y =
 * sqrt(2/pi) (x + 0.044715 x^3)), of n floats into out (which may be x), written as x / (1 + exp(-2y))
 * (1 + tanh(y) = 2 sigmoid(2y)): no cancellation for negative x, relative error
 * ~3e-7. MLX's tanh on this backend is scalar: Gemma 3 270M's MLP activation
 * took ~20 ns an element, ~40 % of a prefill chunk at the start of a prompt. */
void SIMD_NAME(tierlm_gelu_approx)(const float *x, float *out, long n) {
  const vf one = vf_set1(1.0f), c = vf_set1(-2.0f * 0.7978845608028654f), cubic = vf_set1(0.044715f);
  for (long i = 0; i < n; i += VL) {
    vmask lanes = vmask_first(n - i);
    vf v = vf_load_masked(lanes, x + i);
    vf y = vf_mul(c, vf_fmadd(vf_mul(cubic, v), vf_mul(v, v), v)); /* -2y */
    vf_store_masked(out + i, lanes, vf_div(v, vf_add(one, vf_exp(y))));
  }
}

/* GELU, exact (BERT's "gelu": x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))), of n floats
 * into out (which may be x). erf by Abramowitz and Stegun 7.1.26, error <= 1.5e-7:
 * 1 - t (a1 + t (a2 + ...)) exp(-z^2), t = 1 / (1 + p z), z = |x| / sqrt 2. MLX's
 * erf on this backend is scalar: an encoder's activation was ~25 % of a layer. */
void SIMD_NAME(tierlm_gelu_erf)(const float *x, float *out, long n) {
  const vf one = vf_set1(1.0f), half = vf_set1(0.5f), p = vf_set1(0.3275911f),
           root_half = vf_set1(0.7071067811865476f), a1 = vf_set1(0.254829592f), a2 = vf_set1(-0.284496736f),
           a3 = vf_set1(1.421413741f), a4 = vf_set1(-1.453152027f), a5 = vf_set1(1.061405429f);
  for (long i = 0; i < n; i += VL) {
    vmask lanes = vmask_first(n - i);
    vf v = vf_load_masked(lanes, x + i);
    vf z = vf_mul(vf_abs(v), root_half);
    vf t = vf_div(one, vf_fmadd(p, z, one));
    vf poly = vf_fmadd(vf_fmadd(vf_fmadd(vf_fmadd(a5, t, a4), t, a3), t, a2), t, a1);
    vf tail = vf_mul(vf_mul(poly, t), vf_exp(vf_mul(vf_sub(vf_zero(), z), z)));
    vf erf = vf_sub(one, tail); /* erf(|x| / sqrt 2) */
    erf = vf_select(vmask_lt(v, vf_zero()), vf_sub(vf_zero(), erf), erf);
    vf_store_masked(out + i, lanes, vf_mul(vf_mul(half, v), vf_add(one, erf)));
  }
}
