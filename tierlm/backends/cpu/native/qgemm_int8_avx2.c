/* qgemm.c's integer products with AVX2 alone (no VNNI), eight output columns
 * a 256-bit vector: qgemm_vnni512.c's layout for the CPUs every x86-64 server
 * has.
 *
 * The weights of 8 consecutive output columns (a strip) are unpacked a
 * 32-value block at a time and transposed as an 8 x 8 matrix of 4-byte words,
 * so that one vpmaddubsw takes 4 values of one activation row (a broadcast
 * word) against the same 4 values of the 8 columns. Its 16-bit sums are added
 * up over several words before vpmaddwd widens them (4 words for 5-bit
 * weights, 8 for 4-bit: 8 x 2 x 15 x 127 stays below 2^15); 8-bit weights are
 * taken as two 4-bit halves, 16 x high + low, so that no sum saturates. Then
 * one conversion and one multiply-add scale a block for the 8 outputs. One
 * activation row (decoding) multiplies each column's block as it lies (8-bit
 * weights less 128, signed: column_dot) and gathers the 8 columns' sums into
 * lanes with horizontal adds; from two rows the transposed strips are kept in
 * the core's cache while every ROWS rows sweep them. Scales and biases are
 * read as stored (float32 or float16), a strip's transposed the same way, or
 * as a registered weight keeps them laid out (qgemm.c). The activations are quantized as qgemm.c quantizes
 * them (uncentred: the centre goes back through `fix`). Every output
 * is computed in one order (block_step8) whatever the tile or the number of
 * rows: a row has the same bits alone or batched. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm_int8.h"
#include "threads.h"
#include "unpack.h"

#define UNROLL _Pragma("GCC unroll 16")
#define ISA_INT8_AVX2 "avx2,fma,f16c"
#define TARGET8 __attribute__((target(ISA_INT8_AVX2)))
#define INLINE8 static inline __attribute__((always_inline, target(ISA_INT8_AVX2)))

#define STRIP8 8 /* output columns a vector */
#define ROWS8 3  /* activation rows a tile over kept strips takes at most (AVX2 has 16 registers) */

/* The 8 x 8 matrix of 32-bit values in v[0..7] (row i in v[i]) transposed in place. */
INLINE8 void transpose8(__m256 v[8]) {
  __m256 t[8], s[8];
  UNROLL for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  UNROLL for (int i = 0; i < 2; i++) {
    s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  UNROLL for (int k = 0; k < 4; k++) {
    v[k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x20);
    v[4 + k] = _mm256_permute2f128_ps(s[k], s[4 + k], 0x31);
  }
}

/* 8 float16 or float32 (`half`) values from p, the first n of them (others 0) */
INLINE8 __m256 load8(const void *p, int half, long n) {
  uint8_t tail[32] = {0};
  if (n < 8) p = memcpy(tail, p, n * (half ? 2 : 4));
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps(p);
}

/* A strip's scales (or biases) as stored (float16 where `half`), a vector of
 * its columns' for each group: 8 groups at a time transposed (float16 ones as
 * their exact float32 widening, narrowed back). Columns past the matrix's are 0. */
static TARGET8 void strip8_scales(const void *s, int half, long groups, int columns, void *to) {
  long width = half ? 2 : 4;
  for (long g = 0; g < groups; g += 8) {
    __m256 v[STRIP8];
    UNROLL for (int c = 0; c < STRIP8; c++)
      v[c] = c < columns ? load8((const char *)s + (c * groups + g) * width, half, groups - g) : _mm256_setzero_ps();
    transpose8(v);
    for (long i = 0; i < 8 && g + i < groups; i++) {
      if (half)
        _mm_storeu_si128((__m128i *)to + g + i, _mm256_cvtps_ph(v[i], _MM_FROUND_TO_NEAREST_INT));
      else
        _mm256_storeu_ps((float *)to + (g + i) * STRIP8, v[i]);
    }
  }
}

/* Group g's values of a strip's 8 columns (lane_scales), as float32. */
INLINE8 __m256 group_lanes8(const void *p, int half, long g) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + g))
              : _mm256_loadu_ps((const float *)p + g * STRIP8);
}

/* qgemm_vnni512.c's block_step, 8 outputs at once: the same order of float
 * operations for every output. */
