/* exp over 16 floats with AVX-512, shared by softmax.c and swiglu.c (include
 * it inside a region compiled for avx512f). */
#ifndef TIERLM_EXP512_H
#define TIERLM_EXP512_H
#include <immintrin.h>

/* exp(x), relative error ~2e-7; exactly 0 below -87.3 (no denormals, which
 * would slow the matmul that reads these weights ~10x); NaN stays NaN. */
static inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504f), ln2_hi = _mm512_set1_ps(0.693359375f),
               ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_set1_ps(88.3f), x); /* x second: a NaN passes through */
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r); /* x - n ln2, |r| <= ln2 / 2 */
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(~underflow, p, n);
}

#endif
