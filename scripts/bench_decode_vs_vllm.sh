#!/usr/bin/env bash
# Decode speed side by side in one run: vLLM-CPU and pdserve colocated (same converted default
# model, one server at a time on 127.0.0.1, prefix caching off on both), with vLLM's own load
# generator for both: short random prompts (32 tokens), 64 output tokens each,
#   single stream: 8 requests one at a time;  32 concurrent: 64 requests, 32 in flight.
#   bash scripts/bench_decode_vs_vllm.sh [OUT_DIR]      (benchmark only, never in CI)
# ROUNDS (default 3) rounds, each server started once per round, the order alternating; prints
# each run's output token throughput, mean TPOT and TTFT, then per case each system's median
# over the rounds and the median of the per-round ratios (`pdserve bench rounds`).
# SKIP_VLLM=1 runs pdserve only.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench_common.sh
trap stop EXIT

bench() {  # $1 result name, more: vLLM bench serve flags
  local name=$1; shift
  "$VLLM" bench --backend openai --base-url "$URL" --endpoint /v1/completions --model default \
    --tokenizer "$MODEL_DIR" --dataset-name random --ignore-eos --temperature 0 --seed 1 \
    --random-input-len 32 --random-output-len 64 --random-range-ratio 0 \
    --save-result --result-dir "$OUT" --result-filename "$name.json" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: $(grep -E 'Output token throughput|Mean TPOT|Mean TTFT' "$OUT/$name.txt" | tr -s ' ' | tr '\n' ';')"
}

cases() {  # $1 system name, $2 round
  bench "$1-warmup" --num-prompts 2 --max-concurrency 1 >/dev/null
  bench "$1-single-r$2" --num-prompts "${SINGLE_PROMPTS:-8}" --max-concurrency 1
  bench "$1-32-r$2" --num-prompts "${MANY_PROMPTS:-64}" --max-concurrency 32
}

run_vllm() {  # $1 round
  [ -n "${SKIP_VLLM:-}" ] && return 0
  echo "== round $1: vLLM-CPU (prefix caching off)"
  setsid "$VLLM" serve "$MODEL_DIR" "$PORT" --no-enable-prefix-caching --max-model-len 4096 \
    > "$OUT/vllm-server-r$1.log" 2>&1 & pid=$!
  wait_up "$OUT/vllm-server-r$1.log"; cases vllm "$1"; stop
}

run_pdserve() {  # $1 round
  echo "== round $1: pdserve colocated (prefix cache off)"
  setsid $PY -m pdserve serve --role colocated --host 127.0.0.1 --port "$PORT" --served-model-name default \
    --max-total-tokens 65536 --disable-prefix-cache ${PDSERVE_ARGS:-} > "$OUT/pdserve-server-r$1.log" 2>&1 & pid=$!
  wait_up "$OUT/pdserve-server-r$1.log"; cases pdserve "$1"; stop
}

for r in $(seq "${ROUNDS:-3}"); do
  if [ $((r % 2)) = 1 ]; then run_vllm "$r"; run_pdserve "$r"; else run_pdserve "$r"; run_vllm "$r"; fi
done
$PY -m pdserve bench rounds "$OUT" --json "$OUT/rounds.json"
echo "results in $OUT"
