/* SwiGLU in place, with AVX-512: gate[i] = gate[i] / (1 + exp(-gate[i])) * x[i].
 *
 * MLX's compiled kernels on this backend are scalar and split the polynomial exp
 * into several passes: SwiGLU over a 500-token prefill's 1,536-wide MLP took
 * ~3.7 ms a layer. kernels.py calls this on the evaluated gate and
 * up projections instead. Element by element, so batching changes no bit. */
#include "counters.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f")

#include "exp512.h"

void tierlm_swiglu(float *gate, const float *x, long n) {
  TIERLM_COUNT(COUNT_SWIGLU);
  const __m512 one = _mm512_set1_ps(1.0f);
  for (long i = 0; i < n; i += 16) {
    __mmask16 lanes = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    __m512 g = _mm512_maskz_loadu_ps(lanes, gate + i);
    __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_mask_storeu_ps(gate + i, lanes, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(lanes, x + i)));
  }
}

#pragma GCC pop_options
#else
void tierlm_swiglu(float *gate, const float *x, long n) {}
#endif