INLINE8 void block_step8(__m256 *u, __m256 *acc, __m256i dot, const activations *a, long m, long b, long blocks, long g,
                         long groups, int opens, int closes, lane_scales ls) {
  if (opens) *u = _mm256_set1_ps(a->fix[m * groups + g]);
  *u = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(a->d[m * blocks + b]), *u);
  if (closes) {
    *acc = _mm256_fmadd_ps(group_lanes8(ls.scale, ls.half, g), *u, *acc);
    *acc = _mm256_fmadd_ps(group_lanes8(ls.bias, ls.half, g), _mm256_set1_ps(a->sum[m * groups + g]), *acc);
  }
}

/* Keeps v in a register as it is here: GCC otherwise re-associates a chain of
 * 16-bit adds into a tree of all a run's products at once, which spills the
 * tiles' registers to the stack (kept_dots: 0.81-0.95x the time at 8-16 rows). */
#define IN_ORDER(v) __asm__("" : "+x"(v))

/* Words of 4 values whose vpmaddubsw sums a 16-bit lane holds before they are
 * widened: 4 for 5-bit weights, 8 for 4-bit ones and 8-bit ones' nibble
 * planes (8 x 2 x 15 x 127 < 2^15). */
static inline int run_of(int bits) { return bits == 5 ? 4 : 8; }

/* 16-bit pairs summed into 32-bit lanes */
INLINE8 __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

/* Row m's 4 quantized values from k, as a vector's 8 words */
INLINE8 __m256i four8(const activations *a, long m, long K, long k) {
  int32_t word;
  memcpy(&word, a->q + m * K + k, sizeof word);
  return _mm256_set1_epi32(word);
}

/* ---- one activation row -------------------------------------------------- */

/* One column's block (unpacked, 32 bytes) against the row's block x: 8 lanes
 * of 32-bit partial sums. 8-bit weights (0-255, too wide for vpmaddubsw's
 * unsigned side against a signed x) are taken less 128, signed, their
 * magnitudes against x with their signs (|pairs| <= 2 x 128 x 127, no
 * saturation): 128 x the block's sum of x short (centre8 adds it back). */
INLINE8 __m256i column_dot(__m256i w, __m256i x, int bits) {
  if (bits != 8) return widen(_mm256_maddubs_epi16(w, x));
  __m256i centred = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
  return widen(_mm256_maddubs_epi16(_mm256_abs_epi8(centred), _mm256_sign_epi8(x, centred)));
}

/* 128 x the sum of block x's 32 values, in every lane: what column_dot leaves
 * out of 8-bit weights' products. */
INLINE8 __m256i centre8(__m256i x) {
  __m256i t = widen(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x));
  t = _mm256_add_epi32(t, _mm256_permute2x128_si256(t, t, 1));
  t = _mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0x4E));
  return _mm256_slli_epi32(_mm256_add_epi32(t, _mm256_shuffle_epi32(t, 0xB1)), 7);
}

/* The sums of each of d[0..7]'s lanes, as one vector of the 8 columns. */
INLINE8 __m256i column_sums(const __m256i d[8]) {
  __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  /* a: columns 0-3 over lanes 0-3, then over lanes 4-7; b the same for 4-7 */
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* One activation row against a strip's 8 columns as they lie in memory. */
INLINE8 void one_row(const long per_group, const uint8_t *w, long row_bytes, long K, int columns, lane_scales ls,
                     const activations *a, float *out, fetch ahead[3], const int bits) {
  long blocks = K / BLOCK, groups = blocks / per_group;
  __m256 acc = _mm256_setzero_ps(), u = _mm256_setzero_ps();
  for (long b = 0; b < blocks; b++) {
    fetch_shares(ahead, blocks);
    __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + b * BLOCK)), d[STRIP8];
    UNROLL for (int c = 0; c < STRIP8; c++)
      d[c] = c < columns ? column_dot(unpack(w + c * row_bytes + b * BLOCK * bits / 8, bits), x, bits)
                         : _mm256_setzero_si256();
    __m256i sums = column_sums(d);
    if (bits == 8) sums = _mm256_add_epi32(sums, centre8(x));
    block_step8(&u, &acc, sums, a, 0, b, blocks, b / per_group, groups, b % per_group == 0, (b + 1) % per_group == 0,
                ls);
  }
  float got[STRIP8];
  _mm256_storeu_ps(got, acc);
  memcpy(out, got, columns * sizeof *got);
}

