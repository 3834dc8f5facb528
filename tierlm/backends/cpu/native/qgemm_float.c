/* MLX's affine-quantized matmul in float32 (qgemm.c's float paths), written
 * once over simd.h's vectors and compiled for AVX-512 (16 lanes) and for AVX2
 * with FMA (8 lanes) by float_avx512.c and float_avx2.c; qgemm.c calls
 * tierlm_qmm_float_avx512 or tierlm_qmm_float_avx2:
 *
 *   out[m][n] = sum_k x[m][k] * (scale[n][k/g] * q[n][k] + bias[n][k/g])
 *
 * Each 32-value block of a weight row is unpacked (unpack.h), turned into
 * vectors of floats (q * scale + bias, one fused multiply-add) and multiplied
 * into the accumulators of every activation row of its tile. A tile of R
 * activation rows x C weight rows unpacks each block once for its R rows; with
 * many activation rows (prompts, large batches) a block of weight rows is
 * dequantized once into a panel that every tile of rows then reads, so the
 * unpacking is paid once per product instead of once per R rows. The
 * activations stay float32: the product is the dequantized weights' own.
 * The tiles are sized for the registers: AVX-512 has 32, AVX2 16.
 *
 * Every output element is one chain of fused multiply-adds over K in one order
 * (VL lanes), then the same horizontal sum, whether its weights came unpacked
 * or from a panel and whatever the tile or the split over the cores: a row has
 * the same bits alone or batched. */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_features.h"
#include "threads.h"
#include "unpack.h"

#define BLOCK 32
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

#if VL == 16
/* Whether 5-bit blocks are unpacked with AVX-512 VBMI: on CPUs that have it,
 * unless turned off (tests compare the two). */
static int vbmi = -1;

static int vbmi_available(void) {
  return tierlm_cpu_has(CPU_AVX512VBMI) && tierlm_cpu_has(CPU_AVX512BW) && tierlm_cpu_has(CPU_AVX512VL);
}

/* on: 1 or 0 to choose (1 only where the CPU has it), -1 to ask; returns the choice in force. */
int tierlm_qmm_avx512_vbmi(int on) {
  if (on >= 0 || vbmi < 0) vbmi = on != 0 && vbmi_available();
  return vbmi;
}

/* Half v of an unpacked block as float32 q * scale + bias. */
INLINE vf dequantized(__m256i u, int v, vf scale, vf bias) {
  __m512i lanes = _mm512_cvtepu8_epi32(v ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), scale, bias);
}

/* The lanes' sum, as one pairwise tree. */
INLINE float lanes_sum(vf v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
/* Quarter v of an unpacked block as float32 q * scale + bias. */
INLINE vf dequantized(__m256i u, int v, vf scale, vf bias) {
  __m128i half = v < 2 ? _mm256_castsi256_si128(u) : _mm256_extracti128_si256(u, 1);
  __m256i lanes = _mm256_cvtepu8_epi32(v & 1 ? _mm_srli_si128(half, 8) : half);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), scale, bias);
}

INLINE float lanes_sum(vf v) { return vf_reduce_add(v); }
#endif

#define SHORT 8 /* up to this many activation rows make one tile: each weight block unpacked once */

/* n float16 values widened into `to`, a vector at a time. Scales and biases
 * may come as float16, as the GGUF importer keeps them (`half`): a decode step
 * streams every one, so they take half the bytes; a tile (and the panel's
 * dequantizer) widens its rows' once, exactly, and its inner loop reads
 * float32 as before. */
INLINE void widen_halves(const uint16_t *from, long n, float *to) {
  long i = 0;
#if VL == 16
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(to + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(from + i))));
#else
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(from + i))));
#endif
  for (; i < n; i++) to[i] = _cvtsh_ss(from[i]);
}

static __thread void *packed_kept, *panel_kept; /* this thread's scratch (threads.h) */
static __thread size_t packed_capacity, panel_capacity;

/* sum_k w[c][k] x[r][k] for R activation rows (x, packed) times C weight rows,
 * into out[r * C + c]. The weights come either packed, from wrow (row_bytes
 * apart, unpacked here block by block, the next tile's rows prefetched a share a
 * block), or (PANEL) dequantized, from panel (see dequantize). `bits` is a
 * constant in each instance. */
