#!/usr/bin/env bash
# Long prompts side by side in one run: vLLM-CPU and pdserve colocated (both prefix caching off,
# same converted default model, one server at a time on 127.0.0.1), with vLLM's own load
# generator for both. Each case runs alone and again beside one CPU-bound process.
#   bash scripts/bench_long_prompts_vs_vllm.sh [OUT_DIR]      (benchmark only, never in CI)
# Cases: one request at a time with max_tokens 1 at 1k/2k/4k/8k prompt tokens (TTFT = prefill
# time, median of 5), and 16 random 1088-token prompts, 32 output tokens, 4 in flight.
# Knobs (environment): LENS, PREFILL_RUNS, FLIGHT_PROMPTS, SKIP_VLLM=1, SKIP_BUSY=1, PDSERVE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench_common.sh
LENS=${LENS:-"1024 2048 4096 8000"}
hog=""
stop_hog() { if [ -n "$hog" ]; then kill "$hog" 2>/dev/null || true; wait "$hog" 2>/dev/null || true; fi; hog=""; }
trap 'stop; stop_hog' EXIT

bench() {  # $1 result name, more: vLLM bench serve flags
  local name=$1; shift
  "$VLLM" bench --backend openai --base-url "$URL" --endpoint /v1/completions --model default \
    --tokenizer "$MODEL_DIR" --dataset-name random --ignore-eos --temperature 0 --seed 1 \
    --save-result --result-dir "$OUT" --result-filename "$name.json" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: $(grep -E 'Median TTFT|Mean TTFT|Output token throughput' "$OUT/$name.txt" | tr -s ' ' | tr '\n' ';')"
}

cases() {  # $1 system name
  local modes="alone busy"
  [ -n "${SKIP_BUSY:-}" ] && modes=alone
  for hogged in $modes; do
    [ "$hogged" = busy ] && { python3 -c 'while True: pass' & hog=$!; }
    for n in $LENS; do
      bench "$1-$hogged-prefill-$n" --random-input-len "$n" --random-output-len 1 --num-prompts "${PREFILL_RUNS:-5}" \
        --max-concurrency 1 --random-range-ratio 0
    done
    bench "$1-$hogged-4-in-flight" --random-input-len 1088 --random-output-len 32 --num-prompts "${FLIGHT_PROMPTS:-16}" \
      --max-concurrency 4 --random-range-ratio 0
    stop_hog
  done
}

if [ -z "${SKIP_VLLM:-}" ]; then
echo "== vLLM-CPU (prefix caching off)"
setsid "$VLLM" serve "$MODEL_DIR" "$PORT" --no-enable-prefix-caching --max-model-len 8192 \
  > "$OUT/vllm-server.log" 2>&1 & pid=$!
wait_up "$OUT/vllm-server.log"; cases vllm; stop
fi

echo "== pdserve colocated (prefix cache off)"
setsid $PY -m pdserve serve --role colocated --host 127.0.0.1 --port "$PORT" --served-model-name default \
  --max-total-tokens 65536 --disable-prefix-cache ${PDSERVE_ARGS:-} > "$OUT/pdserve-server.log" 2>&1 & pid=$!
wait_up "$OUT/pdserve-server.log"; cases pdserve; stop
echo "results in $OUT"
