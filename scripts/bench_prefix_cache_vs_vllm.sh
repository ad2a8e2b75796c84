#!/usr/bin/env bash
# Prefix-cache workloads side by side in one run: vLLM-CPU (automatic prefix caching on),
# pdserve colocated with its prefix cache, and pdserve with --disable-prefix-cache, on the same
# converted default model, one server at a time on 127.0.0.1. Benchmark only (never in CI).
#   bash scripts/bench_prefix_cache_vs_vllm.sh [OUT_DIR]      (ROUNDS=3: rounds, summarised by medians)
# Needs ../shared/tools/vllm-cpu setup done once. Each load generator is the same for all three:
#   shared prefix: vLLM's own `bench serve --dataset-name prefix_repetition`
#   multi-turn and no-sharing: `pdserve bench serve` (multi-turn resends the real answers)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench_common.sh
PREFIX_LEN=${PREFIX_LEN:-1024} SUFFIX_LEN=${SUFFIX_LEN:-64} PREFIXES=${PREFIXES:-4}
OUTPUT_LEN=${OUTPUT_LEN:-32} PROMPTS=${PROMPTS:-64} CONC=${CONC:-4}
trap stop EXIT

shared_prefix() {  # $1 name, $2 round: vLLM's generator, its prefix_repetition dataset
  "$VLLM" bench --backend openai --base-url "$URL" --endpoint /v1/completions --model default \
    --tokenizer "$MODEL_DIR" --dataset-name prefix_repetition --num-prompts "$PROMPTS" \
    --prefix-repetition-prefix-len "$PREFIX_LEN" --prefix-repetition-suffix-len "$SUFFIX_LEN" \
    --prefix-repetition-num-prefixes "$PREFIXES" --prefix-repetition-output-len "$OUTPUT_LEN" \
    --max-concurrency "$CONC" --ignore-eos --temperature 0 --seed 1 \
    --save-result --result-dir "$OUT" --result-filename "$1-shared-prefix-r$2.json" > "$OUT/$1-shared-prefix-r$2.txt" 2>&1
  grep -E "Mean TTFT|Median TTFT|Output token throughput|Mean TPOT" "$OUT/$1-shared-prefix-r$2.txt" | sed "s/^/$1 shared-prefix r$2: /"
}

ours() {  # $1 name, $2 round, $3 dataset, more: extra flags of pdserve bench serve
  local name=$1 r=$2 ds=$3; shift 3
  $PY -m pdserve bench serve --url "$URL" --backend openai-chat --model default --tokenizer "$MODEL_DIR" \
    --dataset "$ds" --random-output-len "$OUTPUT_LEN" --max-concurrency "$CONC" --flush-cache \
    --disable-tqdm --output "$OUT/$name-$ds-r$r.json" "$@" > "$OUT/$name-$ds-r$r.txt" 2>&1
  grep -iE "mean ttft|output token throughput|cache hit" "$OUT/$name-$ds-r$r.txt" | sed "s/^/$name $ds r$r: /"
}

workloads() {  # $1 name, $2 round
  shared_prefix "$1" "$2"
  ours "$1" "$2" multi-turn --multi-turn-conversations 4 --multi-turn-turns 6 --multi-turn-first-len 1024 \
    --multi-turn-question-len 48
  ours "$1" "$2" random --num-prompts 24 --random-input-len 1024 --random-output-len "$OUTPUT_LEN"
}

run_vllm() {  # $1 round
  echo "== round $1: vLLM-CPU (prefix caching on; dev mode for its /reset_prefix_cache)"
  VLLM_SERVER_DEV_MODE=1 setsid "$VLLM" serve "$MODEL_DIR" "$PORT" --enable-prefix-caching > "$OUT/vllm-server-r$1.log" 2>&1 & pid=$!
  wait_up "$OUT/vllm-server-r$1.log"; workloads vllm "$1"; stop
}

run_pdserve() {  # $1 round, $2 on|off (the prefix cache)
  local flag=""; [ "$2" = off ] && flag=--disable-prefix-cache
  echo "== round $1: pdserve colocated, prefix cache $2"
  setsid $PY -m pdserve serve --role colocated --host 127.0.0.1 --port "$PORT" --served-model-name default \
    --max-total-tokens 65536 $flag ${PDSERVE_ARGS:-} > "$OUT/pdserve-$2-server-r$1.log" 2>&1 & pid=$!
  wait_up "$OUT/pdserve-$2-server-r$1.log"; workloads "pdserve-$2" "$1"; stop
}

# ROUNDS rounds (default 3), vLLM and pdserve with its cache each once per round, the order
# alternating; pdserve without its cache (the reference for what the cache saves) in round 1 only
for r in $(seq "${ROUNDS:-3}"); do
  if [ $((r % 2)) = 1 ]; then run_vllm "$r"; run_pdserve "$r" on; else run_pdserve "$r" on; run_vllm "$r"; fi
  [ "$r" = 1 ] && run_pdserve "$r" off
done
$PY -m pdserve bench rounds "$OUT" --json "$OUT/rounds.json"
echo "results in $OUT"
