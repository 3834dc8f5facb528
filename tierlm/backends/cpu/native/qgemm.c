/* MLX's affine-quantized matmul (4, 5 and 8 bits) on weights that stay packed
 * in memory; `tierlm_qmm` is what the hook (qmm_hook.cpp) calls.
 *
 * Paths, chosen at run time by what the CPU reports, under TIERLM_MAX_CPU_ISA
 * (cpu_features.c; tierlm_qmm_select can name one, for tests and benchmarks):
 *   - AVX-512, and AVX2 with FMA: float32 products of the weights unpacked in
 *     registers (qgemm_float.c, one source built for 16 and for 8 lanes): the
 *     activations stay float32, so the product is the dequantized weights' own;
 *   - int8 activations for the weights cpu/int8.py registers (a model its
 *     probe found they barely move; tierlm_qmm_int8_add), computed as llama.cpp
 *     computes its quantized products: the activations quantized to int8 per
 *     block of 32 values, each block's product with the weights an integer dot
 *     product, scaled back in float. With AVX-512 VNNI sixteen output columns
 *     a vector (qgemm_vnni512.c; TIERLM_QUANT_KERNEL=avx512-vnni for every
 *     weight), else with AVX2 eight (qgemm_int8_avx2.c; avx2-int8 for every
 *     weight). Fewer instructions a block than float32's, but the int8
 *     activations move some models' answers (docs/cpu-backend.md);
 *   - AVX-VNNI by name only (TIERLM_QUANT_KERNEL=avx-vnni): this file's
 *     integer tiles, a block's products in the lanes of one output;
 *   - portable C that any CPU runs (the integer products).
 *
 *   out[m][n] = sum_k x[m][k] * (scale[n][k/g] * q[n][k] + bias[n][k/g])
 *             = sum_g scale[n][g] * sum_{b in g} d[m][b] * ((q - c) . xq[m][b])
 *               + sum_g (bias[n][g] + c * scale[n][g]) * xsum[m][g]
 *
 * with xq = round(x / d), d = max|x| / 127 per 32-value block, xsum the exact
 * float sum of x over the group, and c = 2^(bits-1) the centre of q. The weights
 * are read as MLX stores them (a transposed N x K matrix, each row an LSB-first
 * bitstream of K values), the scales and biases as float32 (N x K/g). On every
 * path each output element is computed by one thread in one order whatever M or
 * the split, so batching changes no bit. */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "counters.h"
#include "cpu_features.h"
#include "threads.h"
#include "qgemm_int8.h"
#include "unpack.h"

#define UNROLL _Pragma("GCC unroll 16")


/* qgemm_float.c, built by float_avx512.c and float_avx2.c; whether this CPU runs each (float_kernels.c) */
int tierlm_float_width_available(int width);
void tierlm_qmm_float_avx512(const float *x, long M, long K, const void *w, const void *scales, const void *biases,
                             int half, long N, int bits, int group, float *out);
void tierlm_qmm_float_avx2(const float *x, long M, long K, const void *w, const void *scales, const void *biases,
                           int half, long N, int bits, int group, float *out);

static int path_in_use = -1;

/* 1 when the CPU has what `path` needs (under TIERLM_MAX_CPU_ISA). */
int tierlm_qmm_available(int path) {
  switch (path) {
    case PATH_SCALAR: return 1;
    case PATH_AVX2_INT8: return tierlm_cpu_has(CPU_AVX2) && tierlm_cpu_has(CPU_FMA);
    case PATH_AVX_VNNI: return tierlm_qmm_available(PATH_AVX2_INT8) && tierlm_cpu_has(CPU_AVX_VNNI);
    case PATH_AVX512: return tierlm_float_width_available(16);
    case PATH_AVX2_FLOAT: return tierlm_float_width_available(8);
    case PATH_AVX512_VNNI:
      return tierlm_qmm_available(PATH_AVX2_INT8) && tierlm_cpu_has(CPU_AVX512F) && tierlm_cpu_has(CPU_AVX512BW) &&
             tierlm_cpu_has(CPU_AVX512VL) && tierlm_cpu_has(CPU_AVX512VNNI);
  }
  return 0;
}

