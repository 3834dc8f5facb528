#!/usr/bin/env bash
# Runs ON the GPU device machine after the staging calls (scripts/gpu_run.md):
# tierlm served on llama-1b's shapes with uvicorn on asyncio + h11 against
# uvloop + httptools, alternating, at high concurrency. Results: $OUT/serve-http-*.json.
set -uo pipefail
OUT=${OUT:-/tmp/bench-out}
PY=${PY:-python3}
ROUNDS=${ROUNDS:-2}
model=/tmp/bench-models/llama-1b
mkdir -p "$OUT"
timeout 150 $PY -m tierlm.cli bench make-model llama-1b "$model" --tokenizer .bench/tokenizer || exit 1
serve() {  # loop http: tierlm serve with uvicorn's event loop and HTTP parser forced
  $PY -c "import sys, uvicorn; run = uvicorn.run
uvicorn.run = lambda app, **kw: run(app, **{**kw, 'loop': sys.argv[1], 'http': sys.argv[2]})
from tierlm.cli import main; sys.exit(main(sys.argv[3:]))" "$1" "$2" serve --model "$model" --port 8765 \
    --max-concurrent-requests 64 --log-level warning &
}
for round in $(seq "$ROUNDS"); do
  for variant in "asyncio h11" "uvloop httptools"; do
    set -- $variant
    serve "$1" "$2"; pid=$!
    for _ in $(seq 240); do curl -sf 127.0.0.1:8765/health >/dev/null && break; sleep 0.5; done
    timeout 120 $PY -m tierlm.cli bench serve --base-url http://127.0.0.1:8765 --tokenizer "$model" \
      --concurrency 32,64 --input-len 512 --output-len 128 --prompts-per-concurrency 2 --no-progress \
      --json "$OUT/serve-http-$2-r$round.json" | tail -4
    kill "$pid"; wait "$pid" 2>/dev/null
  done
done
