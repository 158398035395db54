#!/usr/bin/env bash
# bench/idle-perf.sh — where an idle fleet's CPU goes: 10,000 idle rigs on fleetlink-fe
# (standalone), then on the tuned tokio baseline, and for each, 20 s of `perf stat` (task
# clock, context switches, the syscalls a PING and a PONG cost, io_uring waits and
# completions, epoll waits), then 20 s of `perf record -g` on fleetlink-fe.
#
#   bench/idle-perf.sh [--out DIR] [--rigs 10000]
#
# Writes DIR/<broker>.stat and DIR/fleetlink-fe-profile-top.txt (default DIR:
# bench/results/idle-perf). Needs perf with tracepoint access (root), release builds
# (`bench/run` builds them), loopback ports IDLE_PERF_LISTEN_PORT and IDLE_PERF_ADMIN_PORT
# (27080/27090; keep them below the host's ip_local_port_range). Everything it starts stops by
# itself (the loadgen holds for 60 s, at most 90 s).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$root/bench/lib/procs.sh"
out="$root/bench/results/idle-perf"
rigs=10000
lport="${IDLE_PERF_LISTEN_PORT:-27080}"
aport="${IDLE_PERF_ADMIN_PORT:-27090}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --rigs) rigs="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "idle-perf.sh: unknown argument $1 (see --help)" >&2; exit 64 ;;
  esac
done
bin="${CARGO_TARGET_DIR:-$root/target}/release"
mkdir -p "$out"
work="$(mktemp -d)"
broker_pid=""
lg=""
cleanup() {
  procs_cleanup_begin # signals from here on only hurry the stops below to SIGKILL
  trap - EXIT
  procs_stop 150 "$lg" "$broker_pid" # SIGTERM (process groups), SIGKILL 15 s later
  procs_stop_all 50 # anything a signal caught before its pid was recorded above
  rm -rf "$work"
}
trap cleanup EXIT
procs_traps
events="task-clock,context-switches,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom"
events+=",syscalls:sys_enter_io_uring_enter,io_uring:io_uring_complete,io_uring:io_uring_cqring_wait"
events+=",syscalls:sys_enter_epoll_wait"

for broker in fleetlink-fe tokio-baseline-rb4096; do
  case "$broker" in
    fleetlink-fe) procs_spawn -o "$work/broker.log" -e - "$bin/fleetlink-fe" \
        --listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport" \
        --accept-rate 100000 --accept-burst 100000 ;;
    *) procs_spawn -o "$work/broker.log" -e - "$bin/fleetlink-tokio-baseline" \
        --listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport" \
        --read-buffer 4096 --write-buffer 0 ;;
  esac
  broker_pid=$PROCS_PID
  for _ in $(seq 100); do
    curl -fs -o /dev/null "http://127.0.0.1:$aport/healthz" && break
    sleep 0.1
  done
  procs_spawn -o "$work/lg.out" -e /dev/null "$bin/fleetlink-loadgen" rigs \
    --url "ws://127.0.0.1:$lport/agent" --rigs "$rigs" --hold 60s --max-time 90s \
    --report "$work/lg.json"
  lg=$PROCS_PID
  for _ in $(seq 600); do
    grep -q ALL_WELCOMED "$work/lg.out" 2>/dev/null && break
    sleep 0.1
  done
  grep -q ALL_WELCOMED "$work/lg.out" || { echo "idle-perf: $broker: rigs not welcomed" >&2; exit 1; }
  # The window opens 5 s before the first PINGs (one interval after the welcomes) and closes
  # 5 s after their PONG deadline: one PING and one PONG per rig, for either broker
  # (fleetlink-fe reads a PONG at its deadline, the baseline when it lands).
  sleep 15
  perf stat -e "$events" -p "$broker_pid" -- sleep 20 2> "$out/$broker.stat"
  if [[ $broker == fleetlink-fe ]]; then
    perf record -F 1999 -g -p "$broker_pid" -o "$work/perf.data" -- sleep 20 2>/dev/null
    perf report -i "$work/perf.data" --no-children --sort sym --stdio -g none 2>/dev/null \
      | grep -v '^$' | head -40 > "$out/fleetlink-fe-profile-top.txt" || true
  fi
  wait "$lg" || true
  lg=""
  kill "$broker_pid"; wait "$broker_pid" 2>/dev/null || true
  broker_pid=""
  echo "idle-perf: $broker"; grep -E 'task-clock|context-switches|sendto|recvfrom|cqring_wait|epoll_wait' "$out/$broker.stat"
done
