/* qgemm.c's integer products with AVX-512 VNNI, two blocks a 512-bit vector.
 *
 * Each vector holds two consecutive 32-value blocks (lanes 0-7 the first, 8-15
 * the second), so a block pair costs one vpdpbusd, one conversion and one
 * multiply-add where the 8-lane paths pay two of each, and the weights are
 * unpacked two blocks at a time. For one activation row (decoding) this makes
 * the product bound by reading the weights, as llama.cpp's is, instead of by
 * the instructions of float32 dequantization (about three times as many a
 * weight). Scales and biases are read as stored (float32 or float16). The
 * activations are quantized as qgemm.c quantizes them (uncentred: the centre
 * goes back through `fix`); every output is one chain over the block pairs in
 * order, its groups' terms added to its lanes, then one horizontal sum,
 * whatever the tile: a row has the same bits alone or batched. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_features.h"
#include "qgemm_int8.h"
#include "threads.h"
#include "unpack.h"

#define UNROLL _Pragma("GCC unroll 16")
#define PANEL_ROWS 16       /* from this many activation rows, weights are unpacked once into panels */
#define PANEL_BYTES 262144  /* a panel's size: it stays in the core's cache while the tiles sweep it */
#define COLUMNS 32          /* weight rows a few activation rows' tiles sweep together */

static __thread void *panel_kept; /* this thread's panel (threads.h) */
static __thread size_t panel_capacity;

typedef void (*unpack_rows_fn)(const uint8_t *wrow, long row_bytes, long K, long rows, uint8_t *panel);

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

/* a as the low half of a vector, b as its high half (without AVX-512 DQ) */
static inline __attribute__((always_inline, target(ISA_VNNI512))) __m512 halves(__m256 a, __m256 b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

/* A weight row's scales of blocks b and b + 1 (of groups g and g2) as one
 * vector, from float32 or float16 (`half`) scales s. */
static inline __attribute__((always_inline, target(ISA_VNNI512))) __m512 scale_pair(const void *s, int half, long g,
                                                                                   long g2) {
  const __m512i low_high = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  if (half) { /* g2 is g or g + 1 */
    const uint16_t *h = s;
    if (g == g2) return _mm512_set1_ps(_cvtsh_ss(h[g]));
    uint32_t two;
    memcpy(&two, h + g, sizeof two);
    return _mm512_permutexvar_ps(low_high, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)two))));
  }
  const float *f = s;
  if (g == g2) return _mm512_set1_ps(f[g]);
  return _mm512_permutexvar_ps(low_high, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(f + g)))));
}

static inline __attribute__((always_inline, target(ISA_VNNI512))) float hsum512(__m512 v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* n float16 values widened into `to` */
static inline __attribute__((always_inline, target(ISA_VNNI512))) void widen512(const void *from, long n, float *to) {
  const uint16_t *h = from;
  for (long i = 0; i < n; i += 16) {
    __mmask16 in = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(to + i, in, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, h + i)));
  }
}

/* Each output's groups' terms (sum_g bias_g * xsum_g + scale_g * fix_g, 16
 * groups a vector) added to its products' lanes (acc, R x C of them, row after
 * row), then the lanes summed into out[r * C + c]: one horizontal sum an
 * output. Float16 scales and biases are widened once for the tile's rows. */
static inline __attribute__((always_inline, target(ISA_VNNI512))) void groups_terms(
    const void *s, const void *bias, int half, const activations *a, long m0, int R, int C, long K, int group,
    __m512 *acc, float *out) {
  long groups = K / group;
  float wide[half ? 2 * C * groups : 1];
  if (half) {
    widen512(s, C * groups, wide);
    widen512(bias, C * groups, wide + C * groups);
    s = wide, bias = wide + C * groups;
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) {
      const float *sum = a->sum + (m0 + r) * groups, *fix = a->fix + (m0 + r) * groups;
      const float *bc = (const float *)bias + c * groups, *sc = (const float *)s + c * groups;
      __m512 total = acc[r * C + c];
      for (long g = 0; g < groups; g += 16) {
        __mmask16 in = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
        total = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, bc + g), _mm512_maskz_loadu_ps(in, sum + g), total);
        total = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, sc + g), _mm512_maskz_loadu_ps(in, fix + g), total);
      }
      out[r * C + c] = hsum512(total);
    }
}

