/* What qgemm.c's integer paths share with qgemm_vnni512.c and
 * qgemm_int8_avx2.c: the paths' numbers, the activations quantized to int8, a
 * product's job, the prefetch of the next strip, and the two int8 products. */
#ifndef TIERLM_QGEMM_INT8_H
#define TIERLM_QGEMM_INT8_H

#include <stdint.h>

#define BLOCK 32 /* values a block of weights (and of quantized activations) holds */

/* qgemm.c's paths (quantized.PATHS names them) */
enum { PATH_SCALAR = 0, PATH_AVX2_INT8 = 1, PATH_AVX_VNNI = 2, PATH_AVX512 = 3, PATH_AVX2_FLOAT = 4,
       PATH_AVX512_VNNI = 5 };

typedef struct {
  int8_t *q;   /* M x K, each 32-block in the order its weights unpack */
  float *d;    /* M x K/32: the scale of each block */
  float *sum;  /* M x K/g: the exact sum of x over each group */
  float *fix;  /* M x K/g: what multiplies a group's weight scale besides the products (qgemm.c) */
} activations;

/* Row m of `a` as activations of one row. */
static inline activations activations_row(const activations *a, long m, long K, int group) {
  return (activations){a->q + m * K, a->d + m * (K / BLOCK), a->sum + m * (K / group), a->fix + m * (K / group)};
}

/* x's M rows of K quantized for `path`'s products into `a`, whose arrays live
 * in the buffer returned (the caller frees it). */
void *tierlm_quantize_activations(const float *x, long M, long K, int bits, int group, int path, activations *a);

/* One product as the int8 products share it over the cores. */
typedef struct {
  long M, K, N;
  int bits, group, half;
  const uint8_t *w;
  const void *scales, *biases; /* float32, or float16 where `half` */
  const activations *a;
  float *out;
  const char *laid; /* the scales and biases laid out by strips (tierlm_int8_lay), or NULL */
} int8_job;

/* A strip's scales and biases as the products read them: for each group, the
 * strip's columns' values one after another (float16 where `half`, else
 * float32; columns past the matrix's 0). */
typedef struct {
  const void *scale, *bias;
  int half;
} lane_scales;

/* Bytes of one strip of `lanes` columns' laid-out scales and biases. */
static inline long laid_strip_bytes(long groups, int lanes, int half) { return 2L * groups * lanes * (half ? 2 : 4); }

/* Where strip `s`'s scales and biases lie in `laid` (tierlm_int8_lay). */
static inline lane_scales laid_strip(const char *laid, long s, long groups, int lanes, int half) {
  const char *at = laid + s * laid_strip_bytes(groups, lanes, half);
  return (lane_scales){at, at + laid_strip_bytes(groups, lanes, half) / 2, half};
}

/* Every strip of `lanes` columns' scales and biases of an N x K weight laid
 * out at once (a registered weight keeps them: its products need not lay out
 * a strip's for each product). `to` holds N / lanes strips (rounded up). */
void tierlm_int8_lay(const void *scales, const void *biases, int half, long N, long groups, int lanes, char *to);

/* The next strip's weights, scales and biases (each one stretch of memory),
 * fetched a share a step while this strip is read (qgemm_vnni512.c,
 * qgemm_int8_avx2.c): rows read across at once are not followed by the
 * hardware's prefetcher. */
typedef struct {
  const char *at;
  long lines, share;
} fetch;

static inline fetch fetch_of(const void *at, long bytes) { return (fetch){at, (bytes + 63) / 64, 0}; }

/* This step's share of each of the three, for `steps` steps a strip. */
static inline __attribute__((always_inline)) void fetch_shares(fetch ahead[3], long steps) {
  for (int i = 0; i < 3; i++)
    for (ahead[i].share += ahead[i].lines; ahead[i].share >= steps; ahead[i].share -= steps, ahead[i].at += 64)
      __builtin_prefetch(ahead[i].at, 0, 2); /* into L2, as _MM_HINT_T1 */
}

