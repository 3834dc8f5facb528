/* Routes MLX's float32 matmuls to the best kernel this CPU has for them.
 *
 * MLX's CPU backend calls cblas_sgemm for every float32 matmul. This library
 * defines cblas_sgemm and sends each call:
 * - to amx_bf16.c when B is a weight packed there (CPUs with AMX; the weight is
 *   read as bfloat16, half the bytes, on the tile unit);
 * - products with a small k after a transposed B, or a small n (attention's
 *   scores and weighted values), to exact_gemm.c (CPUs with AVX2 or AVX-512), which sums
 *   each element in one fixed order: batching and padding then change no bit;
 * - for one-row products (decoding one sequence), to cblas_sgemv: OpenBLAS's
 *   sgemm handles 1 x K by K x N far below memory bandwidth, its sgemv reads the
 *   same weights ~2-3x faster here;
 * - everything else to the real cblas_sgemm.
 * tierlm/backends/cpu/native.py builds it with the system C compiler and loads
 * it with RTLD_LOCAL; route.py calls tierlm_route_open() with the real BLAS
 * (loaded with RTLD_LOCAL too), then writes this cblas_sgemm's address into the
 * slot through which MLX's library calls cblas_sgemm (got.py), and proves with
 * one product that the calls arrive (counters.h). */
#include <dlfcn.h>

#include "counters.h"

unsigned long tierlm_counts[COUNT_KINDS];

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

int tierlm_amx_sgemm(int m, int n, int k, float alpha, const float *a, int lda, const float *w,
                     float beta, float *c, int ldc);
int tierlm_float_lanes(void);
int tierlm_exact_sgemm(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int one_row_route = 1, exact_route;

/* Returns 1 when the real BLAS is loaded and has both functions. */
int tierlm_route_open(const char *path, int route_one_row, int route_exact) {
  void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!handle) return 0;
  real_sgemm = (sgemm_fn)dlsym(handle, "cblas_sgemm");
  real_sgemv = (sgemv_fn)dlsym(handle, "cblas_sgemv");
  one_row_route = route_one_row;
  exact_route = route_exact && tierlm_float_lanes();
  return real_sgemm != 0 && real_sgemv != 0;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C,
                 int ldc) {
  TIERLM_COUNT(COUNT_SGEMM);
  /* x . W^T with W stored N x K, as nn.Linear multiplies */
  if (order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && ldb == K &&
      tierlm_amx_sgemm(M, N, K, alpha, A, lda, B, beta, C, ldc)) {
    TIERLM_COUNT(COUNT_SGEMM_AMX);
    return;
  }
  if (exact_route && order == ROW_MAJOR && trans_a == NO_TRANS &&
      tierlm_exact_sgemm(trans_b == TRANS, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
    TIERLM_COUNT(COUNT_SGEMM_EXACT);
    return;
  }
  if (one_row_route && order == ROW_MAJOR && M == 1) {
    TIERLM_COUNT(COUNT_SGEMM_GEMV);
    /* C (1 x N) = alpha * a (1 x K) . op(B) (K x N) + beta * C, as y = op(B)^T a. */
    int inc_a = trans_a == NO_TRANS ? 1 : lda;
    if (trans_b == TRANS) /* B is stored N x K */
      real_sgemv(ROW_MAJOR, NO_TRANS, N, K, alpha, B, ldb, A, inc_a, beta, C, 1);
    else /* B is stored K x N */
      real_sgemv(ROW_MAJOR, TRANS, K, N, alpha, B, ldb, A, inc_a, beta, C, 1);
    return;
  }
  TIERLM_COUNT(COUNT_SGEMM_BLAS);
  real_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
