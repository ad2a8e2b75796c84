#!/usr/bin/env bash
# The router's cache_aware policy against round_robin, side by side in one run: two prefill and
# two decode servers (dp 1, one torch thread each, the converted default model, 127.0.0.1), one
# router at a time in front of them, the same workloads through `pdserve bench serve`:
#   shared prefix: PREFIXES prefixes x SUFFIXES suffixes (PREFIX_LEN + SUFFIX_LEN tokens)
#   multi-turn:    CHATS chats x TURNS turns resending their real answers (CHATS odd: with an even
#                  count round_robin over two servers would keep every chat on one server by chance)
# Caches are flushed through the router before each workload; sglang-router 0.3.2's own
# cache_aware runs last as the anchor. Benchmark only (never in CI).
#   bash scripts/bench_cache_aware.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench_common.sh
PREFIXES=${PREFIXES:-8} SUFFIXES=${SUFFIXES:-4} PREFIX_LEN=${PREFIX_LEN:-512} SUFFIX_LEN=${SUFFIX_LEN:-32}
CHATS=${CHATS:-5} TURNS=${TURNS:-4} OUTPUT_LEN=${OUTPUT_LEN:-16} CONC=${CONC:-2}
pids=()
port() { $PY -c 'from pdserve.core.launcher import free_port; print(free_port())'; }
stop_all() { for p in "${pids[@]}"; do kill -- -"$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; pids=(); }
trap 'stop; stop_all' EXIT
up() {  # $1 url, $2 log
  for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  echo "not up: $1, log $2" >&2; tail -20 "$2" >&2; exit 1
}

common=(--model "$MODEL_DIR" --host 127.0.0.1 --num-threads 1 --max-total-tokens 32768 --served-model-name default)
router_args=()
for i in 1 2; do
  pp=$(port); bp=$(port); dp=$(port)
  setsid $PY -m pdserve serve --role prefill --port "$pp" --bootstrap-port "$bp" "${common[@]}" \
    > "$OUT/prefill$i.log" 2>&1 & pids+=($!)
  setsid $PY -m pdserve serve --role decode --port "$dp" "${common[@]}" > "$OUT/decode$i.log" 2>&1 & pids+=($!)
  up "http://127.0.0.1:$pp" "$OUT/prefill$i.log"; up "http://127.0.0.1:$dp" "$OUT/decode$i.log"
  router_args+=(--prefill "http://127.0.0.1:$pp" "$bp" --decode "http://127.0.0.1:$dp")
done

load() {  # $1 name, $2 dataset, more: flags
  local name=$1 ds=$2; shift 2
  $PY -m pdserve bench serve --url "$URL" --backend openai-completions --model default --tokenizer "$MODEL_DIR" \
    --dataset "$ds" --random-output-len "$OUTPUT_LEN" --max-concurrency "$CONC" --flush-cache --disable-tqdm \
    --output "$OUT/$name-$ds.json" "$@" > "$OUT/$name-$ds.txt" 2>&1
  grep -iE "mean ttft|median ttft|cache hit|output token throughput" "$OUT/$name-$ds.txt" | sed "s/^/$name $ds: /"
}

serving() {  # $1 log: until a /generate goes through (sglang-router adds workers after its checks)
  for _ in $(seq 120); do
    curl -sf "$URL/generate" -H 'Content-Type: application/json' \
      -d '{"text": "hi", "sampling_params": {"max_new_tokens": 1}}' >/dev/null && return 0; sleep 1
  done
  echo "not serving: $URL, log $1" >&2; tail -20 "$1" >&2; exit 1
}

# sglang-cache_aware: sglang-router 0.3.2 itself, --policy cache_aware with its defaults, as the anchor
for policy in cache_aware round_robin sglang-cache_aware; do
  echo "== router --policy $policy"
  if [ "$policy" = sglang-cache_aware ]; then
    setsid $PY -m sglang_router.launch_router --pd-disaggregation --host 127.0.0.1 --port "$PORT" \
      --policy cache_aware --prometheus-host 127.0.0.1 --prometheus-port "$(port)" --log-level warn \
      "${router_args[@]}" > "$OUT/router-$policy.log" 2>&1 & pid=$!
  else
    setsid $PY -m pdserve router --pd-disaggregation --host 127.0.0.1 --port "$PORT" --policy "$policy" \
      --log-level warning "${router_args[@]}" > "$OUT/router-$policy.log" 2>&1 & pid=$!
  fi
  serving "$OUT/router-$policy.log"
  load "$policy" shared-prefix --prefix-num-prefixes "$PREFIXES" --prefix-suffixes-per-prefix "$SUFFIXES" \
    --prefix-len "$PREFIX_LEN" --suffix-len "$SUFFIX_LEN" --num-prompts $((PREFIXES * SUFFIXES))
  load "$policy" multi-turn --multi-turn-conversations "$CHATS" --multi-turn-turns "$TURNS" \
    --multi-turn-first-len "$PREFIX_LEN" --multi-turn-question-len "$SUFFIX_LEN" --num-prompts $((CHATS * TURNS))
  stop
done
echo "results in $OUT"
