#!/usr/bin/env bash
# Serving throughput with a JSON schema against without, side by side in one run: one colocated
# server (the converted default model, one torch thread, 127.0.0.1), `pdserve bench serve` on
# /v1/completions with random prompts, ignore_eos and a fixed output length, plain and with
# response_format json_schema (pdserve/bench/structured_bench.py's schema: no valid answer ends
# before OUTPUT_LEN tokens, so both emit as many), at 1 (SINGLE requests) and CONC concurrent,
# ROUNDS rounds interleaved in alternating order, each run from an empty prefix cache. Prints
# each run's output tok/s and the median ratio schema / plain.
# Benchmark only (never in CI).
#   bash scripts/bench_structured_serve.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench_common.sh
ROUNDS=${ROUNDS:-2} CONC=${CONC:-32} OUTPUT_LEN=${OUTPUT_LEN:-128} INPUT_LEN=${INPUT_LEN:-64} SINGLE=${SINGLE:-4}
trap stop EXIT
setsid $PY -m pdserve serve --role colocated --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" \
  --num-threads 1 --max-total-tokens 32768 --served-model-name default > "$OUT/server.log" 2>&1 &
pid=$!
wait_up "$OUT/server.log"
SCHEMA=$($PY -c 'import json; from pdserve.bench.structured_bench import SCHEMA; print(json.dumps(SCHEMA))')
FORMAT="{\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"bench\", \"schema\": $SCHEMA}}}"

load() {  # $1 name, $2 concurrency, $3 prompts, more: flags
  local name=$1 conc=$2 n=$3; shift 3
  $PY -m pdserve bench serve --url "$URL" --backend openai-completions --model default --tokenizer "$MODEL_DIR" \
    --dataset random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --num-prompts "$n" \
    --max-concurrency "$conc" --flush-cache --disable-tqdm --output "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1
  $PY -c 'import json, sys; s = json.load(open(sys.argv[1]))["summary"]
print("%-22s output %8.1f tok/s, failed %d, short %d" % (sys.argv[2], s["output_throughput"], s["failed"], s["output_len_mismatches"]))' "$OUT/$name.json" "$name"
}

load warmup 1 2 --extra-body "$FORMAT" > /dev/null  # also builds the worker's vocabulary view
for r in $(seq "$ROUNDS"); do
  for conc in 1 "$CONC"; do
    n=$(( conc == 1 ? SINGLE : conc ))  # one wave of CONC; SINGLE requests one by one
    if (( r % 2 )); then  # the order flips each round, so drift and warm-up favour neither
      load "plain-c$conc-r$r" "$conc" "$n"; load "schema-c$conc-r$r" "$conc" "$n" --extra-body "$FORMAT"
    else
      load "schema-c$conc-r$r" "$conc" "$n" --extra-body "$FORMAT"; load "plain-c$conc-r$r" "$conc" "$n"
    fi
  done
done
$PY - "$OUT" "$ROUNDS" "$CONC" <<'EOF'
import json, statistics, sys
out, rounds, conc = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for c in ("1", conc):
    tp = {m: [json.load(open(f"{out}/{m}-c{c}-r{r}.json"))["summary"]["output_throughput"]
              for r in range(1, rounds + 1)] for m in ("plain", "schema")}
    ratios = [s / p for s, p in zip(tp["schema"], tp["plain"])]
    print(f"concurrency {c}: plain {statistics.median(tp['plain']):.1f} tok/s, schema "
          f"{statistics.median(tp['schema']):.1f} tok/s, schema/plain per round {[round(x, 3) for x in ratios]}, "
          f"median {statistics.median(ratios):.3f}")
EOF
