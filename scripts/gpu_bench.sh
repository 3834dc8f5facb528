#!/usr/bin/env bash
# The GPU runs (docs/benchmarks.md, "Tools"), from the repository root of a tree
# where `python -m tierlm.cli` works on MLX's GPU backend. No weights are needed:
# for each preset, a random-weight model with real shapes (bf16, the vocabulary
# and tokenizer of $TOKENIZER, a model folder), its decode roofline, tierlm's
# engine vs a bare BatchGenerator, and tierlm served over HTTP at each of
# $BATCHES streams. Results: $OUT/{roofline,engine,serve}-<preset>.json; copy
# them to docs/bench-results/<machine>/ and run `python -m bench_lab.docs`.
# Without .git in the tree, set TIERLM_BENCH_GIT=<commit> for the result files.
set -uo pipefail
OUT=${OUT:-/tmp/bench-out}
PRESETS=${PRESETS:-"llama-1b llama-8b"}
TOKENIZER=${TOKENIZER:-.bench/tokenizer}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-256}
BATCHES=${BATCHES:-1,8,32,64}
ROUNDS=${ROUNDS:-2}
PY=${PY:-python3}
PORT=${PORT:-8765}
MODELS=${MODELS:-/tmp/bench-models}  # scratch: each model is removed after its runs
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
log() { echo "[$(date +%H:%M:%S)] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
for preset in $PRESETS; do
  model=$MODELS/$preset
  log "$preset: writing random weights"
  timeout 240 $PY -m bench_lab.make_model "$preset" "$model" --tokenizer "$TOKENIZER" || continue
  log "$preset: roofline"
  timeout 120 $PY -m bench_lab.roofline --model "$model" --batch "$BATCHES" \
    --context $((INPUT_LEN + OUTPUT_LEN)) --json "$OUT/roofline-$preset.json"
  log "$preset: engine vs bare BatchGenerator"
  timeout 300 $PY -m tierlm.cli bench engine --model "$model" --batch "$BATCHES" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --rounds "$ROUNDS" --queue-factor 4 \
    --json "$OUT/engine-$preset.json"
  log "$preset: served"
  port=$PORT
  $PY -m tierlm.cli serve --model "$model" --port $port --max-concurrent-requests 64 \
    --log-level warning > "$OUT/serve-$preset.log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
  timeout 300 $PY -m tierlm.cli bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$model" \
    --concurrency "$BATCHES" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --no-progress \
    --prompts-per-concurrency 4 --min-prompts 4 \
    --json "$OUT/serve-$preset.json"
  kill "$pid"; wait "$pid" 2>/dev/null
  tail -5 "$OUT/serve-$preset.log"
  rm -rf "$model"
  log "$preset: done"
done
