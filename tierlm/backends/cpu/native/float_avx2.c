/* The float kernels (softmax.c, swiglu.c, exact_gemm.c, qgemm_float.c) with 8 lanes of AVX2
 * and FMA: each exported name ends in _avx2 (simd.h's SIMD_NAME). */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#define SIMD_WIDTH 8
#include "simd.h"

#include "exact_gemm.c"
#include "softmax.c"
#include "swiglu.c"
#include "qgemm_float.c" /* last: its tile macros are short names */
#endif