#define ONE_ROW8(name, bits)                                                                                        \
  static TARGET8 void name(const uint8_t *w, long row_bytes, long K, int group, int columns, lane_scales ls,       \
                           const activations *a, float *out, fetch ahead[3]) {                                    \
    BY_GROUP(group, one_row, w, row_bytes, K, columns, ls, a, out, ahead, bits);                                    \
  }

/* ---- a few rows, 4- and 5-bit weights ----------------------------------- */

/* Up to FEW8 activation rows (a few sequences decoding, a short draft): each
 * block of the strip unpacked and transposed in registers, as KEEP_STRIP8
 * lays it out, and taken by every row as KEPT_ROWS8 takes a kept strip (the
 * same 16-bit runs, the same integers), without storing the strip and reading
 * it back. 8-bit weights' two planes of 8 vectors do not fit beside the rows:
 * their few rows are taken as rows alone (rows_alone). */
#define FEW8 4
INLINE8 void few_rows(const long per_group, const uint8_t *w, long row_bytes, long K, int columns, lane_scales ls,
                      const activations *a, float *out, long N, fetch ahead[3], const int bits, const int R) {
  const int run = run_of(bits);
  long blocks = K / BLOCK, groups = blocks / per_group;
  __m256 acc[FEW8], u[FEW8];
  UNROLL for (int r = 0; r < R; r++) acc[r] = u[r] = _mm256_setzero_ps();
  for (long b = 0; b < blocks; b++) {
    fetch_shares(ahead, blocks);
    __m256 v[STRIP8];
    UNROLL for (int c = 0; c < STRIP8; c++)
      v[c] = c < columns ? _mm256_castsi256_ps(unpack(w + c * row_bytes + b * BLOCK * bits / 8, bits))
                         : _mm256_setzero_ps();
    transpose8(v);
    long g = b / per_group;
    int opens = b % per_group == 0, closes = (b + 1) % per_group == 0;
    UNROLL for (int r = 0; r < R; r++) {
      __m256i total = _mm256_setzero_si256();
      UNROLL for (int j0 = 0; j0 < 8; j0 += run) {
        __m256i pairs = _mm256_setzero_si256();
        UNROLL for (int j = j0; j < j0 + run; j++)
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(_mm256_castps_si256(v[j]),
                                                               four8(a, r, K, b * BLOCK + 4 * j)));
        total = _mm256_add_epi32(total, widen(pairs));
      }
      block_step8(&u[r], &acc[r], total, a, r, b, blocks, g, groups, opens, closes, ls);
    }
  }
  UNROLL for (int r = 0; r < R; r++) {
    float got[STRIP8];
    _mm256_storeu_ps(got, acc[r]);
    memcpy(out + r * N, got, columns * sizeof *got);
  }
}

#define FEW_ROWS8(name, bits, R)                                                                                    \
  static TARGET8 void name(const uint8_t *w, long row_bytes, long K, int group, int columns, lane_scales ls,       \
                           const activations *a, float *out, long N, fetch ahead[3]) {                            \
    BY_GROUP(group, few_rows, w, row_bytes, K, columns, ls, a, out, N, ahead, bits, R);                             \
  }

/* ---- kept strips, for two rows and more ---------------------------------- */

/* A kept strip: for each block, `planes` sets (8-bit weights: low nibbles,
 * then high ones) of 8 vectors, vector j holding values 4j .. 4j + 3 of the
 * block (in unpack()'s order) of the 8 columns; then (unless the weight's are
 * laid out) its scales and biases as strip8_scales leaves them. */
typedef struct {
  uint8_t *q;
  lane_scales s;
} strip8;

static int planes_of(int bits) { return bits == 8 ? 2 : 1; }

static size_t strip8_bytes(long K, int group, int bits) {
  return (size_t)K * STRIP8 * planes_of(bits) + laid_strip_bytes(K / group, STRIP8, 0);
}

