#!/usr/bin/env bash
# after-ack-memory.sh — what an idle rig costs the broker once it has acked a command whose
# result it has not sent (yet): the broker keeps the id for the result. N loadgen rigs (which
# ack and never report results) connect to a fleet-mode broker (`--cores 1`, its own Redis),
# idle, then get one command each over the admin API, R times; the broker's Private_Dirty
# (/proc/PID/smaps_rollup) is read once it has settled (6 one-second samples within 32 KiB)
# before the rigs, with them idle, and after each round.
#
#   bench/after-ack-memory.sh [--rigs 2000] [--rounds 2] [--fe PATH]...
#
# Each --fe is a fleetlink-fe binary (default: the workspace's target/release/fleetlink-fe);
# give two to compare builds, run one after the other. The loadgen is the workspace's
# (LOADGEN overrides). Every run starts its own redis-server and broker on free ports and
# stops them, also on failure or signal. Prints, per build, bytes per connection idle and
# after each round, and the growth over idle. Needs redis-server, python3, curl.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
rigs=2000 rounds=2 fes=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rigs) rigs="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --fe) fes+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 64 ;;
  esac
done
target="${CARGO_TARGET_DIR:-$here/../target}/release"
(( ${#fes[@]} > 0 )) || fes=("$target/fleetlink-fe")
loadgen="${LOADGEN:-$target/fleetlink-loadgen}"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
pids=()
stop_run() { procs_stop 150 ${pids[@]+"${pids[@]}"}; pids=(); }
cleanup() {
  procs_cleanup_begin # signals from here on only hurry the stops below to SIGKILL
  trap - EXIT
  stop_run
  procs_stop_all 50
}
trap cleanup EXIT
procs_traps

dirty() { awk '/^Private_Dirty/ {print $2 * 1024}' "/proc/$1/smaps_rollup"; }
# Private_Dirty once 6 one-second samples lie within 32 KiB (at most 60 s).
settled() {
  local pid="$1" samples=() lo hi
  for _ in $(seq 60); do
    samples+=("$(dirty "$pid")")
    if (( ${#samples[@]} >= 6 )); then
      lo=$(printf '%s\n' "${samples[@]: -6}" | sort -n | head -1)
      hi=$(printf '%s\n' "${samples[@]: -6}" | sort -n | tail -1)
      (( hi - lo <= 32768 )) && { echo "$hi"; return; }
    fi
    sleep 1
  done
  echo "${samples[-1]}"
}
connections() {
  curl -sf "http://127.0.0.1:$1/metrics" | awk '/^fleetlink_connections/ {s += $2} END {print s + 0}'
}

for fe in "${fes[@]}"; do
  rport=$(free_port) lport=$(free_port) aport=$(free_port)
  procs_spawn -o /dev/null -e - redis-server --port "$rport" --bind 127.0.0.1 --save "" \
    --appendonly no
  pids+=("$PROCS_PID")
  for _ in $(seq 100); do [[ "$(redis-cli -p "$rport" ping 2>/dev/null)" == PONG ]] && break; sleep 0.05; done
  procs_spawn -o /dev/null -e - "$fe" --redis "redis://127.0.0.1:$rport/" --broker-id fe-mem \
    --listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport" --cores 1 \
    --accept-rate 5000 --accept-burst 2000
  fe_pid="$PROCS_PID"
  pids+=("$fe_pid")
  for _ in $(seq 200); do curl -sf -o /dev/null "http://127.0.0.1:$aport/readyz" && break; sleep 0.05; done
  base=$(settled "$fe_pid")
  procs_spawn -o /dev/null -e - "$loadgen" rigs --url "ws://127.0.0.1:$lport/agent" \
    --rigs "$rigs" --prefix mem --sources 127.0.0.1 --hold 900s --max-time 900s
  pids+=("$PROCS_PID")
  for _ in $(seq 600); do (( $(connections "$aport") >= rigs )) && break; sleep 0.1; done
  idle=$(settled "$fe_pid")
  echo "$fe: $rigs rigs idle: $(( (idle - base) / rigs )) B a connection"
  for r in $(seq "$rounds"); do
    "$loadgen" admin-fanout --admin "http://127.0.0.1:$aport" --prefix mem --rigs "$rigs" \
      --concurrency 8 --max-time 120s > /dev/null
    now=$(settled "$fe_pid")
    echo "$fe: after round $r (one command each, acked, no result): $(( (now - base) / rigs )) B a connection, $(( (now - idle) / rigs )) over idle"
  done
  stop_run
done