/* The fastest path the CPU has, or `path` when >= 0 and available; returns the one in use. */
int tierlm_qmm_select(int path) {
  if (path >= 0) {
    if (!tierlm_qmm_available(path)) return -1;
    path_in_use = path;
  } else {
    path_in_use = tierlm_qmm_available(PATH_AVX512)       ? PATH_AVX512
                  : tierlm_qmm_available(PATH_AVX2_FLOAT) ? PATH_AVX2_FLOAT
                                                          : PATH_SCALAR;
  }
  return path_in_use;
}

int tierlm_qmm_supports(int bits, int group, long K) {
  return (bits == 4 || bits == 5 || bits == 8) && (group == 32 || group == 64 || group == 128) &&
         K % group == 0;
}

/* ---- the activations, quantized once per call ---------------------------- */


/* The integer products are taken as sum (q - c) xq, c = 2^(bits-1) the centre of
 * the weights, and the centre is given back with the exact sum of x:
 * (bias + c * scale) * xsum. Uncentred, the error of quantizing x would be
 * multiplied by the weights' whole range instead of half of it (about twice the
 * error). The vector paths' products are uncentred (vpdpbusd and vpmaddubsw
 * want unsigned weights): for them a group's `fix` also takes back
 * c * sum_b d_b * sum(xq_b). */
static inline int centre(int bits) { return 1 << (bits - 1); }

/* Only the portable C products are centred; the vector ones take unsigned weights. */
static inline int centred_products(int path) { return path == PATH_SCALAR; }


static void quantize_block_c(const float *v, int bits, int8_t *q, float *d, int32_t *qsum) {
  float amax = 0.f;
  for (int i = 0; i < BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
  float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int i = 0; i < BLOCK; i++) {
    int8_t t = (int8_t)nearbyintf(v[i] * inv);
    q[unpacked_position(bits, i)] = t;
    total += t;
  }
  *d = amax / 127.f;
  *qsum = total;
}

#define TARGET __attribute__((target("avx2,fma")))

static inline TARGET float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* The same as quantize_block_c, eight lanes at a time (rounding to nearest even
 * both ways, so the two give the same bytes). */
static TARGET void quantize_block_avx2(const float *v, int bits, int8_t *q, float *d, int32_t *qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  float top = _mm_cvtss_f32(m), inv = top > 0.f ? 127.f / top : 0.f;
  __m256i n[4];
  for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(inv)));
  /* int32 -> int8; the packs interleave 128-bit lanes, the permute puts them back */
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (bits == 4) { /* even values to the low half, odd to the high */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), 0xD8);
  }
  _mm256_storeu_si256((__m256i *)q, bytes);
  __m256i wide = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  *d = top / 127.f;
  *qsum = (int32_t)hsum(_mm256_cvtepi32_ps(wide));
}

static void quantize_rows(const float *x, long M, long K, int bits, int group, int path, activations *a) {
  long blocks = K / BLOCK, groups = K / group, per_group = group / BLOCK;
  int c = centre(bits), centred = centred_products(path);
  for (long m = 0; m < M; m++) {
    const float *row = x + m * K;
    for (long g = 0; g < groups; g++) {
      float sum = 0.f, taken = 0.f;
      for (long bb = 0; bb < per_group; bb++) {
        long b = g * per_group + bb;
        int32_t qsum;
        if (path == PATH_SCALAR)
          quantize_block_c(row + b * BLOCK, bits, a->q + m * K + b * BLOCK, a->d + m * blocks + b, &qsum);
        else
          quantize_block_avx2(row + b * BLOCK, bits, a->q + m * K + b * BLOCK, a->d + m * blocks + b, &qsum);
        taken += a->d[m * blocks + b] * (float)qsum;
      }
      for (int i = 0; i < group; i++) sum += row[g * group + i];
      a->sum[m * groups + g] = sum;
      a->fix[m * groups + g] = c * (centred ? sum : sum - taken);
    }
  }
}

void *tierlm_quantize_activations(const float *x, long M, long K, int bits, int group, int path, activations *a) {
  long blocks = K / BLOCK, groups = K / group;
  size_t quantized = (size_t)(M * K + 63) & ~(size_t)63;
  char *buffer = malloc(quantized + sizeof(float) * M * (blocks + 2 * groups));
  *a = (activations){(int8_t *)buffer, (float *)(buffer + quantized), 0, 0};
  a->sum = a->d + M * blocks;
  a->fix = a->sum + M * groups;
  quantize_rows(x, M, K, bits, group, path, a);
  return buffer;
}

/* ---- portable C ---------------------------------------------------------- */