#define KEEP_STRIP8(name, bits_)                                                                                    \
  static TARGET8 void name(const uint8_t *w, long row_bytes, long K, int columns, uint8_t *q, fetch ahead[3]) {   \
    const int bits = bits_, planes = planes_of(bits);                                                               \
    for (long b = 0; b < K / BLOCK; b++) {                                                                          \
      fetch_shares(ahead, K / BLOCK);                                                                              \
      __m256 v[STRIP8];                                                                                             \
      UNROLL for (int c = 0; c < STRIP8; c++)                                                                       \
        v[c] = c < columns ? _mm256_castsi256_ps(unpack(w + c * row_bytes + b * BLOCK * bits / 8, bits))            \
                           : _mm256_setzero_ps();                                                                   \
      transpose8(v);                                                                                                \
      uint8_t *at = q + b * planes * STRIP8 * 32;                                                                   \
      UNROLL for (int j = 0; j < STRIP8; j++) {                                                                     \
        __m256i word = _mm256_castps_si256(v[j]), low = _mm256_set1_epi8(0x0F);                                     \
        if (planes == 1) {                                                                                          \
          _mm256_storeu_si256((__m256i *)(at + j * 32), word);                                                      \
        } else {                                                                                                    \
          _mm256_storeu_si256((__m256i *)(at + j * 32), _mm256_and_si256(word, low));                               \
          _mm256_storeu_si256((__m256i *)(at + (STRIP8 + j) * 32), _mm256_and_si256(_mm256_srli_epi16(word, 4), low)); \
        }                                                                                                           \
      }                                                                                                             \
    }                                                                                                               \
  }

/* Block b's integer dots of rows m0 .. m0 + R against S kept strips: each
 * word of weights loaded once for the R rows, each row's word broadcast once
 * for the S strips; a plane's 16-bit sums over `run` words at a time (no more
 * than fit), then widened; 8-bit weights' high plane widened x 16. Inlined
 * with bits, R and S constant, every loop unrolls into registers. */
INLINE8 void kept_dots(__m256i dot[ROWS8][2], const strip8 *st, const int bits, const activations *a, long m0,
                       long K, long b, const int R, const int S) {
  const int planes = planes_of(bits), run = run_of(bits);
  UNROLL for (int p = 0; p < planes; p++) {
    UNROLL for (int j0 = 0; j0 < 8; j0 += run) {
      __m256i pairs[ROWS8][2];
      UNROLL for (int r = 0; r < R; r++) UNROLL for (int s = 0; s < S; s++) pairs[r][s] = _mm256_setzero_si256();
      UNROLL for (int j = j0; j < j0 + run; j++) {
        __m256i w[2];
        UNROLL for (int s = 0; s < S; s++)
          w[s] = _mm256_loadu_si256((const __m256i *)(st[s].q + ((b * planes + p) * STRIP8 + j) * 32));
        UNROLL for (int r = 0; r < R; r++) {
          __m256i x = four8(a, m0 + r, K, b * BLOCK + 4 * j);
          UNROLL for (int s = 0; s < S; s++)
            pairs[r][s] = _mm256_add_epi16(pairs[r][s], _mm256_maddubs_epi16(w[s], x));
          UNROLL for (int s = 0; s < S; s++) IN_ORDER(pairs[r][s]);
        }
      }
      __m256i times = _mm256_set1_epi16(p ? 16 : 1);
      UNROLL for (int r = 0; r < R; r++) UNROLL for (int s = 0; s < S; s++) {
        __m256i wide = _mm256_madd_epi16(pairs[r][s], times);
        dot[r][s] = p == 0 && j0 == 0 ? wide : _mm256_add_epi32(dot[r][s], wide);
      }
    }
  }
}

/* Rows m0 .. m0 + R of S kept strips' outputs (kept_dots, then block_step8
 * for each); per_group constant 1 where a group is one block, so that
 * nothing is carried from block to block but the sums. */
INLINE8 void kept_tile(const long per_group, const strip8 *st, const int bits, const activations *a, long m0, long K,
                       float *out, long N, const int *columns, const int R, const int S) {
  long blocks = K / BLOCK, groups = blocks / per_group;
  __m256 acc[ROWS8][2], u[ROWS8][2];
  UNROLL for (int r = 0; r < R; r++) UNROLL for (int s = 0; s < S; s++) acc[r][s] = u[r][s] = _mm256_setzero_ps();
  for (long b = 0; b < blocks; b++) {
    long g = b / per_group;
    int opens = b % per_group == 0, closes = (b + 1) % per_group == 0;
    __m256i dot[ROWS8][2];
    kept_dots(dot, st, bits, a, m0, K, b, R, S);
    UNROLL for (int r = 0; r < R; r++) UNROLL for (int s = 0; s < S; s++)
      block_step8(&u[r][s], &acc[r][s], dot[r][s], a, m0 + r, b, blocks, g, groups, opens, closes, st[s].s);
  }
  UNROLL for (int r = 0; r < R; r++) UNROLL for (int s = 0; s < S; s++) {
    float got[STRIP8];
    _mm256_storeu_ps(got, acc[r][s]);
    memcpy(out + (m0 + r) * N + s * STRIP8, got, columns[s] * sizeof *got);
  }
}

