#!/usr/bin/env bash
# idle-wakes.sh — how often each broker's threads (and Redis) go to sleep and wake up per idle
# command: 1 rig, K commands PUBLISHed one at a time INTERVAL apart, counting the voluntary
# context switches of every broker thread and of redis-server (/proc/<pid>/task/*/status) from
# just before the first PUBLISH until the rig has them all. A thread that sleeps and is woken
# again costs one switch; on an idle host each of those is a sleeping CPU woken up.
#
#   bench/idle-wakes.sh [--count 500] [--interval 10ms] [--brokers "fleetlink-fe-redis ..."]
#
# Brokers (fleet mode, each against a fresh redis-server):
#   fleetlink-fe-redis                 --cores = CPUs - 1 (docs/tuning.md), session store on
#   fleetlink-fe-redis-nopersist       the same with --session-ttl 0
#   tokio-baseline-redis-rb4096        the tuned baseline
#   tokio-baseline-redis-store-rb4096  the same keeping every command first (--session-ttl 10m)
#
# Prints one line per broker: wake-ups per command of the broker (all threads) and of Redis,
# the broker's per thread name, and the loadgen's p50/p99 for the run (one run: read the wake
# counts, not the latency). Ports: IDLE_WAKES_REDIS_PORT (27379), IDLE_WAKES_LISTEN_PORT
# (27080), IDLE_WAKES_ADMIN_PORT (27090). Needs release builds and jq; stops everything it
# started on exit.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
target="${CARGO_TARGET_DIR:-$here/../target}/release"
count=500 interval=10ms
brokers="fleetlink-fe-redis fleetlink-fe-redis-nopersist tokio-baseline-redis-rb4096 tokio-baseline-redis-store-rb4096"
rport="${IDLE_WAKES_REDIS_PORT:-27379}"
lport="${IDLE_WAKES_LISTEN_PORT:-27080}"
aport="${IDLE_WAKES_ADMIN_PORT:-27090}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --count) count="$2"; shift 2 ;;
    --interval) interval="$2"; shift 2 ;;
    --brokers) brokers="$2"; shift 2 ;;
    *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 64 ;;
  esac
done
[[ "$count" =~ ^[1-9][0-9]*$ ]] || { echo "idle-wakes: --count must be a positive integer" >&2; exit 64; }
for x in fleetlink-fe fleetlink-tokio-baseline fleetlink-loadgen; do
  [[ -x "$target/$x" ]] || { echo "idle-wakes: $target/$x not found (cargo build --release --workspace)" >&2; exit 1; }
done
command -v jq >/dev/null || { echo "idle-wakes: jq not found" >&2; exit 1; }

work="$(mktemp -d /tmp/idle-wakes.XXXXXX)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

fleet_cores=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))
url="redis://127.0.0.1:$rport/"
broker_cmd() {
  local fe=("$target/fleetlink-fe" --redis "$url" --listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport"
            --broker-id iw --accept-rate 100000 --accept-burst 100000 --drain 1s --cores "$fleet_cores")
  local tb=("$target/fleetlink-tokio-baseline" --redis "$url" --listen "127.0.0.1:$lport"
            --admin "127.0.0.1:$aport" --broker-id iw --read-buffer 4096 --write-buffer 0)
  case "$1" in
    fleetlink-fe-redis) echo "${fe[@]}" ;;
    fleetlink-fe-redis-nopersist) echo "${fe[@]}" --session-ttl 0 ;;
    tokio-baseline-redis-rb4096) echo "${tb[@]}" ;;
    tokio-baseline-redis-store-rb4096) echo "${tb[@]}" --session-ttl 10m ;;
    *) echo "idle-wakes: unknown broker $1" >&2; exit 64 ;;
  esac
}
# Polls "$@" every 0.1 s for up to $1 seconds.
wait_for() {
  local secs="$1"; shift
  local deadline=$((SECONDS + secs))
  until "$@"; do
    (( SECONDS < deadline )) || return 1
    sleep 0.1
  done
}
# Voluntary context switches: of every thread of $1 by thread name, or summed.
by_thread() {
  for t in /proc/"$1"/task/*; do
    printf '%s %s\n' "$(cat "$t/comm" 2>/dev/null)" "$(awk '/^voluntary_ctxt_switches/ {print $2}' "$t/status" 2>/dev/null)"
  done | sed 's/[0-9]* / /' | awk '{s[$1] += $2} END {for (k in s) print k, s[k]}' | sort
}
total() { by_thread "$1" | awk '{s += $2} END {print s + 0}'; }

for b in $brokers; do
  cmd="$(broker_cmd "$b")"
  redis-server --port "$rport" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
    >"$work/redis.log" 2>&1 &
  rpid=$!; pids+=("$rpid")
  wait_for 10 redis-cli -p "$rport" ping >/dev/null 2>&1 || { echo "idle-wakes: redis-server did not start" >&2; exit 1; }
  # shellcheck disable=SC2086  # plain words
  $cmd >"$work/$b.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_for 30 curl -sf -o /dev/null "http://127.0.0.1:$aport/readyz" \
    || { echo "idle-wakes: $b not ready (log: $(tail -1 "$work/$b.log"))" >&2; exit 1; }
  "$target/fleetlink-loadgen" rigs --url "ws://127.0.0.1:$lport/agent" --rigs 1 --prefix one \
    --hold 300s --max-time 400s --until-commands "$count" --report "$work/$b.rigs.json" \
    >"$work/$b.rigs.out" 2>/dev/null &
  lg=$!; pids+=("$lg")
  wait_for 30 grep -q '^ALL_WELCOMED' "$work/$b.rigs.out" || { echo "idle-wakes: $b: no welcome" >&2; exit 1; }
  before="$(by_thread "$bpid")"; b0=$(total "$bpid"); r0=$(total "$rpid")
  "$target/fleetlink-loadgen" redis-publish --redis "$url" --broker-id iw --prefix one \
    --max-time 300s --mode single --count "$count" --interval "$interval" \
    --report "$work/$b.pub.json" >/dev/null 2>&1
  wait "$lg" || true
  after="$(by_thread "$bpid")"; b1=$(total "$bpid"); r1=$(total "$rpid")
  threads=$(join <(echo "$before") <(echo "$after") \
    | awk -v n="$count" '{d = ($3 - $2) / n; if (d >= 0.05) printf "%s %.2f, ", $1, d}')
  jq -r --arg b "$b" --arg bw "$(awk -v d=$((b1 - b0)) -v n="$count" 'BEGIN {printf "%.2f", d / n}')" \
    --arg rw "$(awk -v d=$((r1 - r0)) -v n="$count" 'BEGIN {printf "%.2f", d / n}')" --arg th "${threads%, }" \
    '"\($b): broker \($bw) wake-ups per command (\($th)), redis \($rw); received \(.commands_received), p50 \(.latency_us.p50) us, p99 \(.latency_us.p99) us"' \
    "$work/$b.rigs.json"
  kill "$bpid" "$rpid" 2>/dev/null || true
  wait "$bpid" "$rpid" 2>/dev/null || true
  pids=()
done
