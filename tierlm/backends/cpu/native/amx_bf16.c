/* bfloat16 copies of float32 weights, multiplied on Intel AMX tiles.
 *
 * On CPUs with AMX (Sapphire Rapids and later), a bf16 tile product does 16x16x32
 * multiply-adds in one instruction, and a bf16 weight is half the bytes of a float32
 * one. tierlm/backends/cpu/amx.py packs each float32 weight a model multiplies by
 * (y = x . W^T, W stored N x K) into tiles once, at load, keyed by the address of
 * the float32 array; sgemm_route.c sends every cblas_sgemm whose B is a packed
 * weight here. x is rounded to bf16 per call; products accumulate in float32.
 *
 * Tile layout: W is cut into 16 (n) x 32 (k) blocks, stored n-block major; block
 * (nb, kb) is one 1 KiB tile whose row r holds, for c = 0..15, the pair
 * W[nb*16 + c][kb*32 + 2r], W[nb*16 + c][kb*32 + 2r + 1] (the pairs TDPBF16PS
 * wants for its B operand). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  const float *key; /* the float32 weight's address; 0 = empty, TOMBSTONE = removed */
  int n, k;
  uint16_t *tiles;
} pack_t;

#define TABLE_SIZE 16384 /* packed weights at once, over every loaded model */
#define TOMBSTONE ((const float *)1)

static pack_t table[TABLE_SIZE];
static pthread_rwlock_t table_lock = PTHREAD_RWLOCK_INITIALIZER;

static size_t slot_of(const float *key) {
  return (size_t)(((uintptr_t)key >> 4) * 0x9E3779B97F4A7C15ull >> 32) % TABLE_SIZE;
}

/* The entry for `key`, or 0; call with the lock held. */
static pack_t *find(const float *key) {
  size_t i = slot_of(key);
  for (size_t probes = 0; probes < TABLE_SIZE && table[i].key != 0; probes++) {
    if (table[i].key == key) return &table[i];
    i = (i + 1) % TABLE_SIZE;
  }
  return 0;
}

static uint16_t to_bf16(float f) { /* round to nearest, ties to even */
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static uint16_t *tiles_of(const float *w, int n, int k) {
  uint16_t *tiles = aligned_alloc(64, (size_t)n * k * 2);
  if (!tiles) return 0;
  int kbs = k / 32;
  for (int nb = 0; nb < n / 16; nb++)
    for (int kb = 0; kb < kbs; kb++) {
      uint16_t *tile = tiles + ((size_t)nb * kbs + kb) * 512;
      for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) {
          const float *pair = w + (size_t)(nb * 16 + c) * k + kb * 32 + 2 * r;
          tile[r * 32 + 2 * c] = to_bf16(pair[0]);
          tile[r * 32 + 2 * c + 1] = to_bf16(pair[1]);
        }
    }
  return tiles;
}

/* Packs W (n x k float32, row-major, contiguous). Returns 0 when the shape does
 * not tile (n % 16, k % 32), memory or table space runs out; the weight then
 * stays on the BLAS path. */
int tierlm_amx_pack(const float *w, int n, int k) {
  if (n <= 0 || k <= 0 || n % 16 || k % 32) return 0;
  uint16_t *tiles = tiles_of(w, n, k);
  if (!tiles) return 0;
  pthread_rwlock_wrlock(&table_lock);
  pack_t *slot = find(w);
  if (slot) { /* packed again: replace */
    free(slot->tiles);
  } else {
    size_t i = slot_of(w);
    for (size_t probes = 0; probes < TABLE_SIZE && table[i].key > TOMBSTONE; probes++)
      i = (i + 1) % TABLE_SIZE;
    slot = table[i].key > TOMBSTONE ? 0 : &table[i];
  }
  if (slot) *slot = (pack_t){w, n, k, tiles};
  pthread_rwlock_unlock(&table_lock);
  if (!slot) free(tiles);
  return slot != 0;
}

/* Forgets W's packed copy; call before the float32 array can be freed. */
void tierlm_amx_unpack(const float *w) {
  pthread_rwlock_wrlock(&table_lock);
  pack_t *slot = find(w);
  if (slot) {
    free(slot->tiles);
    *slot = (pack_t){TOMBSTONE, 0, 0, 0};
  }
  pthread_rwlock_unlock(&table_lock);
}

#if defined(__x86_64__) && !defined(TIERLM_NO_AMX) /* TIERLM_NO_AMX: compilers without AMX intrinsics */
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_features.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int tierlm_amx_compiled(void) { return 1; }

/* 1 when the CPU has AMX-BF16 and AVX512-BF16 (under TIERLM_MAX_CPU_ISA) and
 * Linux lets this process use the tiles. */
