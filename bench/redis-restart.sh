#!/usr/bin/env bash
# redis-restart.sh — Redis restarted empty under a connected fleet: N rigs on fleetlink-fe in
# fleet mode, each with K unacked commands, then Redis is SIGKILLed and started again, empty,
# on the same port. Measures how long until every lease is back and every session is kept
# again (`rekeep/ok` = N), and checks that every lease and session is back and that a sample
# session holds its K commands and its `next`. R rounds, each with a fresh broker and Redis.
#
#   bench/redis-restart.sh [--rigs 10000] [--unacked 1] [--rounds 3]
#
# The rigs' loadgen runs with --no-ack so their commands stay unacked. Prints one line per
# round and the median. Its own redis-server on REDIS_RESTART_PORT (default 26479), the broker
# on REDIS_RESTART_LISTEN_PORT/REDIS_RESTART_ADMIN_PORT (26180/26190; keep all three below the
# host's ip_local_port_range); everything it starts is stopped on exit, failure or signal
# (bench/lib/procs.sh). Needs release builds
# (`cargo build --release --workspace`). The fast version of this is tests/resume.rs
# (a_session_redis_lost_is_kept_again_and_survives_its_broker).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
target="${CARGO_TARGET_DIR:-$here/../target}/release"
rigs=10000 unacked=1 rounds=3
rport="${REDIS_RESTART_PORT:-26479}" lport="${REDIS_RESTART_LISTEN_PORT:-26180}" aport="${REDIS_RESTART_ADMIN_PORT:-26190}"
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rigs) rigs="$2"; shift 2 ;;
    --unacked) unacked="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "redis-restart: unknown argument $1" >&2; usage; exit 64 ;;
  esac
done
(( rigs <= 19000 )) || { echo "redis-restart: --rigs at most 19000" >&2; exit 64; }
for bin in fleetlink-fe fleetlink-loadgen; do
  [[ -x "$target/$bin" ]] || { echo "redis-restart: $target/$bin is missing (cargo build --release)" >&2; exit 1; }
done
work="$(mktemp -d /tmp/redis-restart.XXXXXX)"
pids=()
cleanup() {
  procs_cleanup_begin # signals from here on only hurry the stops below to SIGKILL
  trap - EXIT
  procs_stop 150 ${pids[@]+"${pids[@]}"} # SIGTERM (process groups), SIGKILL 15 s later
  procs_stop_all 50 # anything a signal caught before its pid was recorded above
  rm -rf "$work"
}
trap cleanup EXIT
procs_traps

start_redis() {
  # It kills and restarts this Redis: never one it did not start.
  if redis-cli -p "$rport" ping >/dev/null 2>&1; then
    echo "redis-restart: something already answers on port $rport; set REDIS_RESTART_PORT to a free one" >&2
    exit 1
  fi
  procs_spawn -o "$work/redis.log" -e - redis-server --port "$rport" --bind 127.0.0.1 --save "" \
    --appendonly no --daemonize no
  rpid=$PROCS_PID; pids+=("$rpid")
  for _ in $(seq 100); do
    redis-cli -p "$rport" ping >/dev/null 2>&1 && return
    kill -0 "$rpid" 2>/dev/null || break
    sleep 0.05
  done
  echo "redis-restart: redis-server did not start: $(tail -1 "$work/redis.log")" >&2; exit 1
}
metric() {
  curl -s "http://127.0.0.1:$aport/metrics" | awk -v k="$1" 'index($0, k) == 1 { print int($2) }'
}
url="redis://127.0.0.1:$rport/"
times=()
for ((r = 1; r <= rounds; r++)); do
  start_redis
  procs_spawn -o "$work/broker.log" -e - "$target/fleetlink-fe" \
    --cores "$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))" --redis "$url" \
    --listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport" --broker-id rr \
    --accept-rate 100000 --accept-burst 100000
  bpid=$PROCS_PID; pids+=("$bpid")
  for _ in $(seq 300); do curl -sf -o /dev/null "http://127.0.0.1:$aport/readyz" && break; sleep 0.1; done
  procs_spawn -o "$work/rigs.out" -e "$work/rigs.err" "$target/fleetlink-loadgen" rigs \
    --url "ws://127.0.0.1:$lport/agent" --rigs "$rigs" --prefix rig --no-ack --hold 300s \
    --max-time 330s
  lpid=$PROCS_PID; pids+=("$lpid")
  for _ in $(seq 1200); do grep -q '^ALL_WELCOMED' "$work/rigs.out" && break; sleep 0.1; done
  grep -q '^ALL_WELCOMED' "$work/rigs.out" || { echo "redis-restart: rigs not welcomed" >&2; exit 1; }
  "$target/fleetlink-loadgen" redis-publish --redis "$url" --broker-id rr --prefix rig \
    --mode fanout --rigs "$rigs" --count "$unacked" --interval 1s --max-time 120s \
    --report "$work/pub.json" >/dev/null
  for _ in $(seq 600); do
    [[ "$(metric 'fleetlink_registry_ops_total{op="persist",result="ok"}')" -ge $((rigs * unacked)) ]] && break
    sleep 0.1
  done
  kill -9 "$rpid"; wait "$rpid" 2>/dev/null || true
  t0=$(date +%s%N)
  start_redis
  done_ok=0
  for _ in $(seq 1200); do
    if [[ "$(metric 'fleetlink_registry_ops_total{op="rekeep",result="ok"}')" -ge "$rigs" ]]; then
      done_ok=1; break
    fi
    sleep 0.02
  done
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  sessions=$(redis-cli -p "$rport" --scan --pattern 'sess:*:*' | wc -l)
  leases=$(redis-cli -p "$rport" --scan --pattern 'rig:*' | wc -l)
  sample="sess:$(redis-cli -p "$rport" --scan --pattern 'sess:rig-000042:*' | head -1 | cut -d: -f2-)"
  # Its commands and "next" (a session also carries "t", its TTL, once named for its lapse).
  fields=$(redis-cli -p "$rport" hkeys "$sample" | grep -c -E '^(c:[0-9]+|next)$')
  next=$(redis-cli -p "$rport" hget "$sample" next)
  ok=$([[ $done_ok == 1 && $sessions == "$rigs" && $leases == "$rigs" && $fields == $((unacked + 1)) \
          && $next == $((unacked + 1)) ]] && echo yes || echo NO)
  echo "round $r: all $rigs sessions kept again ${ms} ms after the restart (sessions $sessions," \
       "leases $leases, rig-000042: $fields fields, next $next; complete: $ok)"
  [[ $ok == yes ]] && times+=("$ms")
  kill "$lpid" "$bpid" "$rpid" 2>/dev/null || true
  wait "$lpid" "$bpid" "$rpid" 2>/dev/null || true
done
(( ${#times[@]} == rounds )) || { echo "redis-restart: ${#times[@]} of $rounds rounds complete" >&2; exit 1; }
median=$(printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}')
echo "median: ${median} ms from the restart until all $rigs sessions were kept again"
