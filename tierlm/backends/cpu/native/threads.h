/* Sharing one product out over the CPU's cores (threads.c). */
#ifndef TIERLM_THREADS_H
#define TIERLM_THREADS_H

#include <stddef.h>

typedef void (*tierlm_part_fn)(void *arg, int part, int parts);

/* Runs fn(arg, part, parts) for part = 0 .. parts - 1, parts = min(max_parts,
 * the pool's threads), part 0 on the calling thread; returns when all are done.
 * Another thread's job in flight, or max_parts <= 1: everything on the caller. */
void tierlm_parallel(tierlm_part_fn fn, void *arg, int max_parts);

/* The threads a job is shared over (the caller's included). */
int tierlm_threads(void);

/* A buffer of at least `bytes` kept in *kept (capacity in *capacity) for the
 * caller's next use, grown when too small: the quantized products' scratch,
 * one per thread (a fresh one every product cost page faults; a decode step
 * makes ~170). The pool's threads and MLX's live as long as the process. */
void *tierlm_kept_buffer(void **kept, size_t *capacity, size_t bytes);

#endif
