/* qgemm.c's integer products with AVX-512 VNNI, sixteen output columns a
 * 512-bit vector.
 *
 * The weights of 16 consecutive output columns (a strip) are unpacked two
 * 32-value blocks at a time and transposed as a 16 x 16 matrix of 4-byte
 * words, so that each vpdpbusd takes 4 values of one activation row (one
 * broadcast word) against the same 4 values of the 16 columns: a block is 8
 * of them, then one conversion and one multiply-add for its activation step,
 * for all 16 outputs at once. (Laid out as stored, a block's products would
 * land in the lanes of one output, and each would need its own conversion and
 * scaling, about as many instructions as float32's products.) One activation
 * row (decoding) multiplies each column's blocks as they lie and gathers the
 * 16 columns' integer sums into lanes (half_sums); up to FEW rows (a few draft
 * tokens) take the transposed weights straight from registers; more take them
 * from strips kept in the core's cache while every ROWS rows sweep them (a
 * prompt, a batch), 2-2.5x float32's speed there. Scales and biases are read as stored (float32 or float16) and
 * transposed the same way. The activations are quantized as qgemm.c quantizes
 * them (uncentred: the centre goes back through `fix`). Every output is
 * computed in one order (see block_step) whatever the tile or the number of
 * rows: a row has the same bits alone or batched. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_features.h"
#include "qgemm_int8.h"
#include "threads.h"
#include "unpack.h"

#define UNROLL _Pragma("GCC unroll 16")

#define ISA_VNNI512 "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
#define ISA_VNNI512_VBMI ISA_VNNI512 ",avx512vbmi"

/* Blocks b and b + 1 of a weight row (from p, block b's first byte) unpacked
 * to 64 bytes, each block's values in unpack()'s order. */
static inline __attribute__((always_inline, target(ISA_VNNI512))) __m512i unpack_pair(const uint8_t *p, int bits) {
  if (bits == 8) return _mm512_loadu_si512(p);
  if (bits == 4) { /* per block: low nibbles, then high ones */
    __m512i z = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p));
    z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(1, 1, 0, 0));
    z = _mm512_mask_srli_epi16(z, 0xFF00FF00u, z, 4);
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(unpack5(p)), unpack5(p + 20), 1);
}

static inline __attribute__((always_inline, target(ISA_VNNI512_VBMI))) __m512i unpack_pair_vbmi(const uint8_t *p,
                                                                                               int bits) {
  if (bits != 5) return unpack_pair(p, bits);
  /* each 64-bit lane the 5 bytes of its 8 values: lane i bytes 5i .. 5i + 4 */
  const __m512i gather = _mm512_set_epi64(0x0000002726252423LL, 0x0000002221201F1ELL, 0x0000001D1C1B1A19LL,
                                          0x0000001817161514LL, 0x000000131211100FLL, 0x0000000E0D0C0B0ALL,
                                          0x0000000908070605LL, 0x0000000403020100LL);
  const __m512i at = _mm512_set1_epi64(0x231E19140F0A0500LL); /* bits 0, 5, 10, ... 35 of each lane */
  __m512i lanes = _mm512_permutexvar_epi8(gather, _mm512_maskz_loadu_epi8(0xFFFFFFFFFFULL, p));
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(at, lanes), _mm512_set1_epi8(0x1F));
}

/* The 16 x 16 matrix of 32-bit values in v[0..15] (row i in v[i]) transposed in
 * place: two rounds of in-lane unpacks, then two of 128-bit chunks. */