#define TILE_BODY(UNPACK, R, C, PANEL)                                                                          \
  long per_group = group / BLOCK, step = BLOCK * bits / 8, groups = K / group, blocks = K / BLOCK;              \
  const char *ahead = (const char *)wrow + C * row_bytes; /* a prefetch past the end never faults */            \
  long lines = (C * row_bytes + 63) / 64, share = 0;                                                            \
  vf acc[R][C];                                                                                                 \
  float widened[PANEL || !half ? 1 : 2 * C * groups];                                                          \
  const float *s32 = s, *bias32 = bias;                                                                         \
  if (!PANEL && half) {                                                                                         \
    widen_halves(s, C * groups, widened);                                                                       \
    widen_halves(bias, C * groups, widened + C * groups);                                                       \
    s32 = widened, bias32 = widened + C * groups;                                                               \
  }                                                                                                             \
  UNROLL for (int r = 0; r < R; r++) UNROLL for (int c = 0; c < C; c++) acc[r][c] = vf_zero();                  \
  for (long g = 0, b = 0; g < groups; g++) {                                                                    \
    vf scale[C], bias_of[C];                                                                                    \
    UNROLL for (int c = 0; c < C; c++) if (!PANEL) {                                                            \
      scale[c] = vf_set1(s32[c * groups + g]);                                                                  \
      bias_of[c] = vf_set1(bias32[c * groups + g]);                                                             \
    }                                                                                                           \
    for (long bb = 0; bb < per_group; bb++, b++, x += R * BLOCK) {                                              \
      __m256i u[C];                                                                                             \
      if (!PANEL) {                                                                                             \
        for (share += lines; share >= blocks; share -= blocks, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T0);   \
        UNROLL for (int c = 0; c < C; c++) u[c] = UNPACK(wrow + c * row_bytes + b * step, bits);                \
      }                                                                                                         \
      UNROLL for (int v = 0; v < BLOCK / VL; v++) {                                                             \
        vf w[C];                                                                                                \
        UNROLL for (int c = 0; c < C; c++)                                                                      \
          w[c] = PANEL ? vf_load(panel + (b * C + c) * BLOCK + v * VL)                                          \
                       : dequantized(u[c], v, scale[c], bias_of[c]);                                            \
        UNROLL for (int r = 0; r < R; r++) {                                                                    \
          vf xv = vf_load(x + r * BLOCK + v * VL);                                                              \
          UNROLL for (int c = 0; c < C; c++) acc[r][c] = vf_fmadd(w[c], xv, acc[r][c]);                         \
        }                                                                                                       \
      }                                                                                                         \
    }                                                                                                           \
  }                                                                                                             \
  UNROLL for (int r = 0; r < R; r++) UNROLL for (int c = 0; c < C; c++) out[r * C + c] = lanes_sum(acc[r][c]);

typedef void (*tile_fn)(const uint8_t *wrow, long row_bytes, const void *s, const void *bias, int half,
                        const float *panel, const float *x, long K, int group, float *out);

#define TILE(name, isa, UNPACK, bits_, R, C, PANEL)                                                             \
  static isa void name(const uint8_t *wrow, long row_bytes, const void *s, const void *bias, int half,        \
                       const float *panel, const float *x, long K, int group, float *out) {                     \
    const int bits = bits_;                                                                                     \
    TILE_BODY(UNPACK, R, C, PANEL)                                                                              \
  }

/* `rows` weight rows from wrow (a multiple of C) dequantized into panel: the
 * values TILE_BODY computes, each C rows block by block (block b of row c at
 * (b * C + c) * 32 floats from the C rows' start, C * K floats a group), so a
 * tile reads its weights as one stream, as it reads its activations. */
typedef void (*dequantize_fn)(const uint8_t *wrow, long row_bytes, const void *s, const void *bias, int half,
                              long K, int group, long rows, float *panel);

