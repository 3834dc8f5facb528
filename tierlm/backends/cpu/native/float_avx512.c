/* The float kernels (softmax.c, swiglu.c, exact_gemm.c, qgemm_float.c) with 16 lanes of
 * AVX-512F: each exported name ends in _avx512 (simd.h's SIMD_NAME). */
#if defined(__x86_64__)
#pragma GCC target("avx512f,avx2,fma,f16c")
#define SIMD_WIDTH 16
#include "simd.h"

#include "exact_gemm.c"
#include "softmax.c"
#include "swiglu.c"
#include "qgemm_float.c" /* last: its tile macros are short names */
#endif