/* qgemm.c's TILE_BODY two blocks a step: R activation rows x C weight rows,
 * the weights unpacked here (UNPACK) or read from a panel (pairs of blocks, see
 * unpack_pairs). Every output is one chain over the block pairs in order, then
 * the same horizontal sum, whatever the tile. */
#define TILE512_BODY(UNPACK, R, C, PANEL)                                                                           \
  long blocks = K / BLOCK, per_group = group / BLOCK, step = BLOCK * bits / 8, groups = K / group;                  \
  const char *ahead = (const char *)wrow + C * row_bytes;                                                           \
  long lines = (C * row_bytes + 63) / 64, share = 0;                                                                \
  __m512 acc[R][C];                                                                                                 \
  UNROLL for (int r = 0; r < R; r++)                                                                                \
    UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();                                             \
  for (long b = 0; b < blocks; b += 2) {                                                                            \
    for (share += 2 * lines; !PANEL && share >= blocks; share -= blocks, ahead += 64)                               \
      _mm_prefetch(ahead, _MM_HINT_T0);                                                                             \
    __m512 d[R];                                                                                                    \
    __m512i q[R];                                                                                                   \
    UNROLL for (int r = 0; r < R; r++) {                                                                            \
      const float *dr = a->d + (m0 + r) * blocks + b;                                                               \
      d[r] = halves(_mm256_set1_ps(dr[0]), _mm256_set1_ps(dr[1]));                                                  \
      q[r] = _mm512_loadu_si512(a->q + (m0 + r) * K + b * BLOCK);                                                   \
    }                                                                                                               \
    UNROLL for (int c = 0; c < C; c++) {                                                                            \
      __m512i w = PANEL ? _mm512_loadu_si512(panel + (b / 2 * C + c) * 2 * BLOCK)                                   \
                        : UNPACK(wrow + c * row_bytes + b * step, bits);                                            \
      __m512 scale = scale_pair((const char *)s + c * groups * (half ? 2 : 4), half, b / per_group,                 \
                                (b + 1) / per_group);                                                               \
      UNROLL for (int r = 0; r < R; r++) {                                                                          \
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, q[r]);                                         \
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, d[r]), acc[r][c]);                \
      }                                                                                                             \
    }                                                                                                               \
  }                                                                                                                 \
  groups_terms(s, bias, half, a, m0, R, C, K, group, acc[0], out);

typedef void (*tile512_fn)(const uint8_t *wrow, long row_bytes, const void *s, const void *bias, int half,
                           const uint8_t *panel, const activations *a, long m0, long K, int group, float *out);

#define TILE512(name, isa, UNPACK, bits_, R, C, PANEL)                                                              \
  static __attribute__((target(isa))) void name(const uint8_t *wrow, long row_bytes, const void *s,                 \
                                                const void *bias, int half, const uint8_t *panel,                   \
                                                const activations *a, long m0, long K, int group, float *out) {     \
    const int bits = bits_;                                                                                         \
    TILE512_BODY(UNPACK, R, C, PANEL)                                                                               \
  }

/* `rows` weight rows (a multiple of 4) unpacked into panel as the 4 x 4 tile
 * reads them: each 4 rows block pair by block pair (pair p of row c at
 * (4p + c) * 64 bytes from the four rows' start). */
