#!/usr/bin/env bash
# This machine's CPU runs, written to docs/bench-results/cpu/, then docs/benchmarks.md.
# Options: SKIP_COMPARE, SKIP_ENGINE, MULTI_TURN, SHARED_PREFIX, CPU_TARGETS, QWEN_CODER (=1 to set);
# THREADS for QWEN_CODER (both servers; default: every CPU this may use).
# Small on purpose (a 2-core machine shared with other work): the ratios of runs
# made side by side are what count, not the absolute numbers. llama-server gets
# one thread: with two, on cores that other processes also use, its spinning
# thread barriers collapsed it to 1-8 tok/s (compare-random-llama-t2.json).
# --threads gives tierlm the same count (since issue #33; the results of before
# ran tierlm on every core).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
OUT=${OUT:-docs/bench-results/cpu}
ROUNDS=${ROUNDS:-2}
PY=${PY:-python}  # the Python tierlm is installed in: bench_lab runs from this tree
mkdir -p "$OUT"
bash scripts/build_llama_server.sh >/dev/null
if [ -z "${SKIP_COMPARE:-}" ]; then
  tierlm bench compare --servers tierlm,mlx_lm,llama --threads "${LLAMA_THREADS:-1}" \
    --concurrency 1,4,16 --rounds "$ROUNDS" --workload random --input-len 32 --output-len 16 \
    --prompts-per-concurrency 1 --min-prompts 2 --json "$OUT/compare-random.json"
fi
if [ -z "${SKIP_ENGINE:-}" ]; then
  tierlm bench engine --batch 1,8,32 --input-len 32 --output-len 64 --rounds "${ENGINE_ROUNDS:-6}" \
    --json "$OUT/engine-smollm2.json"  # 6 rounds: 2-3 could not resolve 3 % on this machine
fi
"$PY" -m bench_lab.docs
if [ -n "${MULTI_TURN:-}" ]; then  # a coding agent's pattern: the history is resent every turn
  tierlm bench compare --servers tierlm,llama --threads "${LLAMA_THREADS:-1}" --concurrency 1,4 \
    --rounds "$ROUNDS" --workload multi-turn --turns 3 --system-len 256 --input-len 32 --output-len 16 \
    --num-prompts 4 --json "$OUT/compare-multi-turn.json"
  "$PY" -m bench_lab.docs
fi
if [ -n "${SHARED_PREFIX:-}" ]; then  # many requests over a few long prefixes: the prefix cache's case
  tierlm bench compare --servers tierlm,llama --threads "${LLAMA_THREADS:-1}" --concurrency 1,4 \
    --rounds "$ROUNDS" --workload shared-prefix --num-prefixes 2 --prefix-len 1024 --suffix-len 32 \
    --output-len 16 --num-prompts 8 --json "$OUT/compare-shared-prefix.json"
  "$PY" -m bench_lab.docs
fi
if [ -n "${CPU_TARGETS:-}" ]; then  # the CPU fast path's targets: 1 and 16 streams, TTFT of a 500-token prompt
  for threads in 1 2; do
    tierlm bench compare --servers tierlm,llama --threads "$threads" --concurrency 1,16 \
      --rounds "$ROUNDS" --workload random --input-len 32 --output-len 64 \
      --prompts-per-concurrency 1 --min-prompts 2 --json "$OUT/compare-decode-llama-t$threads.json"
    tierlm bench compare --servers tierlm,llama --threads "$threads" --concurrency 1 \
      --rounds "$ROUNDS" --workload random --input-len 500 --output-len 4 --num-prompts 3 \
      --json "$OUT/compare-ttft500-llama-t$threads.json"
  done
  "$PY" -m bench_lab.docs
fi
if [ -n "${QWEN_CODER:-}" ]; then  # issue #33: Qwen2.5-Coder-0.5B (Q4_K_M) against llama-server, same threads
  tierlm bench compare --model qwen2.5-coder-0.5b --servers tierlm,llama --workload chat \
    --concurrency 1,4,16 --output-len 64 --ttft-prompt-len 2048 --rounds "$ROUNDS" \
    ${THREADS:+--threads "$THREADS"} --json "$OUT/compare-qwen-coder.json"
  "$PY" -m bench_lab.docs
fi