#define DEQUANTIZE(name, isa, UNPACK, bits_)                                                                    \
  static isa void name(const uint8_t *wrow, long row_bytes, const void *s, const void *bias, int half, long K, \
                       int group, long rows, float *panel) {                                                    \
    const int bits = bits_;                                                                                     \
    long groups = K / group, step = BLOCK * bits / 8;                                                           \
    float widened[half ? 2 * groups : 1];                                                                       \
    for (long c = 0; c < rows; c++) {                                                                           \
      const float *s32 = (const float *)s + c * groups, *bias32 = (const float *)bias + c * groups;             \
      if (half) {                                                                                               \
        widen_halves((const uint16_t *)s + c * groups, groups, widened);                                        \
        widen_halves((const uint16_t *)bias + c * groups, groups, widened + groups);                            \
        s32 = widened, bias32 = widened + groups;                                                               \
      }                                                                                                         \
      for (long b = 0; b < K / BLOCK; b++) {                                                                    \
        long g = b * BLOCK / group;                                                                             \
        vf scale = vf_set1(s32[g]), shift = vf_set1(bias32[g]);                                                 \
        __m256i u = UNPACK(wrow + c * row_bytes + b * step, bits);                                              \
        float *to = panel + c / C * C * K + (b * C + c % C) * BLOCK;                                            \
        UNROLL for (int v = 0; v < BLOCK / VL; v++) vf_store(to + v * VL, dequantized(u, v, scale, shift));     \
      }                                                                                                         \
    }                                                                                                           \
  }

/* The tiles: R x C (prompts and batches), R x 1 (the columns those leave),
 * and for the rows after the last full tile (one row decoding, a few verifying
 * draft tokens) r x FEW_C and r x 1, each weight block unpacked once for all of
 * them; and the panel's dequantizer. With AVX-512's 32 registers, 4 x 4 keeps
 * 16 accumulators, 4 weight vectors and the scales in registers (one row: four
 * independent chains, ~5% faster than eight there); with AVX2's 16, 4 x 3 and
 * for one to three rows r x 2. */
