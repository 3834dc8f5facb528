/* Calls served, per kernel, over the whole process: the route's self-check
 * reads the first (did MLX's matmul reach cblas_sgemm here?), the tests the rest
 * (did a kernel reported in use run?). native.py reads tierlm_counts by name, in
 * this order. Relaxed atomic adds: a few per matmul, against thousands of cycles. */
#ifndef TIERLM_COUNTERS_H
#define TIERLM_COUNTERS_H

enum {
  COUNT_SGEMM,       /* cblas_sgemm calls the route took */
  COUNT_SGEMM_AMX,   /* ... sent to amx_bf16.c */
  COUNT_SGEMM_EXACT, /* ... to exact_gemm.c */
  COUNT_SGEMM_GEMV,  /* ... to the BLAS's cblas_sgemv */
  COUNT_SGEMM_BLAS,  /* ... to the BLAS's cblas_sgemm */
  COUNT_SOFTMAX,     /* tierlm_softmax_rows calls */
  COUNT_SWIGLU,      /* tierlm_swiglu calls */
  COUNT_LOGSUMEXP,   /* tierlm_logsumexp_rows calls */
  COUNT_GELU,        /* tierlm_gelu_approx and tierlm_gelu_erf calls */
  COUNT_QMM,         /* quantized matmuls qgemm.c computed */
  COUNT_KINDS
};

extern unsigned long tierlm_counts[COUNT_KINDS];

#define TIERLM_COUNT(kind) __atomic_fetch_add(&tierlm_counts[kind], 1, __ATOMIC_RELAXED)

#endif
