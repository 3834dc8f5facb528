/* One 32-value block of an MLX-packed weight row (4, 5 or 8 bits, LSB first)
 * unpacked to 32 bytes with AVX2: what qgemm.c and qgemm_avx512.c read their
 * weights through. 4-bit blocks come out low nibbles (even values) first, then
 * high nibbles (odd values); the others in order. */
#ifndef TIERLM_UNPACK_H
#define TIERLM_UNPACK_H

#include <immintrin.h>
#include <stdint.h>

#define UNPACK_TARGET __attribute__((target("avx2,fma")))

/* Where value i of a 32-value block lands once unpacked: the activations are
 * put in the same order, so that each pairs with its weight. */
static inline int unpacked_position(int bits, int i) { return bits == 4 ? (i & 1) * 16 + (i >> 1) : i; }

/* 16 bytes hold 32 nibbles: low nibbles (even values) in the low half, high in the high half. */
static inline UNPACK_TARGET __m256i unpack4(const uint8_t *p) {
  __m128i packed = _mm_loadu_si128((const __m128i *)p);
  __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* 20 bytes hold 32 values of 5 bits at bit 5i. Each 16-bit lane takes the two
 * bytes around its value (pshufb), a multiply by 2^(8-r) moves its bits to 8..12
 * (AVX2 has no per-lane 16-bit shift), >> 8 brings them down; values 0-7 and
 * 16-23 come out of one register, 8-15 and 24-31 of the other, and packing
 * interleaves them back into order. */
static inline UNPACK_TARGET __m256i unpack5(const uint8_t *p) {
  /* low 128 bits: bytes 0-15 (values 0-15); high: bytes 4-19 (values 16-31 at 6-15) */
  __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                          _mm_loadu_si128((const __m128i *)(p + 4)), 1);
  /* value j of a chunk of 8 starting at byte c: bytes c + (5j >> 3) and the next */
#define PAIRS(c) c, c + 1, c, c + 1, c + 1, c + 2, c + 1, c + 2, c + 2, c + 3, c + 3, c + 4, c + 3, c + 4, c + 4, -1
  const __m256i first = _mm256_setr_epi8(PAIRS(0), PAIRS(6));   /* values 0-7; 16-23 at bytes 10-14 */
  const __m256i second = _mm256_setr_epi8(PAIRS(5), PAIRS(11)); /* values 8-15; 24-31 at bytes 15-19 */
#undef PAIRS
  /* the shift of value j is 5j & 7: 0 5 2 7 4 1 6 3; multiply by 2^(8 - shift) */
  const __m256i up = _mm256_setr_epi16(256, 8, 64, 2, 16, 128, 4, 32, 256, 8, 64, 2, 16, 128, 4, 32);
  __m256i lo = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, first), up), 8);
  __m256i hi = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, second), up), 8);
  return _mm256_and_si256(_mm256_packus_epi16(lo, hi), _mm256_set1_epi8(0x1F));
}

static inline __attribute__((always_inline)) UNPACK_TARGET __m256i unpack(const uint8_t *p, int bits) {
  if (bits == 4) return unpack4(p);
  if (bits == 5) return unpack5(p);
  return _mm256_loadu_si256((const __m256i *)p);
}

/* unpack5 with AVX-512 VBMI, in four instructions instead of ten: each
 * 64-bit lane gathers the 5 bytes that hold its 8 values (vpermb), and
 * vpmultishiftqb takes the byte at bit 5k of the lane for value k. The load is
 * masked to the block's 20 bytes (the last block of a matrix ends it). */
#define UNPACK_VBMI_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vbmi")))

static inline __attribute__((always_inline)) UNPACK_VBMI_TARGET __m256i unpack5_vbmi(const uint8_t *p) {
  const __m256i gather = _mm256_setr_epi8(0, 1, 2, 3, 4, 0, 0, 0, 5, 6, 7, 8, 9, 0, 0, 0,
                                          10, 11, 12, 13, 14, 0, 0, 0, 15, 16, 17, 18, 19, 0, 0, 0);
  const __m256i at = _mm256_set1_epi64x(0x231E19140F0A0500LL); /* bits 0, 5, 10, ... 35 */
  __m256i lanes = _mm256_permutexvar_epi8(gather, _mm256_maskz_loadu_epi8(0xFFFFF, p));
  return _mm256_and_si256(_mm256_multishift_epi64_epi8(at, lanes), _mm256_set1_epi8(0x1F));
}

static inline __attribute__((always_inline)) UNPACK_VBMI_TARGET __m256i unpack_vbmi(const uint8_t *p, int bits) {
  return bits == 5 ? unpack5_vbmi(p) : unpack(p, bits);
}

#endif