/* Part `part` of `parts` of a product's N output columns, [*first, *last):
 * whole strips of `lanes`, the last part taking the rest. */
static inline void part_columns(long N, int lanes, int part, int parts, long *first, long *last) {
  *first = N * part / parts / lanes * lanes;
  *last = part + 1 == parts ? N : N * (part + 1) / parts / lanes * lanes;
}

/* Columns the strip from n holds, before `last`. */
static inline int strip_width(long n, long last, int lanes) { return last - n < lanes ? (int)(last - n) : lanes; }

/* Strips a sweep keeps at once: as many of `bytes` as `budget` holds (at least
 * 1, at most `most`), or 1 where the rows take each strip straight. */
static inline long strips_at_once(int straight, size_t budget, size_t bytes, long most) {
  long n = straight || budget / bytes < 1 ? 1 : (long)(budget / bytes);
  return n < most ? n : most;
}

/* What the strip of `lanes` columns from n reads, and the next strip's
 * weights and scales fetched while it is read: its weights at *w; its scales
 * and biases laid out (the weight's: returns 1, *ls set), or as stored, for
 * the caller to lay out into *ls (returns 0, *s and *bias set). */
static inline int strip_sources(const int8_job *j, long n, int lanes, const uint8_t **w, lane_scales *ls,
                                const char **s, const char **bias, fetch ahead[3]) {
  long groups = j->K / j->group, row_bytes = j->K * j->bits / 8, width = j->half ? 2 : 4;
  *w = j->w + n * row_bytes;
  ahead[0] = fetch_of(*w + lanes * row_bytes, lanes * row_bytes);
  if (j->laid) {
    long bytes = laid_strip_bytes(groups, lanes, j->half);
    *ls = laid_strip(j->laid, n / lanes, groups, lanes, j->half);
    ahead[1] = fetch_of((const char *)ls->scale + bytes, bytes);
    ahead[2] = fetch_of(NULL, 0);
    return 1;
  }
  *s = (const char *)j->scales + n * groups * width;
  *bias = (const char *)j->biases + n * groups * width;
  ahead[1] = fetch_of(*s + lanes * groups * width, lanes * groups * width);
  ahead[2] = fetch_of(*bias + lanes * groups * width, lanes * groups * width);
  return 0;
}

/* kernel(per_group, ...) for a product of `group`-value groups, with a group
 * of one block (every GGUF format's) compiled apart: per_group a constant 1
 * (kernel inlined) leaves no division a block and nothing carried from block
 * to block but the sums. */
#define BY_GROUP(group, kernel, ...)                                                                                \
  do {                                                                                                              \
    if ((group) == BLOCK)                                                                                           \
      kernel(1, __VA_ARGS__);                                                                                       \
    else                                                                                                            \
      kernel((group) / BLOCK, __VA_ARGS__);                                                                         \
  } while (0)

/* 1 when the CPU has what `path` needs (under TIERLM_MAX_CPU_ISA). */
int tierlm_qmm_available(int path);

/* out (M x N) = x (M x K) times the quantized W (N x K) transposed, with int8
 * activations on 512-bit VNNI tiles; K a whole number of block pairs; scales
 * and biases float16 where `half`, else float32; `laid`: them laid out for
 * 16 columns a strip (tierlm_int8_lay), or NULL. */
void tierlm_qmm_vnni512(const float *x, long M, long K, const void *w, const void *scales, const void *biases,
                        int half, long N, int bits, int group, float *out, const char *laid);

/* The same with AVX2 alone, eight columns a 256-bit vector (qgemm_int8_avx2.c);
 * any K of whole blocks; `laid` for 8 columns a strip. */
void tierlm_qmm_int8_avx2(const float *x, long M, long K, const void *w, const void *scales, const void *biases,
                          int half, long N, int bits, int group, float *out, const char *laid);

#endif