#define KEPT_ROWS8(name, bits, R, S)                                                                                \
  static TARGET8 void name(const strip8 *st, const activations *a, long m0, long K, int group, float *out, long N,  \
                           const int *columns) {                                                                    \
    BY_GROUP(group, kept_tile, st, bits, a, m0, K, out, N, columns, R, S);                                          \
  }

typedef void (*one8_fn)(const uint8_t *w, long row_bytes, long K, int group, int columns, lane_scales ls,
                        const activations *a, float *out, fetch ahead[3]);
typedef void (*few8_fn)(const uint8_t *w, long row_bytes, long K, int group, int columns, lane_scales ls,
                        const activations *a, float *out, long N, fetch ahead[3]);
typedef void (*keep8_fn)(const uint8_t *w, long row_bytes, long K, int columns, uint8_t *q, fetch ahead[3]);
typedef void (*kept8_fn)(const strip8 *st, const activations *a, long m0, long K, int group, float *out, long N,
                         const int *columns);

ONE_ROW8(one8_4, 4)
ONE_ROW8(one8_5, 5)
ONE_ROW8(one8_8, 8)
FEW_ROWS8(few8_4x2, 4, 2)
FEW_ROWS8(few8_4x3, 4, 3)
FEW_ROWS8(few8_4x4, 4, 4)
FEW_ROWS8(few8_5x2, 5, 2)
FEW_ROWS8(few8_5x3, 5, 3)
FEW_ROWS8(few8_5x4, 5, 4)
/* by bits (4, 5), then rows */
static const few8_fn few8_rows[2][FEW8 + 1] = {{0, 0, few8_4x2, few8_4x3, few8_4x4},
                                               {0, 0, few8_5x2, few8_5x3, few8_5x4}};