#define UNPACK_PAIRS(name, isa, UNPACK, bits_)                                                                      \
  static __attribute__((target(isa))) void name(const uint8_t *wrow, long row_bytes, long K, long rows,             \
                                                uint8_t *panel) {                                                   \
    const int bits = bits_;                                                                                         \
    for (long c = 0; c < rows; c++)                                                                                 \
      for (long b = 0; b < K / BLOCK; b += 2)                                                                       \
        _mm512_storeu_si512(panel + c / 4 * 4 * K + (b / 2 * 4 + c % 4) * 2 * BLOCK,                                \
                            UNPACK(wrow + c * row_bytes + b * BLOCK * bits / 8, bits));                             \
  }

/* The tiles: 4 x 4 (and from a panel) for every four activation rows of a
 * long batch; for up to SHORT rows, one tile of them all (a row decoding, a few
 * verifying draft tokens, a short batch), so that the weights are read once:
 * 1 x 8, 2 x 4, 3 x 4, 4 x 4, 5-8 x 2, each with its r x 1 for the columns
 * left over. */
#define SHORT 8
#define PRODUCTS512(name, isa, UNPACK, bits_)                                                                       \
  TILE512(name##_4x4_panel, isa, UNPACK, bits_, 4, 4, 1)                                                            \
  TILE512(name##_1x8, isa, UNPACK, bits_, 1, 8, 0)                                                                  \
  TILE512(name##_2x4, isa, UNPACK, bits_, 2, 4, 0)                                                                  \
  TILE512(name##_3x4, isa, UNPACK, bits_, 3, 4, 0)                                                                  \
  TILE512(name##_4x4, isa, UNPACK, bits_, 4, 4, 0)                                                                  \
  TILE512(name##_5x2, isa, UNPACK, bits_, 5, 2, 0)                                                                  \
  TILE512(name##_6x2, isa, UNPACK, bits_, 6, 2, 0)                                                                  \
  TILE512(name##_7x2, isa, UNPACK, bits_, 7, 2, 0)                                                                  \
  TILE512(name##_8x2, isa, UNPACK, bits_, 8, 2, 0)                                                                  \
  TILE512(name##_1x1, isa, UNPACK, bits_, 1, 1, 0)                                                                  \
  TILE512(name##_2x1, isa, UNPACK, bits_, 2, 1, 0)                                                                  \
  TILE512(name##_3x1, isa, UNPACK, bits_, 3, 1, 0)                                                                  \
  TILE512(name##_4x1, isa, UNPACK, bits_, 4, 1, 0)                                                                  \
  TILE512(name##_5x1, isa, UNPACK, bits_, 5, 1, 0)                                                                  \
  TILE512(name##_6x1, isa, UNPACK, bits_, 6, 1, 0)                                                                  \
  TILE512(name##_7x1, isa, UNPACK, bits_, 7, 1, 0)                                                                  \
  TILE512(name##_8x1, isa, UNPACK, bits_, 8, 1, 0)                                                                  \
  UNPACK_PAIRS(name##_pairs, isa, UNPACK, bits_)

PRODUCTS512(vnni512_4, ISA_VNNI512, unpack_pair, 4)
PRODUCTS512(vnni512_5, ISA_VNNI512, unpack_pair, 5)
PRODUCTS512(vnni512_8, ISA_VNNI512, unpack_pair, 8)
PRODUCTS512(vnni512_5_vbmi, ISA_VNNI512_VBMI, unpack_pair_vbmi, 5)

typedef struct {
  tile512_fn panel, few[SHORT + 1], few1[SHORT + 1]; /* by rows: r x columns_of(r), r x 1 */
  unpack_rows_fn unpack_rows;
} tiles512;

/* the columns a tile of `rows` activation rows (up to SHORT) covers */
static int columns_of(long rows) { return rows == 1 ? 8 : rows <= 4 ? 4 : 2; }

static tiles512 tiles512_for(int bits) {
#define TILES512(p)                                                                                                 \
  {p##_4x4_panel,                                                                                                   \
   {0, p##_1x8, p##_2x4, p##_3x4, p##_4x4, p##_5x2, p##_6x2, p##_7x2, p##_8x2},                                     \
   {0, p##_1x1, p##_2x1, p##_3x1, p##_4x1, p##_5x1, p##_6x1, p##_7x1, p##_8x1},                                     \
   p##_pairs}
  static const tiles512 table[4] = {TILES512(vnni512_4), TILES512(vnni512_5), TILES512(vnni512_8),
                                    TILES512(vnni512_5_vbmi)};
#undef TILES512
  if (bits == 5 && tierlm_cpu_has(CPU_AVX512VBMI)) return table[3];
  return table[bits == 4 ? 0 : bits == 5 ? 1 : 2];
}

typedef struct {
  long M, K, N;
  int bits, group, half;
  const uint8_t *w;
  const void *scales, *biases; /* float32, or float16 where `half` */
  const activations *a;
  float *out;
} job512;

/* Tile (m0, n0) of R x C outputs. */
static void tile512_at(const job512 *j, tile512_fn tile, int R, int C, long m0, long n0, const uint8_t *panel) {
  long groups = j->K / j->group, row_bytes = j->K * j->bits / 8, width = j->half ? 2 : 4;
  float got[16];
  tile(j->w + n0 * row_bytes, row_bytes, (const char *)j->scales + n0 * groups * width,
       (const char *)j->biases + n0 * groups * width, j->half, panel, j->a, m0, j->K, j->group, got);
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) j->out[(m0 + r) * j->N + n0 + c] = got[r * C + c];
}

/* Output columns [first, last) of every activation row. Up to SHORT rows: one
 * tile of them all across the columns. More: 4 x 4 tiles over every four rows,
 * a block of weight rows at a time (unpacked into a panel first from
 * PANEL_ROWS rows), the columns they leave by 4 x 1, and the rows they leave by
 * one tile of those. */
static void rows_of512(void *arg, int part, int parts) {
  const job512 *j = arg;
  long first = j->N * part / parts, last = j->N * (part + 1) / parts;
  tiles512 t = tiles512_for(j->bits);
  long tiled = j->M <= SHORT ? 0 : j->M / 4 * 4, quads = first + (last - first) / 4 * 4;
  long row_bytes = j->K * j->bits / 8;
  int many = j->M >= PANEL_ROWS;
  long step = many ? (PANEL_BYTES / j->K / 4 + 1) * 4 : COLUMNS;
  uint8_t *panel = many ? tierlm_kept_buffer(&panel_kept, &panel_capacity, step * j->K) : NULL;
  for (long n0 = first; tiled && n0 < quads; n0 += step) {
    long end = n0 + step < quads ? n0 + step : quads;
    if (many) t.unpack_rows(j->w + n0 * row_bytes, row_bytes, j->K, end - n0, panel);
    for (long m0 = 0; m0 < tiled; m0 += 4)
      for (long n = n0; n < end; n += 4)
        tile512_at(j, many ? t.panel : t.few[4], 4, 4, m0, n, many ? panel + (n - n0) * j->K : NULL);
  }
  for (long m0 = 0; m0 < tiled; m0 += 4)
    for (long n = quads; n < last; n++) tile512_at(j, t.few1[4], 4, 1, m0, n, NULL);
  int left = (int)(j->M - tiled), width = columns_of(left);
  if (left) {
    long n = first;
    for (; n + width <= last; n += width) tile512_at(j, t.few[left], left, width, tiled, n, NULL);
    for (; n < last; n++) tile512_at(j, t.few1[left], left, 1, tiled, n, NULL);
  }
}

void tierlm_qmm_vnni512(const float *x, long M, long K, const void *w, const void *scales, const void *biases,
                        int half, long N, int bits, int group, float *out) {
  activations a;
  void *buffer = tierlm_quantize_activations(x, M, K, bits, group, PATH_AVX512_VNNI, &a);
  job512 j = {M, K, N, bits, group, half, w, scales, biases, &a, out};
  tierlm_parallel(rows_of512, &j, M * N * K < (1L << 16) || N < 64 ? 1 : 64);
  free(buffer);
}

