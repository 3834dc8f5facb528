/* A small pool of helper threads for the native kernels.
 *
 * MLX's CPU backend runs one operation at a time on one thread per stream; only
 * the BLAS spreads over the cores. So while attention's products run in
 * exact_gemm.c, the other cores sat idle: a long prompt's attention ran at one
 * core's speed. tierlm_parallel shares a product's independent parts (blocks of
 * output elements, each computed whole by one thread, in the same order) over
 * one thread per core, so the bits do not depend on the split. Between jobs a
 * helper first watches for the next one for a while (SPIN: a decode step sends
 * one quantized product after another, tens of microseconds apart, and waking a
 * sleeping thread took about as long as a product), then sleeps on a condition
 * variable (the BLAS's threads need the cores when tierlm's are idle). The
 * caller watches for the helpers' end the same way. One job at a time; a second
 * caller (another model's stream) computes alone. TIERLM_NATIVE_THREADS sets the
 * count (1: no helpers). */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include "threads.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#define MAX_THREADS 16
#define SPIN_NS 200000L /* how long an idle thread watches before it sleeps */

static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER; /* held by the caller of a job */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t start = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static int threads = 1;
static unsigned long generation;
static int pending;
static tierlm_part_fn job_fn;
static void *job_arg;
static int job_parts;

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

/* Spins while the job counter still reads `seen`, for at most SPIN_NS. */
static void watch_for_job(unsigned long seen) {
  long until = now_ns() + SPIN_NS;
  for (int i = 1; __atomic_load_n(&generation, __ATOMIC_ACQUIRE) == seen; i++) {
    if (i % 256 == 0 && now_ns() > until) return;
    relax();
  }
}

/* Spins while helpers are still working, for at most SPIN_NS. */
static void watch_for_end(void) {
  long until = now_ns() + SPIN_NS;
  for (int i = 1; __atomic_load_n(&pending, __ATOMIC_ACQUIRE) > 0; i++) {
    if (i % 256 == 0 && now_ns() > until) return;
    relax();
  }
}

static void *helper(void *arg) {
  int part = (int)(long)arg;
  unsigned long seen = 0;
  for (;;) {
    watch_for_job(seen);
    pthread_mutex_lock(&lock);
    while (generation == seen) pthread_cond_wait(&start, &lock);
    seen = generation;
    tierlm_part_fn fn = job_fn;
    void *a = job_arg;
    int parts = job_parts;
    pthread_mutex_unlock(&lock);
    if (part < parts) fn(a, part, parts);
    pthread_mutex_lock(&lock);
    if (__atomic_sub_fetch(&pending, 1, __ATOMIC_RELEASE) == 0) pthread_cond_signal(&done);
    pthread_mutex_unlock(&lock);
  }
  return 0;
}

static void start_pool(void) {
  int n = 1;
  const char *env = getenv("TIERLM_NATIVE_THREADS");
  if (env && atoi(env) > 0) n = atoi(env);
  else {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
  }
  if (n > MAX_THREADS) n = MAX_THREADS;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 1 << 20);
  int started = 1;
  for (int i = 1; i < n; i++) {
    pthread_t t;
    if (pthread_create(&t, &attr, helper, (void *)(long)i) != 0) break;
    started++;
  }
  pthread_attr_destroy(&attr);
  threads = started;
}

int tierlm_threads(void) {
  pthread_once(&once, start_pool);
  return threads;
}

void tierlm_parallel(tierlm_part_fn fn, void *arg, int max_parts) {
  int parts = max_parts < tierlm_threads() ? max_parts : threads;
  if (parts <= 1 || pthread_mutex_trylock(&busy) != 0) {
    fn(arg, 0, 1);
    return;
  }
  pthread_mutex_lock(&lock);
  job_fn = fn, job_arg = arg, job_parts = parts;
  __atomic_store_n(&pending, threads - 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&generation, 1, __ATOMIC_RELEASE); /* after the job's fields: a watching helper reads them next */
  pthread_cond_broadcast(&start);
  pthread_mutex_unlock(&lock);
  fn(arg, 0, parts);
  watch_for_end();
  pthread_mutex_lock(&lock);
  while (pending > 0) pthread_cond_wait(&done, &lock);
  pthread_mutex_unlock(&lock);
  pthread_mutex_unlock(&busy);
}

/* A job whose chunks go to whichever thread asks next. */
typedef struct {
  tierlm_part_fn fn;
  void *arg;
  int chunks, next;
} chunked_job;

static void take_chunks(void *arg, int part, int parts) {
  (void)part, (void)parts;
  chunked_job *c = arg;
  for (int i; (i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED)) < c->chunks;) c->fn(c->arg, i, c->chunks);
}

void tierlm_parallel_chunks(tierlm_part_fn fn, void *arg, int chunks) {
  chunked_job c = {fn, arg, chunks, 0};
  tierlm_parallel(take_chunks, &c, chunks);
}

void *tierlm_kept_buffer(void **kept, size_t *capacity, size_t bytes) {
  if (bytes > *capacity) {
    free(*kept);
    *kept = malloc(bytes);
    *capacity = bytes;
  }
  return *kept;
}
