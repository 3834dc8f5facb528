/* The CPU's features as tierlm's kernels see them: what the CPU reports, capped
 * by TIERLM_MAX_CPU_ISA (as oneDNN's ONEDNN_MAX_CPU_ISA and MKL's
 * MKL_ENABLE_INSTRUCTIONS cap theirs), so that an AVX-512 machine can run this
 * library exactly as an AVX2-only one (a CI machine, say) would:
 *
 *   avx2      AVX2 and FMA; no AVX-VNNI, no AVX-512, no AMX
 *   avx-vnni  that and AVX-VNNI
 *   avx512    that and every AVX-512 extension the CPU has; no AMX
 *   native    whatever the CPU has (also when unset or empty)
 *
 * A value it does not know (the case is ignored) is not guessed at: every
 * feature reads as absent, and route.py and quantized.py turn off what the cap
 * governs, naming the values it takes. Read once, on the first question. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

#include "cpu_features.h"

/* The caps, each allowing what the ones before it allow. */
enum { CAP_UNKNOWN, CAP_AVX2, CAP_AVX_VNNI, CAP_AVX512, CAP_NATIVE };

static const char *const cap_names[] = {[CAP_AVX2] = "avx2", [CAP_AVX_VNNI] = "avx-vnni",
                                        [CAP_AVX512] = "avx512", [CAP_NATIVE] = "native"};

/* The lowest cap that lets each feature through. */
static const int needs_cap[CPU_FEATURES] = {
    [CPU_AVX2] = CAP_AVX2,         [CPU_FMA] = CAP_AVX2,          [CPU_AVX_VNNI] = CAP_AVX_VNNI,
    [CPU_AVX512F] = CAP_AVX512,    [CPU_AVX512BW] = CAP_AVX512,   [CPU_AVX512VL] = CAP_AVX512,
    [CPU_AVX512VBMI] = CAP_AVX512, [CPU_AVX512BF16] = CAP_AVX512, [CPU_AMX_BF16] = CAP_NATIVE,
    [CPU_AVX512VNNI] = CAP_AVX512,
};

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int cap;
static char cap_text[64];
static int present[CPU_FEATURES]; /* what the CPU itself reports */

static void detect(void) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  present[CPU_AVX2] = __builtin_cpu_supports("avx2");
  present[CPU_FMA] = __builtin_cpu_supports("fma");
  present[CPU_AVX_VNNI] = __builtin_cpu_supports("avxvnni");
  present[CPU_AVX512F] = __builtin_cpu_supports("avx512f");
  present[CPU_AVX512BW] = __builtin_cpu_supports("avx512bw");
  present[CPU_AVX512VL] = __builtin_cpu_supports("avx512vl");
  present[CPU_AVX512VBMI] = __builtin_cpu_supports("avx512vbmi");
  present[CPU_AVX512BF16] = __builtin_cpu_supports("avx512bf16");
  present[CPU_AVX512VNNI] = __builtin_cpu_supports("avx512vnni");
#if !defined(TIERLM_NO_AMX) /* compilers without AMX (native.py's retry) know no "amx-bf16" either */
  present[CPU_AMX_BF16] = __builtin_cpu_supports("amx-bf16");
#endif
#endif /* elsewhere none of these exist */
  const char *value = getenv("TIERLM_MAX_CPU_ISA");
  if (value == NULL || *value == '\0') value = "native";
  cap = CAP_UNKNOWN;
  for (int c = CAP_AVX2; c <= CAP_NATIVE; c++)
    if (strcasecmp(value, cap_names[c]) == 0) cap = c;
  snprintf(cap_text, sizeof cap_text, "%s", cap == CAP_UNKNOWN ? value : cap_names[cap]);
}

int tierlm_cpu_has(tierlm_cpu_feature feature) {
  pthread_once(&once, detect);
  return (unsigned)feature < CPU_FEATURES && present[feature] && cap >= needs_cap[feature];
}

int tierlm_cpu_hidden(tierlm_cpu_feature feature) {
  pthread_once(&once, detect);
  return (unsigned)feature < CPU_FEATURES && present[feature] && cap < needs_cap[feature];
}

const char *tierlm_cpu_cap(void) {
  pthread_once(&once, detect);
  return cap_text;
}
