/* One vector of floats, for the float kernels written once (softmax.c,
 * swiglu.c, exact_gemm.c) and compiled twice: by float_avx512.c with
 * SIMD_WIDTH 16 (AVX-512F) and by float_avx2.c with SIMD_WIDTH 8 (AVX2 and
 * FMA, which every x86-64 server has). Each kernel's order of operations
 * depends only on the width, so either build gives the same bits alone and
 * batched; the two builds differ from each other only where a sum runs in
 * lanes (16 partial sums against 8). exp is the same bits in both.
 *
 * Lane masks: `vmask` is a k-mask with AVX-512 and a vector of all-ones or
 * all-zeros lanes with AVX2; a masked load reads nothing outside its lanes (so
 * it never faults past the end of a row). SIMD_NAME(f) names a function the
 * build exports, f_avx512 or f_avx2 (float_kernels.c chooses between them). */
#ifndef TIERLM_SIMD_H
#define TIERLM_SIMD_H

#include <immintrin.h>
#include <stdint.h>

#if SIMD_WIDTH == 16

#define VL 16
#define SIMD_NAME(f) f##_avx512
typedef __m512 vf;
typedef __mmask16 vmask;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline float vf_reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vf_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }

static inline vmask vmask_all(void) { return (vmask)0xFFFF; }
/* lanes [0, n); all for n >= 16 */
static inline vmask vmask_first(long n) { return n >= 16 ? (vmask)0xFFFF : (vmask)((1u << n) - 1); }
/* the top n lanes, 0 < n <= 16 */
static inline vmask vmask_last(long n) { return (vmask)(0xFFFF << (16 - n)); }
static inline vmask vmask_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
/* lanes whose byte at m is 0 */
static inline vmask vmask_zero_bytes(const unsigned char *m) {
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)m));
  return _mm512_cmpeq_epi32_mask(bytes, _mm512_setzero_si512());
}
static inline vf vf_load_masked(vmask m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
static inline void vf_store_masked(float *p, vmask m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
static inline vf vf_keep(vmask m, vf v) { return _mm512_maskz_mov_ps(m, v); }
/* m ? a : b, lane by lane */
static inline vf vf_select(vmask m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); }
/* bit i set when lane i differs from x (a NaN differs) */
static inline unsigned vf_differs_bits(vf v, float x) {
  return _mm512_cmp_ps_mask(v, _mm512_set1_ps(x), _CMP_NEQ_UQ);
}
static inline vf vf_times_power_of_two(vf p, vf n) { return _mm512_scalef_ps(p, n); }
/* VL float16 values as float32 (exact) */
static inline vf vf_load_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* r[i] lane j becomes r[j] lane i: sixteen rows of sixteen, in registers */
static inline void vf_transpose(vf r[16]) {
  vf t[16], u[16];
  for (int i = 0; i < 8; i++) { /* rows 2i, 2i+1 interleaved: pairs of columns within each 128-bit lane */
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) { /* u[4i + c]: rows 4i..4i+3 of column c + 4 * (128-bit lane) */
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 2])));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[4 * i + 1]), _mm512_castps_pd(t[4 * i + 3])));
  }
  for (int c = 0; c < 4; c++) { /* gather each column's four 128-bit lanes */
    vf x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    vf y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88), y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[c + 4] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[c + 12] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

#elif SIMD_WIDTH == 8

#define VL 8
#define SIMD_NAME(f) f##_avx2
typedef __m256 vf;
typedef __m256i vmask;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vf_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline float vf_reduce_add(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vf_reduce_max(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline vmask vmask_all(void) { return _mm256_set1_epi32(-1); }
static inline vmask vmask_first(long n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n >= 8 ? 8 : (int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vmask vmask_last(long n) {
  return _mm256_cmpgt_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(7 - (int)n));
}
static inline vmask vmask_lt(vf a, vf b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
static inline vmask vmask_zero_bytes(const unsigned char *m) {
  __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m));
  return _mm256_cmpeq_epi32(bytes, _mm256_setzero_si256());
}
static inline vf vf_load_masked(vmask m, const float *p) { return _mm256_maskload_ps(p, m); }
static inline void vf_store_masked(float *p, vmask m, vf v) { _mm256_maskstore_ps(p, m, v); }
static inline vf vf_keep(vmask m, vf v) { return _mm256_and_ps(_mm256_castsi256_ps(m), v); }
static inline vf vf_select(vmask m, vf a, vf b) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(m)); }
static inline unsigned vf_differs_bits(vf v, float x) {
  return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(x), _CMP_NEQ_UQ));
}
/* p * 2^n for whole n in [-126, 127] (what vf_exp passes): the power built in
 * the exponent field, so the product is exact, as scalef's is */
static inline vf vf_times_power_of_two(vf p, vf n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* VL float16 values as float32 (exact) */
static inline vf vf_load_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
/* r[i] lane j becomes r[j] lane i: eight rows of eight, in registers */
static inline void vf_transpose(vf r[8]) {
  vf t[8], u[8];
  for (int i = 0; i < 4; i++) { /* rows 2i, 2i+1 interleaved: pairs of columns within each 128-bit lane */
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) { /* u[4i + c]: rows 4i..4i+3 of column c + 4 * (128-bit lane) */
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; c++) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

#else
#error "SIMD_WIDTH must be 16 or 8"
#endif

/* The first n (at most VL) float16 values at p as float32, the other lanes 0,
 * reading nothing past them. */
static inline vf vf_load_half_first(long n, const uint16_t *p) {
  if (n >= VL) return vf_load_half(p);
  uint16_t part[VL] = {0};
  for (long i = 0; i < n; i++) part[i] = p[i];
  return vf_load_half(part);
}

/* exp(x), relative error ~2e-7; exactly 0 below -87.3 (no denormals, which
 * would slow the matmul that reads these weights ~10x); NaN stays NaN. */
static inline vf vf_exp(vf x) {
  const vf log2e = vf_set1(1.44269504f), ln2_hi = vf_set1(0.693359375f), ln2_lo = vf_set1(-2.12194440e-4f);
  vmask underflow = vmask_lt(x, vf_set1(-87.3f));
  x = vf_min(vf_set1(88.3f), x); /* x second: a NaN passes through */
  vf n = vf_round(vf_mul(x, log2e));
  vf r = vf_fnmadd(n, ln2_hi, x);
  r = vf_fnmadd(n, ln2_lo, r); /* x - n ln2, |r| <= ln2 / 2 */
  vf p = vf_set1(1.9875691500e-4f);
  p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
  p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
  p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
  p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
  p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
  p = vf_fmadd(vf_mul(p, r), r, vf_add(r, vf_set1(1.0f)));
  return vf_select(underflow, vf_zero(), vf_times_power_of_two(p, n));
}

#endif