int tierlm_amx_available(void) {
  if (!tierlm_cpu_has(CPU_AMX_BF16) || !tierlm_cpu_has(CPU_AVX512BF16)) return 0;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,amx-tile,amx-bf16")

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config_t;

/* Tile state is per thread: configured on a thread's first product. */
static __thread int tiles_configured;
static __thread uint16_t *a_bf16;
static __thread size_t a_capacity;

static void configure_tiles(void) {
  tile_config_t config = {.palette = 1};
  for (int t = 0; t < 8; t++) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  tiles_configured = 1;
}

/* A (m x k float32, row stride lda) as bf16, rows padded with zeros to a multiple of 16. */
static const uint16_t *a_as_bf16(const float *a, int m, int k, int lda) {
  size_t rows = (size_t)(m + 15) & ~(size_t)15, need = rows * k;
  if (need > a_capacity) {
    free(a_bf16);
    a_bf16 = aligned_alloc(64, need * 2);
    a_capacity = a_bf16 ? need : 0;
    if (!a_bf16) return 0;
  }
  for (int i = 0; i < m; i++)
    for (int j = 0; j < k; j += 32) {
      const float *src = a + (size_t)i * lda + j;
      __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
      _mm512_storeu_si512(a_bf16 + (size_t)i * k + j, (__m512i)pairs);
    }
  memset(a_bf16 + (size_t)m * k, 0, (rows - m) * k * 2);
  return a_bf16;
}

typedef struct {
  const uint16_t *a, *b; /* bf16 A (rows padded to 16), packed W */
  int m, k, kbs;
  float alpha, beta;
  float *c;
  int ldc;
} product_t;

#define B_TILE(p, nb, kb) ((p)->b + ((size_t)(nb) * (p)->kbs + (kb)) * 512)
#define A_TILE(p, mb, kb) ((p)->a + (size_t)(mb) * 16 * (p)->k + (kb) * 32)

/* C's 16 x 16 block (mb, nb) = alpha * tile + beta * C, for the rows C has. */
static void write_block(const product_t *p, const float *tile, int mb, int nb) {
  int rows = p->m - mb * 16 < 16 ? p->m - mb * 16 : 16;
  for (int r = 0; r < rows; r++) {
    float *dst = p->c + (size_t)(mb * 16 + r) * p->ldc + nb * 16;
    for (int j = 0; j < 16; j++)
      dst[j] = p->beta == 0.0f ? p->alpha * tile[r * 16 + j] : p->alpha * tile[r * 16 + j] + p->beta * dst[j];
  }
}

#define FLUSH(t, mb, nb)              \
  do {                                \
    _tile_stored(t, block, 64);       \
    write_block(p, block, (mb), (nb)); \
  } while (0)

/* k step kb of blocks_1x2: A into tile ta, the two n-blocks into tb0 and tb1
 * (tile numbers must be constants, hence a macro). */
#define STEP_1X2(kb, ta, tb0, tb1)                          \
  do {                                                      \
    _tile_loadd(ta, A_TILE(p, mb, kb), p->k * 2);           \
    _tile_loadd(tb0, B_TILE(p, nb, kb), 64);                \
    _tile_dpbf16ps(0, ta, tb0);                             \
    if (two) {                                              \
      _tile_loadd(tb1, B_TILE(p, nb + 1, kb), 64);          \
      _tile_dpbf16ps(1, ta, tb1);                           \
    }                                                       \
  } while (0)

/* One m-block by one or two n-blocks. Even and odd k steps load into different
 * tiles, so the next loads overlap the running products. */
static void blocks_1x2(const product_t *p, int mb, int nb, int two) {
  float block[256] __attribute__((aligned(64)));
  _tile_zero(0);
  _tile_zero(1);
  int kb = 0;
  for (; kb + 1 < p->kbs; kb += 2) {
    STEP_1X2(kb, 2, 4, 5);
    STEP_1X2(kb + 1, 3, 6, 7);
  }
  if (kb < p->kbs) STEP_1X2(kb, 2, 4, 5);
  FLUSH(0, mb, nb);
  if (two) FLUSH(1, mb, nb + 1);
}

/* Two m-blocks by two n-blocks: each loaded tile feeds two products. */
static void blocks_2x2(const product_t *p, int mb, int nb) {
  float block[256] __attribute__((aligned(64)));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int kb = 0; kb < p->kbs; kb++) {
    _tile_loadd(4, A_TILE(p, mb, kb), p->k * 2);
    _tile_loadd(6, B_TILE(p, nb, kb), 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, B_TILE(p, nb + 1, kb), 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, A_TILE(p, mb + 1, kb), p->k * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  FLUSH(0, mb, nb);
  FLUSH(1, mb, nb + 1);
  FLUSH(2, mb + 1, nb);
  FLUSH(3, mb + 1, nb + 1);
}

static void multiply(const product_t *p, int n) {
  int nbs = n / 16, mbs = (p->m + 15) / 16;
  if (!tiles_configured) configure_tiles();
  for (int nb = 0; nb < nbs; nb += 2) { /* n outermost: two n-blocks of W stay in cache over all of A */
    int two = nb + 1 < nbs, mb = 0;
    if (two)
      for (; mb + 1 < mbs; mb += 2) blocks_2x2(p, mb, nb);
    for (; mb < mbs; mb++) blocks_1x2(p, mb, nb, two);
  }
}

/* C (m x n) = alpha * A (m x k, row stride lda) . W^T + beta * C, when W is
 * packed with this n and k; returns 0 (and touches nothing) otherwise. The read
 * lock is held through the product: a model can be collected while a graph it
 * queued (mx.async_eval) still multiplies by its weights, and unpacking then
 * waits for the product instead of freeing the tiles under it; later products
 * find no copy and take the BLAS path on the float32 weights, which the graph
 * keeps alive. */
int tierlm_amx_sgemm(int m, int n, int k, float alpha, const float *a, int lda, const float *w,
                     float beta, float *c, int ldc) {
  pthread_rwlock_rdlock(&table_lock);
  pack_t *slot = find(w);
  const uint16_t *b = slot && slot->n == n && slot->k == k ? slot->tiles : 0;
  const uint16_t *a16 = b ? a_as_bf16(a, m, k, lda) : 0;
  if (a16) {
    product_t p = {a16, b, m, k, k / 32, alpha, beta, c, ldc};
    multiply(&p, n);
  }
  pthread_rwlock_unlock(&table_lock);
  return a16 != 0;
}

#pragma GCC pop_options
#else
int tierlm_amx_compiled(void) { return 0; }

int tierlm_amx_available(void) { return 0; }

int tierlm_amx_sgemm(int m, int n, int k, float alpha, const float *a, int lda, const float *w,
                     float beta, float *c, int ldc) {
  return 0;
}
#endif