KEEP_STRIP8(keep8_4, 4)
KEEP_STRIP8(keep8_5, 5)
KEEP_STRIP8(keep8_8, 8)
#define KEPT_SHAPES8(bits)                                                                                          \
  KEPT_ROWS8(kept8_##bits##_1x1, bits, 1, 1)                                                                        \
  KEPT_ROWS8(kept8_##bits##_2x1, bits, 2, 1)                                                                        \
  KEPT_ROWS8(kept8_##bits##_3x1, bits, 3, 1)                                                                        \
  KEPT_ROWS8(kept8_##bits##_1x2, bits, 1, 2)                                                                        \
  KEPT_ROWS8(kept8_##bits##_2x2, bits, 2, 2)                                                                        \
  KEPT_ROWS8(kept8_##bits##_3x2, bits, 3, 2)
KEPT_SHAPES8(4)
KEPT_SHAPES8(5)
KEPT_SHAPES8(8)
/* by bits (4, 5, 8), rows, then strips (1 or 2) */
#define KEPT_TABLE8(bits)                                                                                           \
  {{0}, {0, kept8_##bits##_1x1, kept8_##bits##_1x2}, {0, kept8_##bits##_2x1, kept8_##bits##_2x2},                   \
   {0, kept8_##bits##_3x1, kept8_##bits##_3x2}}
static const kept8_fn kept8_rows[3][ROWS8 + 1][3] = {KEPT_TABLE8(4), KEPT_TABLE8(5), KEPT_TABLE8(8)};

static __thread void *strips8_kept; /* this thread's strips (threads.h) */
static __thread size_t strips8_capacity;
#define STRIPS8_BYTES 131072 /* strips kept at a time: they stay in the core's cache while the rows sweep them */
#define MOST_KEPT8 512       /* STRIPS8_BYTES / (K * STRIP8) with K >= 32 */

/* The strip of columns from n (strip_sources), its scales and biases laid
 * out into `at` unless the weight's are. */
static strip8 strip8_from(const int8_job *j, long n, int columns, uint8_t *at, const uint8_t **w, fetch ahead[3]) {
  long groups = j->K / j->group;
  strip8 st = {at, laid_strip((const char *)at + j->K * STRIP8 * planes_of(j->bits), 0, groups, STRIP8, j->half)};
  const char *s, *bias;
  if (!strip_sources(j, n, STRIP8, w, &st.s, &s, &bias, ahead)) {
    strip8_scales(s, j->half, groups, columns, (void *)st.s.scale);
    strip8_scales(bias, j->half, groups, columns, (void *)st.s.bias);
  }
  return st;
}

/* The strip's products for each of `rows` activation rows as a row alone
 * (`one`): its weights read from memory by the first, from the core's cache
 * by the others; the next strip fetched once. Up to FEW8 rows of 8-bit
 * weights: their kept strips (two nibble planes, stored and read back) cost
 * more there (the output head of Qwen2.5-Coder at 2 rows 20.7 -> 13.3 ms,
 * at 4 rows 25.1 -> 24.6; from 8 rows the kept strips win). The same bits:
 * a row alone is what every batch's row gives. */
static void rows_alone(one8_fn one, const uint8_t *w, long row_bytes, const int8_job *j, int columns, lane_scales ls,
                       long n, long rows, fetch ahead[3]) {
  fetch none[3] = {fetch_of(NULL, 0), fetch_of(NULL, 0), fetch_of(NULL, 0)};
  for (long m = 0; m < rows; m++) {
    activations row = activations_row(j->a, m, j->K, j->group);
    one(w, row_bytes, j->K, j->group, columns, ls, &row, j->out + m * j->N + n, m ? none : ahead);
  }
}

/* Output columns [first, last) of every activation row, a strip at a time
 * (first a whole number of strips): one row straight from the packing, up to
 * FEW8 from registers (4- and 5-bit weights) or each as a row alone (8-bit);
 * more, a few strips kept, every ROWS8 rows' tiles over them, and so on. */
static void rows_of8(void *arg, int part, int parts) {
  const int8_job *j = arg;
  long first, last;
  part_columns(j->N, STRIP8, part, parts, &first, &last);
  long row_bytes = j->K * j->bits / 8;
  int which = j->bits == 4 ? 0 : j->bits == 5 ? 1 : 2;
  one8_fn one = (const one8_fn[]){one8_4, one8_5, one8_8}[which];
  keep8_fn keep = (const keep8_fn[]){keep8_4, keep8_5, keep8_8}[which];
  few8_fn few = j->M > 1 && j->M <= FEW8 && j->bits != 8 ? few8_rows[which][j->M] : NULL;
  long alone = j->M == 1 || (j->bits == 8 && j->M <= FEW8) ? j->M : 0; /* rows taken as rows alone */
  size_t size = strip8_bytes(j->K, j->group, j->bits);
  long at_once = strips_at_once(alone || few, STRIPS8_BYTES, size, MOST_KEPT8);
  uint8_t *kept = tierlm_kept_buffer(&strips8_kept, &strips8_capacity, size * at_once);
  strip8 st[MOST_KEPT8];
  for (long n0 = first; n0 < last; n0 += at_once * STRIP8) {
    long count = 0;
    for (long n = n0; n < last && count < at_once; n += STRIP8, count++) {
      int columns = strip_width(n, last, STRIP8);
      const uint8_t *w;
      fetch ahead[3];
      st[count] = strip8_from(j, n, columns, kept + count * size, &w, ahead);
      if (alone)
        rows_alone(one, w, row_bytes, j, columns, st[count].s, n, alone, ahead);
      else if (few)
        few(w, row_bytes, j->K, j->group, columns, st[count].s, j->a, j->out + n, j->N, ahead);
      else
        keep(w, row_bytes, j->K, columns, st[count].q, ahead);
    }
    for (long m0 = 0; !alone && !few && m0 < j->M; m0 += ROWS8) {
      int R = j->M - m0 < ROWS8 ? (int)(j->M - m0) : ROWS8;
      for (long i = 0; i < count; i += 2) {
        int S = count - i >= 2 ? 2 : 1, columns[2];
        for (int s = 0; s < S; s++) columns[s] = strip_width(n0 + (i + s) * STRIP8, last, STRIP8);
        kept8_rows[which][R][S](st + i, j->a, m0, j->K, j->group, j->out + n0 + i * STRIP8, j->N, columns);
      }
    }
  }
}

void tierlm_qmm_int8_avx2(const float *x, long M, long K, const void *w, const void *scales, const void *biases,
                          int half, long N, int bits, int group, float *out, const char *laid) {
  activations a;
  void *buffer = tierlm_quantize_activations(x, M, K, bits, group, PATH_AVX2_INT8, &a);
  int8_job j = {M, K, N, bits, group, half, w, scales, biases, &a, out, laid};
  tierlm_parallel_chunks(rows_of8, &j, M * N * K < (1L << 16) || N < 64 ? 1 : CHUNKS_PER_THREAD * tierlm_threads());
  free(buffer);
}
