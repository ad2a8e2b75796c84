# Sourced by the bench_*_vs_vllm.sh scripts: output dir, tools, the converted default model, a
# free 127.0.0.1 port, and starting/stopping one server at a time (by process group).
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
VLLM=${VLLM_CPU_TOOL:-../shared/tools/vllm-cpu}
PY=.venv/bin/python
MODEL_DIR=$($PY -c 'from pdserve.model_files.resolve import resolve_model; from pdserve.core.envs import Envs; print(resolve_model("smollm2-135m", Envs.read().cache_dir))')
PORT=$($PY -c 'from pdserve.core.launcher import free_port; print(free_port())')
URL=http://127.0.0.1:$PORT
pid=""
# which CPU every figure of the run came from
field() { grep -m1 "^$1" /proc/cpuinfo | cut -d: -f2- | xargs; }
echo "cpu: $(field 'model name') (family $(field 'cpu family') model $(field 'model[[:space:]]*:')); $(nproc) cores;" \
  "amx: $(grep -qw amx_bf16 /proc/cpuinfo && echo yes || echo no);" \
  "avx512_bf16: $(grep -qw avx512_bf16 /proc/cpuinfo && echo yes || echo no); load: $(cut -d' ' -f1-3 /proc/loadavg)" \
  | tee "$OUT/cpu.txt"
# the server's own account (pdserve: per-worker cpu_waits, plan) kept beside the results
stop() { if [ -n "$pid" ]; then curl -sf "$URL/server_info" > "$OUT/server-info-$pid.json" 2>/dev/null || rm -f "$OUT/server-info-$pid.json"; kill -- -"$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi; pid=""; }

wait_up() {  # $1: the server's log, shown if it exits
  for _ in $(seq 600); do
    curl -sf "$URL/v1/models" >/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "server exited; log: $1" >&2; tail -20 "$1" >&2; exit 1; }
    sleep 1
  done
  echo "server not up in 600 s" >&2; exit 1
}
