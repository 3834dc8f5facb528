/* Sharing one product out over the CPU's cores (threads.c). */
#ifndef TIERLM_THREADS_H
#define TIERLM_THREADS_H

#include <stddef.h>

typedef void (*tierlm_part_fn)(void *arg, int part, int parts);

/* Runs fn(arg, part, parts) for part = 0 .. parts - 1, parts = min(max_parts,
 * the pool's threads), part 0 on the calling thread; returns when all are done.
 * Another thread's job in flight, or max_parts <= 1: everything on the caller. */
void tierlm_parallel(tierlm_part_fn fn, void *arg, int max_parts);

/* Runs fn(arg, chunk, chunks) for chunk = 0 .. chunks - 1, each chunk taken by
 * whichever of the pool's threads is free next (the caller's included): a
 * thread the system stopped for a while leaves its share to the others, where
 * tierlm_parallel's fixed parts made every thread wait for it (a VM's stolen
 * core, or the Python thread building the next step on a 2-core machine).
 * Each chunk computed whole by one thread: the bits do not depend on who. */
void tierlm_parallel_chunks(tierlm_part_fn fn, void *arg, int chunks);

/* Chunks a quantized product's output columns are cut into for each thread:
 * enough that a stalled thread's share is taken by the others, few enough that
 * each stays a long stretch of weights for the prefetchers. */
#define CHUNKS_PER_THREAD 4

/* The threads a job is shared over (the caller's included). */
int tierlm_threads(void);

/* A buffer of at least `bytes` kept in *kept (capacity in *capacity) for the
 * caller's next use, grown when too small: the quantized products' scratch,
 * one per thread (a fresh one every product cost page faults; a decode step
 * makes ~170). The pool's threads and MLX's live as long as the process. */
void *tierlm_kept_buffer(void **kept, size_t *capacity, size_t bytes);

#endif
