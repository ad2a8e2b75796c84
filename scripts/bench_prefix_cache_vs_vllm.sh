#!/usr/bin/env bash
# Prefix-cache workloads side by side in one run: vLLM-CPU (automatic prefix caching on),
# pdserve colocated with its prefix cache, and pdserve with --disable-prefix-cache, on the same
# converted default model, one server at a time on 127.0.0.1. Benchmark only (never in CI).
#   bash scripts/bench_prefix_cache_vs_vllm.sh [OUT_DIR]
# Needs ../shared/tools/vllm-cpu setup done once. Each load generator is the same for all three:
#   shared prefix: vLLM's own `bench serve --dataset-name prefix_repetition`
#   multi-turn and no-sharing: `pdserve bench serve` (multi-turn resends the real answers)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench_common.sh
PREFIX_LEN=${PREFIX_LEN:-1024} SUFFIX_LEN=${SUFFIX_LEN:-64} PREFIXES=${PREFIXES:-4}
OUTPUT_LEN=${OUTPUT_LEN:-32} PROMPTS=${PROMPTS:-64} CONC=${CONC:-4}
trap stop EXIT

shared_prefix() {  # $1 name: vLLM's generator, its prefix_repetition dataset
  "$VLLM" bench --backend openai --base-url "$URL" --endpoint /v1/completions --model default \
    --tokenizer "$MODEL_DIR" --dataset-name prefix_repetition --num-prompts "$PROMPTS" \
    --prefix-repetition-prefix-len "$PREFIX_LEN" --prefix-repetition-suffix-len "$SUFFIX_LEN" \
    --prefix-repetition-num-prefixes "$PREFIXES" --prefix-repetition-output-len "$OUTPUT_LEN" \
    --max-concurrency "$CONC" --ignore-eos --temperature 0 --seed 1 \
    --save-result --result-dir "$OUT" --result-filename "$1-shared-prefix.json" > "$OUT/$1-shared-prefix.txt" 2>&1
  grep -E "Mean TTFT|Median TTFT|Output token throughput|Mean TPOT" "$OUT/$1-shared-prefix.txt" | sed "s/^/$1 shared-prefix: /"
}

ours() {  # $1 name, $2 dataset, more: extra flags of pdserve bench serve
  local name=$1 ds=$2; shift 2
  $PY -m pdserve bench serve --url "$URL" --backend openai-chat --model default --tokenizer "$MODEL_DIR" \
    --dataset "$ds" --random-output-len "$OUTPUT_LEN" --max-concurrency "$CONC" --flush-cache \
    --disable-tqdm --output "$OUT/$name-$ds.json" "$@" > "$OUT/$name-$ds.txt" 2>&1
  grep -iE "mean ttft|output token throughput|cache hit" "$OUT/$name-$ds.txt" | sed "s/^/$name $ds: /"
}

workloads() {
  shared_prefix "$1"
  ours "$1" multi-turn --multi-turn-conversations 4 --multi-turn-turns 6 --multi-turn-first-len 1024 \
    --multi-turn-question-len 48
  ours "$1" random --num-prompts 24 --random-input-len 1024 --random-output-len "$OUTPUT_LEN"
}

echo "== vLLM-CPU (prefix caching on; dev mode for its /reset_prefix_cache)"
VLLM_SERVER_DEV_MODE=1 setsid "$VLLM" serve "$MODEL_DIR" "$PORT" --enable-prefix-caching > "$OUT/vllm-server.log" 2>&1 & pid=$!
wait_up "$OUT/vllm-server.log"; workloads vllm; stop

for mode in on off; do
  flag=""; [ "$mode" = off ] && flag=--disable-prefix-cache
  echo "== pdserve colocated, prefix cache $mode"
  setsid $PY -m pdserve serve --role colocated --host 127.0.0.1 --port "$PORT" --served-model-name default \
    --max-total-tokens 65536 $flag > "$OUT/pdserve-$mode-server.log" 2>&1 & pid=$!
  wait_up "$OUT/pdserve-$mode-server.log"; workloads "pdserve-$mode"; stop
done
echo "results in $OUT"