static inline __attribute__((always_inline, target(ISA_VNNI512))) void transpose16(__m512 v[16]) {
  __m512 t[16];
  UNROLL for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  UNROLL for (int i = 0; i < 4; i++) { /* v[4i + k], chunk q: rows 4i .. 4i + 3 of column 4q + k */
    __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    v[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    v[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    v[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    v[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  UNROLL for (int k = 0; k < 4; k++) {
    __m512 a = _mm512_shuffle_f32x4(v[k], v[4 + k], 0x88), b = _mm512_shuffle_f32x4(v[k], v[4 + k], 0xDD);
    __m512 c = _mm512_shuffle_f32x4(v[8 + k], v[12 + k], 0x88), d = _mm512_shuffle_f32x4(v[8 + k], v[12 + k], 0xDD);
    t[k] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[8 + k] = _mm512_shuffle_f32x4(a, c, 0xDD);
    t[4 + k] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
  UNROLL for (int i = 0; i < 16; i++) v[i] = t[i];
}

#define STRIP 16 /* output columns a vector */
#define FEW 4    /* up to this many activation rows: the weights straight from registers */
#define ROWS 8   /* activation rows a tile over a kept strip takes at most */

/* The first n of 16 lanes (all from 16) */
static inline __mmask16 first_lanes(long n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }

/* A strip's float32 scales (or biases), a vector of its columns' for each
 * group: 16 groups at a time transposed. Columns past the matrix's are 0.
 * (Float16 ones: strip_halves.) */
static __attribute__((target(ISA_VNNI512))) void strip_scales(const float *s, long groups, int columns, float *to) {
  for (long g = 0; g < groups; g += 16) {
    __m512 v[STRIP];
    UNROLL for (int c = 0; c < STRIP; c++)
      v[c] = c < columns ? _mm512_maskz_loadu_ps(first_lanes(groups - g), s + c * groups + g) : _mm512_setzero_ps();
    transpose16(v);
    for (long i = 0; i < 16 && g + i < groups; i++) _mm512_storeu_ps(to + (g + i) * STRIP, v[i]);
  }
}

/* Both of a strip's float16 arrays at once, as float16: column c's 16 scales
 * and 16 biases from group g as one row of 16 words (scale pairs, then bias
 * pairs), the 16 x 16 words transposed, each word's two halves stored as their
 * groups' vectors. */
static __attribute__((target(ISA_VNNI512))) void strip_halves(const uint16_t *s, const uint16_t *bias, long groups,
                                                              int columns, uint16_t *scale_to, uint16_t *bias_to) {
  for (long g = 0; g < groups; g += 16) {
    __mmask16 in = first_lanes(groups - g);
    __m512 v[STRIP];
    UNROLL for (int c = 0; c < STRIP; c++) {
      __m512i row = _mm512_setzero_si512();
      if (c < columns)
        row = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi16(in, s + c * groups + g)),
                                 _mm256_maskz_loadu_epi16(in, bias + c * groups + g), 1);
      v[c] = _mm512_castsi512_ps(row);
    }
    transpose16(v);
    UNROLL for (int j = 0; j < STRIP; j++) {
      __m512i words = _mm512_castps_si512(v[j]);
      uint16_t *to = j < 8 ? scale_to : bias_to;
      long at = g + 2 * (j % 8);
      if (at < groups) _mm256_storeu_si256((__m256i *)(to + at * STRIP), _mm512_cvtepi32_epi16(words));
      if (at + 1 < groups)
        _mm256_storeu_si256((__m256i *)(to + (at + 1) * STRIP), _mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
    }
  }
}

/* Group g's values of a strip's 16 columns (lane_scales), as float32. */
static inline __attribute__((always_inline, target(ISA_VNNI512))) __m512 group_lanes(const void *p, int half, long g) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p + g))
              : _mm512_loadu_ps((const float *)p + g * STRIP);
}

/* One block of one activation row m for a strip's 16 outputs, the integer
 * products in `dot` (exact whatever their order). Each output is computed as
 *
 *   acc = 0
 *   for each group g:  u = fix_g
 *                      for each block b of g:  u = fma(float(xq_b . q_b), d_b, u)
 *                      acc = fma(scale_g, u, acc);  acc = fma(bias_g, xsum_g, acc)
 *
 * whatever the path or the tile. */
static inline __attribute__((always_inline, target(ISA_VNNI512))) void block_step(
    __m512 *u, __m512 *acc, __m512i dot, const activations *a, long m, long b, long blocks, long g, long groups,
    int opens, int closes, lane_scales ls) {
  if (opens) *u = _mm512_set1_ps(a->fix[m * groups + g]);
  *u = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(a->d[m * blocks + b]), *u);
  if (closes) {
    *acc = _mm512_fmadd_ps(group_lanes(ls.scale, ls.half, g), *u, *acc);
    *acc = _mm512_fmadd_ps(group_lanes(ls.bias, ls.half, g), _mm512_set1_ps(a->sum[m * groups + g]), *acc);
  }
}

/* Row m's 4 quantized values from k, as a vector's 16 words */
static inline __attribute__((always_inline, target(ISA_VNNI512))) __m512i four(const activations *a, long m, long K,
                                                                               long k) {
  int32_t word;
  memcpy(&word, a->q + m * K + k, sizeof word);
  return _mm512_set1_epi32(word);
}

/* Block b's products of row m with 8 vectors of the strip's weights (4 values
 * each), in two chains. */
static inline __attribute__((always_inline, target(ISA_VNNI512))) __m512i block_dot(const __m512i w[8],
                                                                                    const activations *a, long m,
                                                                                    long K, long b) {
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
  UNROLL for (int j = 0; j < 8; j += 2) {
    even = _mm512_dpbusd_epi32(even, w[j], four(a, m, K, b * BLOCK + 4 * j));
    odd = _mm512_dpbusd_epi32(odd, w[j + 1], four(a, m, K, b * BLOCK + 4 * j + 4));
  }
  return _mm512_add_epi32(even, odd);
}

/* Columns [0, columns) of a strip's block pair from b: each column's two
 * blocks unpacked (64 bytes), the 16 x 16 matrix of 4-value words transposed:
 * v[j] holds values 4j .. 4j + 3 of the pair (in unpack()'s order, as the
 * activations are quantized) of the 16 columns. */
#define PAIR_OF_STRIP(v, UNPACK, w, row_bytes, b, columns)                                                          \
  UNROLL for (int c = 0; c < STRIP; c++)                                                                            \
    v[c] = c < columns ? _mm512_castsi512_ps(UNPACK(w + c * row_bytes + b * BLOCK * bits / 8, bits))                \
                       : _mm512_setzero_ps();                                                                       \
  transpose16(v);

/* Up to FEW activation rows: out[m][0 .. columns) for m < R, the strip's block
 * pairs unpacked and transposed in registers and taken by every row. */
#define FEW_ROWS(name, isa, UNPACK, bits_, R)                                                                       \
  static inline __attribute__((always_inline, target(isa))) void name##_tile(                                       \
      const long per_group, const uint8_t *w, long row_bytes, long K, int columns, lane_scales ls,                  \
      const activations *a, float *out, long N, fetch ahead[3]) {                                                   \
    const int bits = bits_;                                                                                         \
    long blocks = K / BLOCK, groups = blocks / per_group;                                                           \
    __m512 acc[R], u[R];                                                                                            \
    UNROLL for (int r = 0; r < R; r++) acc[r] = u[r] = _mm512_setzero_ps();                                         \
    for (long b = 0; b < blocks; b += 2) {                                                                          \
      fetch_shares(ahead, blocks / 2);                                                                              \
      __m512 v[STRIP];                                                                                              \
      PAIR_OF_STRIP(v, UNPACK, w, row_bytes, b, columns)                                                            \
      UNROLL for (int h = 0; h < 2; h++) {                                                                          \
        long bb = b + h, g = bb / per_group;                                                                        \
        int opens = bb % per_group == 0, closes = (bb + 1) % per_group == 0;                                        \
        UNROLL for (int r = 0; r < R; r++)                                                                          \
          block_step(&u[r], &acc[r], block_dot((const __m512i *)v + 8 * h, a, r, K, bb), a, r, bb, blocks, g,       \
                     groups, opens, closes, ls);                                                                    \
      }                                                                                                             \
    }                                                                                                               \
    UNROLL for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + r * N, first_lanes(columns), acc[r]);           \
  }                                                                                                                 \
  static __attribute__((target(isa))) void name(const uint8_t *w, long row_bytes, long K, int group, int columns,   \
                                                lane_scales ls, const activations *a, float *out, long N,           \
                                                fetch ahead[3]) {                                                   \
    BY_GROUP(group, name##_tile, w, row_bytes, K, columns, ls, a, out, N, ahead);                                   \
  }

/* The sums of the two 8-lane halves of each of d[0..15] (one column's
 * products of a block pair, lanes 0-7 the first block's), as two vectors of
 * the 16 columns: the first block's in *first, the second's in *second.
 * Integer adds, exact in any order. */
static inline __attribute__((always_inline, target(ISA_VNNI512))) void half_sums(const __m512i d[16], __m512i *first,
                                                                                 __m512i *second) {
  __m512i e[8], f[4], g[2];
  UNROLL for (int i = 0; i < 8; i++) /* chunk q: lanes 4q + {0, 2} and 4q + {1, 3} of columns 2i, 2i + 1 */
    e[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2 * i], d[2 * i + 1]),
                            _mm512_unpackhi_epi32(d[2 * i], d[2 * i + 1]));
  UNROLL for (int i = 0; i < 4; i++) /* chunk q: the sums of chunk q of columns 4i .. 4i + 3 */
    f[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(e[2 * i], e[2 * i + 1]),
                            _mm512_unpackhi_epi64(e[2 * i], e[2 * i + 1]));
  UNROLL for (int i = 0; i < 2; i++) /* first block of columns 8i .. 8i + 3, second's, first of 8i + 4 .., second's */
    g[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(f[2 * i], f[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(f[2 * i], f[2 * i + 1], 0xDD));
  *first = _mm512_shuffle_i32x4(g[0], g[1], 0x88);
  *second = _mm512_shuffle_i32x4(g[0], g[1], 0xDD);
}

/* One activation row (decoding): each column's block pair against the row's
 * as they lie (a vpdpbusd a column), then the 16 columns' sums gathered into
 * lanes by half_sums, fewer instructions than transposing the weights for one
 * row. The same order of float operations as the other tiles. */
#define ONE_ROW(name, isa, UNPACK, bits_)                                                                           \
  static inline __attribute__((always_inline, target(isa))) void name##_tile(                                       \
      const long per_group, const uint8_t *w, long row_bytes, long K, int columns, lane_scales ls,                  \
      const activations *a, float *out, fetch ahead[3]) {                                                           \
    const int bits = bits_;                                                                                         \
    long blocks = K / BLOCK, groups = blocks / per_group;                                                           \
    __m512 acc = _mm512_setzero_ps(), u = _mm512_setzero_ps();                                                      \
    for (long b = 0; b < blocks; b += 2) {                                                                          \
      fetch_shares(ahead, blocks / 2);                                                                              \
      __m512i x = _mm512_loadu_si512(a->q + b * BLOCK), d[STRIP], sums[2];                                          \
      UNROLL for (int c = 0; c < STRIP; c++)                                                                        \
        d[c] = c < columns ? _mm512_dpbusd_epi32(_mm512_setzero_si512(),                                            \
                                                 UNPACK(w + c * row_bytes + b * BLOCK * bits / 8, bits), x)         \
                           : _mm512_setzero_si512();                                                                \
      half_sums(d, &sums[0], &sums[1]);                                                                             \
      UNROLL for (int h = 0; h < 2; h++) {                                                                          \
        long bb = b + h;                                                                                            \
        block_step(&u, &acc, sums[h], a, 0, bb, blocks, bb / per_group, groups, bb % per_group == 0,                \
                   (bb + 1) % per_group == 0, ls);                                                                  \
      }                                                                                                             \
    }                                                                                                               \
    _mm512_mask_storeu_ps(out, first_lanes(columns), acc);                                                          \
  }                                                                                                                 \
  static __attribute__((target(isa))) void name(const uint8_t *w, long row_bytes, long K, int group, int columns,   \
                                                lane_scales ls, const activations *a, float *out, long N,           \
                                                fetch ahead[3]) {                                                   \
    (void)N;                                                                                                        \
    BY_GROUP(group, name##_tile, w, row_bytes, K, columns, ls, a, out, ahead);                                      \
  }

/* A kept strip: the weights as PAIR_OF_STRIP leaves them (v[j] of pair b at
 * (b * 8 + j) * 64 bytes), then (unless the weight's are laid out) the scales
 * and biases as strip_scales or strip_halves leave them. */
typedef struct {
  uint8_t *q;
  lane_scales s;
} strip;

static size_t strip_bytes(long K, int group) { return (size_t)K * STRIP + laid_strip_bytes(K / group, STRIP, 0); }

#define KEEP_STRIP(name, isa, UNPACK, bits_)                                                                        \
  static __attribute__((target(isa))) void name(const uint8_t *w, long row_bytes, long K, int columns, uint8_t *q, \
                                                fetch ahead[3]) {                                                   \
    const int bits = bits_;                                                                                         \
    for (long b = 0; b < K / BLOCK; b += 2) {                                                                       \
      fetch_shares(ahead, K / BLOCK / 2);                                                                           \
      __m512 v[STRIP];                                                                                              \
      PAIR_OF_STRIP(v, UNPACK, w, row_bytes, b, columns)                                                            \
      UNROLL for (int j = 0; j < STRIP; j++) _mm512_storeu_ps(q + (b * 8 + j) * 64, v[j]);                          \
    }                                                                                                               \
  }

/* Rows m0 .. m0 + R of a kept strip's outputs. */
#define KEPT_ROWS(name, R)                                                                                          \
  static inline __attribute__((always_inline, target(ISA_VNNI512))) void name##_tile(                               \
      const long per_group, strip st, const activations *a, long m0, long K, float *out, long N, int columns) {     \
    long blocks = K / BLOCK, groups = blocks / per_group;                                                           \
    __m512 acc[R], u[R];                                                                                            \
    UNROLL for (int r = 0; r < R; r++) acc[r] = u[r] = _mm512_setzero_ps();                                         \
    for (long b = 0; b < blocks; b++) {                                                                             \
      long g = b / per_group;                                                                                       \
      int opens = b % per_group == 0, closes = (b + 1) % per_group == 0;                                            \
      __m512i w[8];                                                                                                 \
      UNROLL for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(st.q + (b * 8 + j) * 64);                        \
      UNROLL for (int r = 0; r < R; r++)                                                                            \
        block_step(&u[r], &acc[r], block_dot(w, a, m0 + r, K, b), a, m0 + r, b, blocks, g, groups, opens, closes,   \
                   st.s);                                                                                           \
    }                                                                                                               \
    UNROLL for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + (m0 + r) * N, first_lanes(columns), acc[r]);    \
  }                                                                                                                 \
  static __attribute__((target(ISA_VNNI512))) void name(strip st, const activations *a, long m0, long K, int group, \
                                                        float *out, long N, int columns) {                          \
    BY_GROUP(group, name##_tile, st, a, m0, K, out, N, columns);                                                    \
  }

typedef void (*few_fn)(const uint8_t *w, long row_bytes, long K, int group, int columns, lane_scales ls,
                       const activations *a, float *out, long N, fetch ahead[3]);
typedef void (*keep_fn)(const uint8_t *w, long row_bytes, long K, int columns, uint8_t *q, fetch ahead[3]);
typedef void (*kept_fn)(strip st, const activations *a, long m0, long K, int group, float *out, long N, int columns);

#define PRODUCTS512(name, isa, UNPACK, bits_)                                                                       \
  ONE_ROW(name##_few1, isa, UNPACK, bits_)                                                                          \
  FEW_ROWS(name##_few2, isa, UNPACK, bits_, 2)                                                                      \
  FEW_ROWS(name##_few3, isa, UNPACK, bits_, 3)                                                                      \
  FEW_ROWS(name##_few4, isa, UNPACK, bits_, 4)                                                                      \
  KEEP_STRIP(name##_keep, isa, UNPACK, bits_)

PRODUCTS512(vnni512_4, ISA_VNNI512, unpack_pair, 4)
PRODUCTS512(vnni512_5, ISA_VNNI512, unpack_pair, 5)
PRODUCTS512(vnni512_8, ISA_VNNI512, unpack_pair, 8)
PRODUCTS512(vnni512_5_vbmi, ISA_VNNI512_VBMI, unpack_pair_vbmi, 5)

KEPT_ROWS(kept1, 1)
KEPT_ROWS(kept2, 2)
KEPT_ROWS(kept3, 3)
KEPT_ROWS(kept4, 4)
KEPT_ROWS(kept5, 5)
KEPT_ROWS(kept6, 6)
KEPT_ROWS(kept7, 7)
KEPT_ROWS(kept8, 8)
static const kept_fn kept_rows[ROWS + 1] = {0, kept1, kept2, kept3, kept4, kept5, kept6, kept7, kept8};

typedef struct {
  few_fn few[FEW + 1];
  keep_fn keep;
} tiles512;

static tiles512 tiles512_for(int bits) {
#define TILES512(p) {{0, p##_few1, p##_few2, p##_few3, p##_few4}, p##_keep}
  static const tiles512 table[4] = {TILES512(vnni512_4), TILES512(vnni512_5), TILES512(vnni512_8),
                                    TILES512(vnni512_5_vbmi)};
#undef TILES512
  if (bits == 5 && tierlm_cpu_has(CPU_AVX512VBMI)) return table[3];
  return table[bits == 4 ? 0 : bits == 5 ? 1 : 2];
}

/* The strip of columns from n (strip_sources), its scales and biases laid
 * out into `at` unless the weight's are. */
static strip strip_from(const int8_job *j, long n, int columns, uint8_t *at, const uint8_t **w, fetch ahead[3]) {
  long groups = j->K / j->group;
  strip st = {at, laid_strip((const char *)at + j->K * STRIP, 0, groups, STRIP, j->half)};
  const char *s, *bias;
  if (strip_sources(j, n, STRIP, w, &st.s, &s, &bias, ahead)) return st;
  if (j->half) {
    strip_halves((const uint16_t *)s, (const uint16_t *)bias, groups, columns, (uint16_t *)st.s.scale,
                 (uint16_t *)st.s.bias);
  } else {
    strip_scales((const float *)s, groups, columns, (float *)st.s.scale);
    strip_scales((const float *)bias, groups, columns, (float *)st.s.bias);
  }
  return st;
}

static __thread void *strips_kept; /* this thread's strips (threads.h) */
static __thread size_t strips_capacity;
#define STRIPS_BYTES 262144 /* strips kept at a time: they stay in the core's cache while the rows sweep them */
#define MOST_KEPT 256       /* STRIPS_BYTES / (K * STRIP) with K >= 64 */

/* Output columns [first, last) of every activation row, a strip at a time
 * (first a whole number of strips). Up to FEW rows: each strip's weights
 * straight from registers. More: a few strips kept, every ROWS rows' tiles
 * over them, and so on. */
static void rows_of512(void *arg, int part, int parts) {
  const int8_job *j = arg;
  long first, last;
  part_columns(j->N, STRIP, part, parts, &first, &last);
  long row_bytes = j->K * j->bits / 8;
  tiles512 t = tiles512_for(j->bits);
  size_t one = strip_bytes(j->K, j->group);
  long at_once = strips_at_once(j->M <= FEW, STRIPS_BYTES, one, MOST_KEPT);
  uint8_t *kept = tierlm_kept_buffer(&strips_kept, &strips_capacity, one * at_once);
  strip st[MOST_KEPT];
  for (long n0 = first; n0 < last; n0 += at_once * STRIP) {
    long count = 0;
    for (long n = n0; n < last && count < at_once; n += STRIP, count++) {
      int columns = strip_width(n, last, STRIP);
      const uint8_t *w;
      fetch ahead[3];
      st[count] = strip_from(j, n, columns, kept + count * one, &w, ahead);
      if (j->M <= FEW)
        t.few[j->M](w, row_bytes, j->K, j->group, columns, st[count].s, j->a, j->out + n, j->N, ahead);
      else
        t.keep(w, row_bytes, j->K, columns, st[count].q, ahead);
    }
    for (long m0 = 0; j->M > FEW && m0 < j->M; m0 += ROWS) {
      int R = j->M - m0 < ROWS ? (int)(j->M - m0) : ROWS;
      for (long i = 0; i < count; i++) {
        long n = n0 + i * STRIP;
        kept_rows[R](st[i], j->a, m0, j->K, j->group, j->out + n, j->N, strip_width(n, last, STRIP));
      }
    }
  }
}

void tierlm_qmm_vnni512(const float *x, long M, long K, const void *w, const void *scales, const void *biases,
                        int half, long N, int bits, int group, float *out, const char *laid) {
  activations a;
  void *buffer = tierlm_quantize_activations(x, M, K, bits, group, PATH_AVX512_VNNI, &a);
  int8_job j = {M, K, N, bits, group, half, w, scales, biases, &a, out, laid};
  tierlm_parallel_chunks(rows_of512, &j, M * N * K < (1L << 16) || N < 64 ? 1 : CHUNKS_PER_THREAD * tierlm_threads());
  free(buffer);
}
