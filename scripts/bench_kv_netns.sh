#!/usr/bin/env bash
# `pdserve bench kv-remote` across two network namespaces joined by veth pairs on a bridge (as
# tests/harness/netns.py builds them): the sender in one, the receiver in the other, so every byte
# crosses veth -> bridge -> veth. Needs root. Removes everything it made on exit.
#   sudo scripts/bench_kv_netns.sh [kv-remote run flags, e.g. --tokens 1024,8192 --backends tcp]
#   (--backends tcp,tcp:4194304 puts the tcp backend with 4 MiB socket buffers beside the default;
#   UCX_TLS=tcp in the environment keeps nixl on UCX's TCP transport, as between hosts without RDMA)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
T=$$; BR=pkbr$T; A=pkA$T; B=pkB$T; NET=10.214.$((T % 200 + 20))
cleanup() {
  [[ -n "${RX:-}" ]] && kill "$RX" 2>/dev/null || true
  [[ -n "${LOG:-}" ]] && { cat "$LOG" >&2; rm -f "$LOG"; }
  ip link del pkva$T 2>/dev/null || true; ip link del pkvb$T 2>/dev/null || true
  ip netns del $A 2>/dev/null || true; ip netns del $B 2>/dev/null || true
  ip link del $BR 2>/dev/null || true
}
trap cleanup EXIT
ip link add $BR type bridge && ip link set $BR up
i=2
for ns in $A $B; do
  side=$([[ $ns == "$A" ]] && echo a || echo b)
  ip netns add $ns
  ip link add pkv$side$T type veth peer name pkn$side$T
  ip link set pkn$side$T netns $ns
  ip link set pkv$side$T master $BR && ip link set pkv$side$T up
  ip -n $ns link set lo up
  ip -n $ns addr add $NET.$i/24 dev pkn$side$T && ip -n $ns link set pkn$side$T up
  i=$((i + 1))
done
LOG=$(mktemp)
ip netns exec $B "$PY" -m pdserve bench kv-remote serve --host $NET.3 --port 17999 >"$LOG" 2>&1 &
RX=$!
for _ in $(seq 100); do grep -q "kv-remote receiver on" "$LOG" && break; sleep 0.2; done
ip netns exec $A "$PY" -m pdserve bench kv-remote run --peer $NET.3:17999 --host $NET.2 "$@"
wait "$RX" || true
RX=