static inline int value_at(const uint8_t *row, int bits, long k) {
  long bit = k * bits;
  unsigned window = row[bit >> 3] | (bits > 4 && (bit & 7) + bits > 8 ? row[(bit >> 3) + 1] << 8 : 0);
  return (window >> (bit & 7)) & ((1 << bits) - 1);
}

/* sum_b scale_g * d_b * (w_b . xq_b) for R activation rows from m0 times C
 * weight rows from wrow (row_bytes apart), into out[r * C + c]. Every output
 * element is one chain of adds over the blocks in order, then the same
 * horizontal sum, whatever the tile: so a row's result has the same bits
 * whether it was computed alone or in a batch. `bits` is a constant in each
 * instance (see PRODUCTS). */
#define TILE_BODY(DOT, R, C, PANEL)                                                                    \
  long blocks = K / BLOCK, per_group = group / BLOCK, step = BLOCK * bits / 8, groups = K / group;     \
  /* the next tile's weight rows, fetched a share a block while this one computes (a prefetch past     \
   * the matrix's end never faults) */                                                                 \
  const char *ahead = (const char *)wrow + C * row_bytes;                                              \
  long lines = (C * row_bytes + 63) / 64, share = 0;                                                   \
  __m256 acc[R][C];                                                                                    \
  UNROLL for (int r = 0; r < R; r++)                                                                   \
    UNROLL for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                                \
  for (long g = 0, b = 0; g < groups; g++) {                                                           \
    for (long bb = 0; bb < per_group; bb++, b++) {                                                     \
      for (share += lines; !PANEL && share >= blocks; share -= blocks, ahead += 64)                    \
        _mm_prefetch(ahead, _MM_HINT_T0);                                                              \
      UNROLL for (int c = 0; c < C; c++) {                                                             \
        __m256i w = PANEL ? _mm256_loadu_si256((const __m256i *)(panel + (b * C + c) * BLOCK))         \
                          : unpack(wrow + c * row_bytes + b * step, bits);                             \
        __m256 scale = _mm256_set1_ps(s[c * groups + g]);                                              \
        UNROLL for (int r = 0; r < R; r++) {                                                           \
          __m256i q = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + r) * K + b * BLOCK));          \
          __m256 sd = _mm256_mul_ps(scale, _mm256_broadcast_ss(a->d + (m0 + r) * blocks + b));         \
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT), sd, acc[r][c]);                         \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
  }                                                                                                    \
  UNROLL for (int r = 0; r < R; r++)                                                                   \
    for (int c = 0; c < C; c++) out[r * C + c] = hsum(acc[r][c]);

typedef void (*tile_fn)(const uint8_t *wrow, long row_bytes, const float *s, const uint8_t *panel,
                        const activations *a, long m0, long K, int group, float *out);

/* The tiles: 4 activation rows x 2 weight rows (batches), the same reading
 * unpacked weights from a panel (many activation rows), 1 x 8 (one row: eight
 * independent chains), 1 x 1 (what is left); and what fills the panel. */
#define TILE(name, isa, DOT, bits_, R, C, PANEL)                                                       \
  static __attribute__((target(isa))) void name(const uint8_t *wrow, long row_bytes, const float *s,   \
                                                const uint8_t *panel, const activations *a, long m0, long K, \
                                                int group, float *out) {                               \
    const int bits = bits_;                                                                            \
    TILE_BODY(DOT, R, C, PANEL)                                                                        \
  }

/* `rows` weight rows (a multiple of 2) unpacked into panel as the 4 x 2 tile
 * reads them: each 2 rows block by block (block b of row c at (2b + c) * 32
 * bytes from the pair's start), one stream per tile. The same bytes `unpack`
 * gives the other tiles, so the products are the same. */
typedef void (*unpack_rows_fn)(const uint8_t *wrow, long row_bytes, long K, long rows, uint8_t *panel);

#define UNPACK_ROWS(name, bits_)                                                                       \
  static UNPACK_TARGET void name(const uint8_t *wrow, long row_bytes, long K, long rows, uint8_t *panel) { \
    const int bits = bits_;                                                                            \
    for (long c = 0; c < rows; c++)                                                                    \
      for (long b = 0; b < K / BLOCK; b++)                                                             \
        _mm256_storeu_si256((__m256i *)(panel + c / 2 * 2 * K + (b * 2 + c % 2) * BLOCK),              \
                            unpack(wrow + c * row_bytes + b * BLOCK * bits / 8, bits));                \
  }
