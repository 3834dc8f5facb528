/* What the CPU offers tierlm's kernels, capped by TIERLM_MAX_CPU_ISA
 * (cpu_features.c). Every kernel choice in native/ asks here instead of asking
 * the CPU, so that one setting makes the whole library choose as it would on a
 * smaller CPU. isa.py mirrors this enum, in this order. */
#ifndef TIERLM_CPU_FEATURES_H
#define TIERLM_CPU_FEATURES_H

typedef enum {
  CPU_AVX2,
  CPU_FMA,
  CPU_AVX_VNNI,
  CPU_AVX512F,
  CPU_AVX512BW,
  CPU_AVX512VL,
  CPU_AVX512VBMI,
  CPU_AVX512BF16,
  CPU_AMX_BF16,
  CPU_AVX512VNNI,
  CPU_FEATURES
} tierlm_cpu_feature;

/* 1 when the CPU has `feature` and the cap lets the kernels use it. */
int tierlm_cpu_has(tierlm_cpu_feature feature);

/* 1 when the CPU has `feature` but the cap hides it (the log says so). */
int tierlm_cpu_hidden(tierlm_cpu_feature feature);

/* The cap in force: "native", "avx512", "avx-vnni" or "avx2"; a value it does
 * not know, as it was given (every feature is then hidden). */
const char *tierlm_cpu_cap(void);

#endif