#define ISA
#if VL == 16
#define R 4
#define C 4
#define FEW_C 4 /* the columns of a tile of 1 to 3 rows; 5 to 8 rows take 2 */
#define FEW(b, name, isa, UNPACK)                                                                               \
  TILE(r1x4_##name, isa, UNPACK, b, 1, 4, 0)                                                                    \
  TILE(r2x4_##name, isa, UNPACK, b, 2, 4, 0)                                                                    \
  TILE(r3x4_##name, isa, UNPACK, b, 3, 4, 0)                                                                    \
  TILE(r5x2_##name, isa, UNPACK, b, 5, 2, 0)                                                                    \
  TILE(r6x2_##name, isa, UNPACK, b, 6, 2, 0)                                                                    \
  TILE(r7x2_##name, isa, UNPACK, b, 7, 2, 0)                                                                    \
  TILE(r8x2_##name, isa, UNPACK, b, 8, 2, 0)                                                                    \
  static const tile_fn few_##name[SHORT + 1] = {0, r1x4_##name, r2x4_##name, r3x4_##name, big_##name,           \
                                                r5x2_##name, r6x2_##name, r7x2_##name, r8x2_##name};
#else
#define R 4
#define C 3 /* 12 accumulators, 3 weight vectors and the activations' in 16 registers: 4 x 2 was ~1.4x slower */
#define FEW_C 2 /* the columns of a tile of 1 to 3 rows (more were slower); 5 to 8 rows take 1 */
#define FEW(b, name, isa, UNPACK)                                                                               \
  TILE(r1x2_##name, isa, UNPACK, b, 1, 2, 0)                                                                    \
  TILE(r2x2_##name, isa, UNPACK, b, 2, 2, 0)                                                                    \
  TILE(r3x2_##name, isa, UNPACK, b, 3, 2, 0)                                                                    \
  static const tile_fn few_##name[SHORT + 1] = {0, r1x2_##name, r2x2_##name, r3x2_##name, big_##name,           \
                                                r5x1_##name, r6x1_##name, r7x1_##name, r8x1_##name};
#endif
#define WIDTH(b, name, isa, UNPACK)                                                                             \
  TILE(big_##name, isa, UNPACK, b, R, C, 0)                                                                     \
  TILE(rx1_##name, isa, UNPACK, b, R, 1, 0)                                                                     \
  TILE(r1x1_##name, isa, UNPACK, b, 1, 1, 0)                                                                    \
  TILE(r2x1_##name, isa, UNPACK, b, 2, 1, 0)                                                                    \
  TILE(r3x1_##name, isa, UNPACK, b, 3, 1, 0)                                                                    \
  TILE(r5x1_##name, isa, UNPACK, b, 5, 1, 0)                                                                    \
  TILE(r6x1_##name, isa, UNPACK, b, 6, 1, 0)                                                                    \
  TILE(r7x1_##name, isa, UNPACK, b, 7, 1, 0)                                                                    \
  TILE(r8x1_##name, isa, UNPACK, b, 8, 1, 0)                                                                    \
  FEW(b, name, isa, UNPACK)                                                                                     \
  static const tile_fn few1_##name[SHORT + 1] = {0, r1x1_##name, r2x1_##name, r3x1_##name, rx1_##name,          \
                                                 r5x1_##name, r6x1_##name, r7x1_##name, r8x1_##name};
WIDTH(4, 4, ISA, unpack)
WIDTH(5, 5, ISA, unpack)
WIDTH(8, 8, ISA, unpack)
#if VL == 16
/* CPUs with AVX-512 VBMI unpack 5-bit blocks in 4 instructions: the same
 * values, one row's product ~20% faster; their panels are filled the plain
 * way, which measured faster there (53-62 against 69-79 ms at 16 rows) */
WIDTH(5, 5_vbmi, UNPACK_VBMI_TARGET, unpack_vbmi)
#endif
DEQUANTIZE(dequantize_4, ISA, unpack, 4)
DEQUANTIZE(dequantize_5, ISA, unpack, 5)
DEQUANTIZE(dequantize_8, ISA, unpack, 8)
TILE(panel_tile, ISA, unpack, 8, R, C, 1) /* reads floats: the same for every width */

typedef struct {
  tile_fn big, rx1;
  const tile_fn *few, *few1; /* by rows, for up to SHORT rows in one tile: r x columns_of_few(r), r x 1 */
  dequantize_fn dequantize;
} tiles;

/* the columns a tile of `rows` rows (up to SHORT) covers */
static int columns_of_few(long rows) { return rows < R ? FEW_C : rows == R ? C : FEW_C / 2; }

static tiles tiles_for(int bits) {
  static const tiles table[] = {
      {big_4, rx1_4, few_4, few1_4, dequantize_4},
      {big_5, rx1_5, few_5, few1_5, dequantize_5},
      {big_8, rx1_8, few_8, few1_8, dequantize_8},
#if VL == 16
      {big_5_vbmi, rx1_5_vbmi, few_5_vbmi, few1_5_vbmi, dequantize_5},
#endif
  };
#if VL == 16
  if (bits == 5 && tierlm_qmm_avx512_vbmi(-1)) return table[3];
#endif
  return table[bits == 4 ? 0 : bits == 5 ? 1 : 2];
}

/* x as the tiles read it: each R rows of a full tile block by block (block b
 * of row r at (b * R + r) * 32 floats from the tile's first row), and the rows
 * after the last full tile likewise as one smaller tile; each block's values in
 * unpacked order. One pointer with constant offsets keeps a tile's loop in
 * registers. Written by the pool's threads, a share of the rows each: one
 * core packing a prompt's rows value by value while the other waited was ~4%
 * of a 2,048-token prefill's samples. */
typedef struct {
  const float *x;
  long M, K, tiled;
  int bits;
  float *packed;
} packing;

/* One row's blocks, each in unpacked order: a 4-bit block's even values then
 * its odd ones (unpack.h), the others as they are. */
INLINE void pack_row(const float *from, long K, int bits, long stride, float *to) {
  for (long b = 0; b < K / BLOCK; b++, from += BLOCK, to += stride) {
    if (bits == 4)
      for (int i = 0; i < BLOCK / 2; i++) to[i] = from[2 * i], to[BLOCK / 2 + i] = from[2 * i + 1];
    else
      for (int i = 0; i < BLOCK; i++) to[i] = from[i];
  }
}

static void pack_part(void *arg, int part, int parts) {
  const packing *p = arg;
  for (long m = p->M * part / parts; m < p->M * (part + 1) / parts; m++) {
    long m0 = m < p->tiled ? m / R * R : p->tiled, rows = m < p->tiled ? R : p->M - p->tiled;
    pack_row(p->x + m * p->K, p->K, p->bits, rows * BLOCK, p->packed + m0 * p->K + (m - m0) * BLOCK);
  }
}

static float *pack_rows(const float *x, long M, long K, int bits) {
  float *packed = tierlm_kept_buffer(&packed_kept, &packed_capacity, sizeof(float) * M * K);
  packing p = {x, M, K, M <= SHORT ? 0 : M / R * R, bits, packed};
  tierlm_parallel(pack_part, &p, M * K < (1L << 16) ? 1 : tierlm_threads());
  return packed;
}

/* ---- the product, shared over the cores by output columns ---------------- */

typedef struct {
  long M, K, N;
  int bits, group;
  const uint8_t *w;
  const void *scales, *biases; /* float32, or float16 where `half` */
  int half;
  const float *x;
  float *out;
} job;

/* The scales (or biases) of weight rows from n: group by group, row after row. */
static const void *from_row(const job *j, const void *p, long n) {
  return (const char *)p + n * (j->K / j->group) * (j->half ? 2 : 4);
}

/* Tile (m0, n0) of rows x columns outputs; panel: the dequantized weight rows from n0, or NULL. */
static void tile_at(const job *j, tile_fn tile, int rows, int columns, long m0, long n0, const float *panel) {
  long row_bytes = j->K * j->bits / 8;
  float got[R * C];
  tile(j->w + n0 * row_bytes, row_bytes, from_row(j, j->scales, n0), from_row(j, j->biases, n0), j->half, panel,
       j->x + m0 * j->K, j->K, j->group, got);
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < columns; c++) j->out[(m0 + r) * j->N + n0 + c] = got[r * columns + c];
}

/* From this many activation rows, weights are dequantized into panels: 8-bit
 * blocks unpack with a load, so below 32 rows unpacking them again per tile is
 * cheaper than the panel's stores and loads (48 against 57 ms at 16 rows over
 * Qwen2.5-Coder-0.5B's shapes; even at 32; the panel 15% faster at 64). */
static long panel_rows(int bits) { return bits == 8 ? 32 : 16; }
#define PANEL_FLOATS 65536 /* a panel's size: it stays in the core's cache while the tiles sweep it */
#define COLUMNS 48         /* weight rows fewer activation rows sweep together, straight from the packing */

/* Output columns [first, last) of every activation row: R x C tiles over a
 * block of weight rows at a time, the columns they leave by R x 1, the rows
 * they leave together by r x 4 and r x 1. */
static void columns_of(void *arg, int part, int parts) {
  const job *j = arg;
  tiles t = tiles_for(j->bits);
  long first = j->N * part / parts, last = j->N * (part + 1) / parts, whole = first + (last - first) / C * C;
  long tiled = j->M <= SHORT ? 0 : j->M / R * R, row_bytes = j->K * j->bits / 8;
  int many = j->M >= panel_rows(j->bits);
  long step = many ? (PANEL_FLOATS / j->K / C + 1) * C : COLUMNS;
  float *panel = many ? tierlm_kept_buffer(&panel_kept, &panel_capacity, sizeof(float) * step * j->K) : NULL;
  for (long n0 = first; tiled && n0 < whole; n0 += step) {
    long end = n0 + step < whole ? n0 + step : whole;
    if (panel)
      t.dequantize(j->w + n0 * row_bytes, row_bytes, from_row(j, j->scales, n0), from_row(j, j->biases, n0), j->half,
                   j->K, j->group, end - n0, panel);
    for (long m0 = 0; m0 < tiled; m0 += R)
      for (long n = n0; n < end; n += C)
        tile_at(j, panel ? panel_tile : t.big, R, C, m0, n, panel ? panel + (n - n0) * j->K : NULL);
  }
  for (long m0 = 0; m0 < tiled; m0 += R)
    for (long n = whole; n < last; n++) tile_at(j, t.rx1, R, 1, m0, n, NULL);
  int left = (int)(j->M - tiled), width = columns_of_few(left);
  if (left) {
    long n = first;
    for (; n + width <= last; n += width) tile_at(j, t.few[left], left, width, tiled, n, NULL);
    for (; n < last; n++) tile_at(j, t.few1[left], left, 1, tiled, n, NULL);
  }
}

/* out (M x N) = x (M x K) times the quantized W (N x K) transposed. */
void SIMD_NAME(tierlm_qmm_float)(const float *x, long M, long K, const void *w, const void *scales,
                                 const void *biases, int half, long N, int bits, int group, float *out) {
  float *packed = pack_rows(x, M, K, bits);
  job j = {M, K, N, bits, group, w, scales, biases, half, packed, out};
  /* chunks for the cores (whichever is free takes the next), but not for products too small to share */
  tierlm_parallel_chunks(columns_of, &j, M * N * K < (1L << 16) || N < 64 ? 1 : CHUNKS_PER_THREAD * tierlm_threads());
}