UNPACK_ROWS(unpack_rows_4, 4)
UNPACK_ROWS(unpack_rows_5, 5)
UNPACK_ROWS(unpack_rows_8, 8)

#define PRODUCTS(name, isa, DOT, bits_)                                                                \
  TILE(name##_4x2, isa, DOT, bits_, 4, 2, 0)                                                           \
  TILE(name##_4x2_panel, isa, DOT, bits_, 4, 2, 1)                                                     \
  TILE(name##_1x8, isa, DOT, bits_, 1, 8, 0)                                                           \
  TILE(name##_1x1, isa, DOT, bits_, 1, 1, 0)

/* vpdpbusd sums u8 x s8 products into int32 lanes without saturating (AVX-VNNI,
 * VEX-encoded). */
#define DOT_AVXVNNI _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, q)
#define ISA_AVXVNNI "avx2,fma,avxvnni"

PRODUCTS(avxvnni_4, ISA_AVXVNNI, DOT_AVXVNNI, 4)
PRODUCTS(avxvnni_5, ISA_AVXVNNI, DOT_AVXVNNI, 5)
PRODUCTS(avxvnni_8, ISA_AVXVNNI, DOT_AVXVNNI, 8)

typedef struct {
  tile_fn t4x2, t4x2_panel, t1x8, t1x1;
  unpack_rows_fn unpack_rows;
} tiles;

/* The AVX-VNNI tiles, the only vector path left to rows_of (the others have files of their own). */
static tiles tiles_for(int bits) {
#define TILES(b) {avxvnni_##b##_4x2, avxvnni_##b##_4x2_panel, avxvnni_##b##_1x8, avxvnni_##b##_1x1, unpack_rows_##b}
  static const tiles table[3] = {TILES(4), TILES(5), TILES(8)};
#undef TILES
  return table[bits == 4 ? 0 : bits == 5 ? 1 : 2];
}

/* sum_g bias_g * xsum_g + scale_g * fix_g */
static float groups_c(const float *bias, const float *s, const float *sum, const float *fix, long groups) {
  float total = 0.f;
  for (long g = 0; g < groups; g++) total += bias[g] * sum[g] + s[g] * fix[g];
  return total;
}

static TARGET float groups_avx2(const float *bias, const float *s, const float *sum, const float *fix,
                                long groups) {
  __m256 acc = _mm256_setzero_ps();
  long g = 0;
  for (; g + 8 <= groups; g += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(bias + g), _mm256_loadu_ps(sum + g), acc);
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(s + g), _mm256_loadu_ps(fix + g), acc);
  }
  return hsum(acc) + groups_c(bias + g, s + g, sum + g, fix + g, groups - g);
}

/* ---- the product, shared over the cores by output rows ------------------- */

typedef struct {
  long M, K, N;
  int bits, group, path;
  const uint8_t *w;
  const float *scales, *biases;
  const activations *a;
  float *out;
} job;

/* One weight row's products with one activation row in plain C (the portable path). */
static float product_c(const job *j, long m, long n) {
  long blocks = j->K / BLOCK, per_group = j->group / BLOCK, groups = j->K / j->group;
  const uint8_t *wrow = j->w + n * (j->K * j->bits / 8);
  const float *s = j->scales + n * groups;
  float total = 0.f;
  for (long b = 0; b < blocks; b++) {
    const int8_t *q = j->a->q + m * j->K + b * BLOCK;
    int32_t dot = 0;
    for (int i = 0; i < BLOCK; i++)
      dot += (value_at(wrow, j->bits, b * BLOCK + i) - centre(j->bits)) * q[unpacked_position(j->bits, i)];
    total += s[b / per_group] * j->a->d[m * blocks + b] * (float)dot;
  }
  return total;
}

/* Tile (m0, n0) of R x C outputs: the products, then the groups' terms;
 * panel: the unpacked weight rows from n0, or NULL. */
static void tile_at(const job *j, tile_fn tile, int R, int C, long m0, long n0, const uint8_t *panel) {
  long groups = j->K / j->group, row_bytes = j->K * j->bits / 8;
  float got[8];
  if (tile)
    tile(j->w + n0 * row_bytes, row_bytes, j->scales + n0 * groups, panel, j->a, m0, j->K, j->group, got);
  else
    got[0] = product_c(j, m0, n0);
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) {
      long m = m0 + r, n = n0 + c;
      const float *s = j->scales + n * groups, *bias = j->biases + n * groups;
      const float *sum = j->a->sum + m * groups, *fix = j->a->fix + m * groups;
      float rest = tile ? groups_avx2(bias, s, sum, fix, groups) : groups_c(bias, s, sum, fix, groups);
      j->out[m * j->N + n] = got[r * C + c] + rest;
    }
}

#define COLUMNS 32          /* weight rows a few activation rows' tiles sweep together, straight from the packing */
#define PANEL_ROWS 16       /* from this many activation rows, weights are unpacked once into panels */
#define PANEL_BYTES 262144  /* a panel's size: it stays in the core's cache while the tiles sweep it */

static __thread void *panel_kept; /* this thread's panel (threads.h) */
static __thread size_t panel_capacity;

/* Output columns [first, last) of every activation row: full 4 x 2 tiles, a
 * block of weight rows at a time for every four activation rows (unpacked into
 * a panel first when there are many activation rows), then the rows and
 * columns they leave by 1 x 8 and 1 x 1. */
static void rows_of(void *arg, int part, int parts) {
  const job *j = arg;
  long first = j->N * part / parts, last = j->N * (part + 1) / parts;
  tiles t = j->path == PATH_SCALAR ? (tiles){0} : tiles_for(j->bits);
  long tiled = t.t4x2 ? j->M / 4 * 4 : 0, pairs = first + (last - first) / 2 * 2;
  long row_bytes = j->K * j->bits / 8;
  int many = tiled && j->M >= PANEL_ROWS;
  long step = many ? (PANEL_BYTES / j->K / 2 + 1) * 2 : COLUMNS;
  uint8_t *panel = many ? tierlm_kept_buffer(&panel_kept, &panel_capacity, step * j->K) : NULL;
  for (long n0 = first; tiled && n0 < pairs; n0 += step) {
    long end = n0 + step < pairs ? n0 + step : pairs;
    if (many) t.unpack_rows(j->w + n0 * row_bytes, row_bytes, j->K, end - n0, panel);
    for (long m0 = 0; m0 < tiled; m0 += 4)
      for (long n = n0; n < end; n += 2)
        tile_at(j, many ? t.t4x2_panel : t.t4x2, 4, 2, m0, n, many ? panel + (n - n0) * j->K : NULL);
  }
  for (long m = 0; m < tiled && pairs < last; m++) tile_at(j, t.t1x1, 1, 1, m, pairs, NULL);
  for (long m = tiled; m < j->M; m++) {
    long n = first;
    for (; t.t1x8 && n + 8 <= last; n += 8) tile_at(j, t.t1x8, 1, 8, m, n, NULL);
    for (; n < last; n++) tile_at(j, t.t1x1, 1, 1, m, n, NULL);
  }
}

/* ---- the weights multiplied with int8 activations, whatever the path ----- */

/* int8.py registers here the weights of a model whose predictions the int8
 * activations barely move (its probe at load), by their packed data's address;
 * their products take the int8 products (int8_kernel) while every other weight keeps the
 * path in use. A weight is registered for its whole life (a weakref finalizer
 * removes it before MLX can free the buffer and hand the address to another
 * array), so each weight's products always take one path: a row keeps its bits
 * alone or batched. Each keeps its scales and biases laid out by the strips
 * its product reads (tierlm_int8_lay): a one-row product otherwise lays out
 * every strip's anew, ~40% of its time with AVX2. Open addressing over a fixed
 * table; few writers (loads, unloads), a reader per product, which holds the
 * lock through the product: a model can be collected while a graph it queued
 * still multiplies by its weights, and removing one then waits. */
#define INT8_SLOTS 16384
#define INT8_GONE ((const void *)1) /* a removed entry: probing goes on past it */
typedef struct {
  const void *w;
  const void *scales; /* the scales the laid-out ones are of: a product by others lays out its own */
  int half, lanes;    /* and how: float16 or not, the columns of a strip */
  char *laid;
} int8_weight;
static int8_weight int8_table[INT8_SLOTS];
static int int8_count;
static pthread_rwlock_t int8_lock = PTHREAD_RWLOCK_INITIALIZER;

static size_t int8_slot(const void *w) { return ((uintptr_t)w >> 6) * 0x9E3779B97F4A7C15ULL >> 50; }

/* The slot holding w, or -1; with the lock held. */
static long int8_find(const void *w) {
  for (size_t i = int8_slot(w), n = 0; n < INT8_SLOTS && int8_table[i].w; i = (i + 1) % INT8_SLOTS, n++)
    if (int8_table[i].w == w) return (long)i;
  return -1;
}

void tierlm_int8_lay(const void *scales, const void *biases, int half, long N, long groups, int lanes, char *to) {
  long width = half ? 2 : 4, strips = (N + lanes - 1) / lanes;
  for (long s = 0; s < strips; s++) {
    lane_scales at = laid_strip(to, s, groups, lanes, half);
    const void *from[2] = {scales, biases};
    char *into[2] = {(char *)at.scale, (char *)at.bias};
    for (int k = 0; k < 2; k++)
      for (long g = 0; g < groups; g++)
        for (int c = 0; c < lanes; c++) {
          long n = s * lanes + c;
          char *cell = into[k] + (g * lanes + c) * width;
          if (n < N) memcpy(cell, (const char *)from[k] + (n * groups + g) * width, width);
          else memset(cell, 0, width);
        }
  }
}

/* Columns a strip of the int8 product w's product of K values takes. */
static int int8_lanes(long K) { return tierlm_qmm_available(PATH_AVX512_VNNI) && K % (2 * BLOCK) == 0 ? 16 : 8; }

/* Bytes tierlm_qmm_int8_add keeps for an N x K weight's laid-out scales and biases. */
long tierlm_qmm_int8_laid_bytes(long N, long K, int group, int half) {
  int lanes = int8_lanes(K);
  return (N + lanes - 1) / lanes * laid_strip_bytes(K / group, lanes, half);
}

/* 1: w's products take int8 activations from now on, its scales and biases
 * (N x K / group, float16 where `half`) laid out once; 0: this CPU has no AVX2
 * (under TIERLM_MAX_CPU_ISA), no memory, or the table is full. */
int tierlm_qmm_int8_add(const void *w, const void *scales, const void *biases, int half, long N, long K, int group) {
  if (!tierlm_qmm_available(PATH_AVX2_INT8) || w == NULL || w == INT8_GONE || group <= 0 || K % group) return 0;
  int lanes = int8_lanes(K);
  char *laid = malloc(tierlm_qmm_int8_laid_bytes(N, K, group, half));
  if (!laid) return 0;
  tierlm_int8_lay(scales, biases, half, N, K / group, lanes, laid);
  int added = 0;
  pthread_rwlock_wrlock(&int8_lock);
  if (int8_find(w) < 0 && int8_count < INT8_SLOTS / 2) {
    size_t i = int8_slot(w);
    while (int8_table[i].w && int8_table[i].w != INT8_GONE) i = (i + 1) % INT8_SLOTS;
    int8_table[i] = (int8_weight){w, scales, half, lanes, laid};
    laid = NULL;
    __atomic_add_fetch(&int8_count, 1, __ATOMIC_RELEASE);
    added = 1;
  } else {
    added = int8_find(w) >= 0;
  }
  pthread_rwlock_unlock(&int8_lock);
  free(laid); /* not kept: already registered, or no room */
  return added;
}

void tierlm_qmm_int8_remove(const void *w) {
  pthread_rwlock_wrlock(&int8_lock);
  long i = int8_find(w);
  if (i >= 0) {
    free(int8_table[i].laid);
    int8_table[i] = (int8_weight){INT8_GONE, NULL, 0, 0, NULL};
    /* the last one gone: no removed entries left to probe past */
    if (__atomic_sub_fetch(&int8_count, 1, __ATOMIC_RELEASE) == 0) memset(int8_table, 0, sizeof int8_table);
  }
  pthread_rwlock_unlock(&int8_lock);
}

/* Weights registered now. */
int tierlm_qmm_int8_weights(void) { return __atomic_load_n(&int8_count, __ATOMIC_ACQUIRE); }

typedef void (*int8_product)(const float *x, long M, long K, const void *w, const void *scales, const void *biases,
                             int half, long N, int bits, int group, float *out, const char *laid);

/* The int8 product `path` names for a product of K values, or NULL. */
static int8_product named_kernel(int path, long K) {
  if (path == PATH_AVX512_VNNI) return K % (2 * BLOCK) ? tierlm_qmm_int8_avx2 : tierlm_qmm_vnni512;
  return path == PATH_AVX2_INT8 ? tierlm_qmm_int8_avx2 : NULL;
}

/* The product by w with int8 activations, if the path in use names one or w
 * is registered (then with its laid-out scales, the lock held through it, and
 * AVX-512 VNNI's where the CPU has it and K is a whole number of block pairs,
 * else AVX2's); 0 when neither. */
static int int8_product_of(int path, const float *x, long M, long K, const void *w, const void *scales,
                           const void *biases, int half, long N, int bits, int group, float *out) {
  int8_product named = named_kernel(path, K);
  if (named) {
    named(x, M, K, w, scales, biases, half, N, bits, group, out, NULL);
    return 1;
  }
  if (__atomic_load_n(&int8_count, __ATOMIC_ACQUIRE) == 0) return 0;
  pthread_rwlock_rdlock(&int8_lock);
  long i = int8_find(w);
  int lanes = int8_lanes(K), takes = i >= 0 && (lanes == 16 || !tierlm_qmm_available(PATH_AVX512_VNNI));
  if (takes) {
    const int8_weight *e = &int8_table[i];
    const char *laid = e->scales == scales && e->half == half && e->lanes == lanes ? e->laid : NULL;
    (lanes == 16 ? tierlm_qmm_vnni512 : tierlm_qmm_int8_avx2)(x, M, K, w, scales, biases, half, N, bits, group, out,
                                                              laid);
  }
  pthread_rwlock_unlock(&int8_lock);
  return takes;
}

/* out (M x N) = x (M x K) times the quantized W (N x K) transposed. */
void tierlm_qmm(const float *x, long M, long K, const void *w, const float *scales, const float *biases, long N,
                int bits, int group, float *out) {
  if (path_in_use < 0) tierlm_qmm_select(-1);
  int path = path_in_use;
  if (int8_product_of(path, x, M, K, w, scales, biases, 0, N, bits, group, out)) {
    TIERLM_COUNT(COUNT_QMM);
    return;
  }
  if (path == PATH_AVX512 || path == PATH_AVX2_FLOAT) {
    (path == PATH_AVX512 ? tierlm_qmm_float_avx512 : tierlm_qmm_float_avx2)(x, M, K, w, scales, biases, 0, N, bits,
                                                                            group, out);
    TIERLM_COUNT(COUNT_QMM);
    return;
  }
  activations a;
  void *buffer = tierlm_quantize_activations(x, M, K, bits, group, path, &a);
  job j = {M, K, N, bits, group, path, w, scales, biases, &a, out};
  /* a part per core, but not for products too small to share */
  tierlm_parallel(rows_of, &j, M * N * K < (1L << 16) || N < 64 ? 1 : 64);
  free(buffer);
  TIERLM_COUNT(COUNT_QMM);
}

/* An IEEE half as a float (exactly; no F16C needed). */
static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  float f;
  if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
    f = ldexpf((float)mantissa, -24);
    return sign ? -f : f;
  }
  bits = exponent == 31 ? sign | 0x7f800000u | (mantissa << 13) : sign | ((exponent + 112) << 23) | (mantissa << 13);
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* tierlm_qmm with float16 scales and biases (as the GGUF importer keeps them):
 * the float paths read them as they are, the others widened first. */
void tierlm_qmm_half(const float *x, long M, long K, const void *w, const uint16_t *scales, const uint16_t *biases,
                     long N, int bits, int group, float *out) {
  if (path_in_use < 0) tierlm_qmm_select(-1);
  if (int8_product_of(path_in_use, x, M, K, w, scales, biases, 1, N, bits, group, out)) {
    TIERLM_COUNT(COUNT_QMM);
    return;
  }
  if (path_in_use == PATH_AVX512 || path_in_use == PATH_AVX2_FLOAT) {
    (path_in_use == PATH_AVX512 ? tierlm_qmm_float_avx512 : tierlm_qmm_float_avx2)(x, M, K, w, scales, biases, 1, N,
                                                                                   bits, group, out);
    TIERLM_COUNT(COUNT_QMM);
    return;
  }
  long n = N * (K / group);
  float *wide = malloc(sizeof(float) * 2 * n);
  for (long i = 0; i < n; i++) wide[i] = half_to_float(scales[i]), wide[n + i] = half_to_float(biases[i]);
  tierlm_qmm(x, M, K, w, wide, wide + n, N, bits, group, out);
  free(wide);
}
