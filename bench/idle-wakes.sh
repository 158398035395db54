#!/usr/bin/env bash
# idle-wakes.sh — how often each broker's threads (and Redis) go to sleep and wake up per idle
# command: 1 rig, K commands PUBLISHed one at a time INTERVAL apart, counting the voluntary
# context switches of every broker thread and of redis-server (/proc/<pid>/task/*/status) from
# just before the first PUBLISH until the rig has them all. A thread that sleeps and is woken
# again costs one switch; on an idle host each of those is a sleeping CPU woken up.
#
#   bench/idle-wakes.sh [--count 500] [--interval 10ms] [--brokers "fleetlink-fe-redis ..."] [--trace]
#
# --trace (root, perf): also records sched_wakeup/sched_switch system-wide over the commands
# and counts, per command, the broker's wake-ups between the publisher waking Redis (the
# PUBLISH) and the rig being woken (the command written), with that span's p50/p90. A command
# whose rig wake-up is not found within 8 ms (lost events, or the rig already awake) is left
# out, and the number followed is printed.
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
count=500 interval=10ms trace=0
brokers="fleetlink-fe-redis fleetlink-fe-redis-nopersist tokio-baseline-redis-rb4096 tokio-baseline-redis-store-rb4096"
rport="${IDLE_WAKES_REDIS_PORT:-27379}"
lport="${IDLE_WAKES_LISTEN_PORT:-27080}"
aport="${IDLE_WAKES_ADMIN_PORT:-27090}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --count) count="$2"; shift 2 ;;
    --interval) interval="$2"; shift 2 ;;
    --brokers) brokers="$2"; shift 2 ;;
    --trace) trace=1; shift ;;
    *) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 64 ;;
  esac
done
[[ "$count" =~ ^[1-9][0-9]*$ ]] || { echo "idle-wakes: --count must be a positive integer" >&2; exit 64; }
for x in fleetlink-fe fleetlink-tokio-baseline fleetlink-loadgen; do
  [[ -x "$target/$x" ]] || { echo "idle-wakes: $target/$x not found (cargo build --release --workspace)" >&2; exit 1; }
done
command -v jq >/dev/null || { echo "idle-wakes: jq not found" >&2; exit 1; }
if (( trace )); then
  command -v perf >/dev/null || { echo "idle-wakes: --trace needs perf" >&2; exit 1; }
  command -v python3 >/dev/null || { echo "idle-wakes: --trace needs python3" >&2; exit 1; }
fi

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
# A duration (NNms or NNs) in ms.
ms() {
  [[ "$1" =~ ^([0-9]+)(ms|s)$ ]] || { echo "idle-wakes: duration $1: use NNms or NNs" >&2; exit 64; }
  if [[ "${BASH_REMATCH[2]}" == ms ]]; then echo "${BASH_REMATCH[1]}"; else echo $((BASH_REMATCH[1] * 1000)); fi
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
  perf_pid=""
  if (( trace )); then
    span_ms=$(( count * $(ms "$interval") + 3000 ))
    perf record -q -e sched:sched_wakeup,sched:sched_switch -a -o "$work/$b.perf" \
      -- sleep "$(awk -v m="$span_ms" 'BEGIN {printf "%.1f", m / 1000}')" >/dev/null 2>&1 &
    perf_pid=$!; pids+=("$perf_pid")
    sleep 0.5 # perf's own start-up, so the first commands are in the recording
  fi
  before="$(by_thread "$bpid")"; b0=$(total "$bpid"); r0=$(total "$rpid")
  "$target/fleetlink-loadgen" redis-publish --redis "$url" --broker-id iw --prefix one \
    --max-time 300s --mode single --count "$count" --interval "$interval" \
    --report "$work/$b.pub.json" >/dev/null 2>&1 &
  pub_pid=$!
  wait "$pub_pid" || true
  wait "$lg" || true
  after="$(by_thread "$bpid")"; b1=$(total "$bpid"); r1=$(total "$rpid")
  threads=$(join <(echo "$before") <(echo "$after") \
    | awk -v n="$count" '{d = ($3 - $2) / n; if (d >= 0.05) printf "%s %.2f, ", $1, d}')
  jq -r --arg b "$b" --arg bw "$(awk -v d=$((b1 - b0)) -v n="$count" 'BEGIN {printf "%.2f", d / n}')" \
    --arg rw "$(awk -v d=$((r1 - r0)) -v n="$count" 'BEGIN {printf "%.2f", d / n}')" --arg th "${threads%, }" \
    '"\($b): broker \($bw) wake-ups per command (\($th)), redis \($rw); received \(.commands_received), p50 \(.latency_us.p50) us, p99 \(.latency_us.p99) us"' \
    "$work/$b.rigs.json"
  if [[ -n "$perf_pid" ]]; then
    wait "$perf_pid" || true
    perf script -i "$work/$b.perf" -F comm,pid,tid,cpu,time,event,trace 2>/dev/null >"$work/$b.sched"
    python3 - "$work/$b.sched" "$bpid" "$rpid" "$lg" "$pub_pid" <<'PY'
import collections, re, statistics, sys
path, broker, redis, rig, pub = sys.argv[1], *map(int, sys.argv[2:])
line = re.compile(r'^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$')
target = re.compile(r'comm=(.+?) pid=(\d+)')
proc, wakes = {}, []
for l in open(path):
    m = line.match(l)
    if not m:
        continue
    comm, pid, tid, _cpu, t, ev, rest = m.groups()
    proc[int(tid)] = int(pid)
    if ev == 'sched_wakeup':
        w = target.search(rest)
        wakes.append((float(t), int(pid), int(w.group(2)), w.group(1)))
wakes.sort()
rows = []
for i, (t, waker, tgt, tcomm) in enumerate(wakes):
    if waker != pub or proc.get(tgt, -1) != redis:
        continue
    n, names = 0, collections.Counter()
    for t2, _w2, tgt2, tcomm2 in wakes[i + 1:]:
        if t2 - t > 0.008:
            break
        if proc.get(tgt2) == rig:
            rows.append((n, (t2 - t) * 1e6, names))
            break
        if proc.get(tgt2) == broker:
            n += 1
            names[re.sub(r'\d+$', '', tcomm2)] += 1
if not rows:
    print('  trace: no command followed from the PUBLISH to the rig')
    sys.exit(0)
per = collections.Counter()
for r in rows:
    per.update(r[2])
spans = sorted(r[1] for r in rows)
print('  trace: %d commands followed; broker wake-ups between the PUBLISH and the rig: median %s, mean %.2f (%s); span p50 %.0f us, p90 %.0f us' % (
    len(rows), statistics.median(r[0] for r in rows), statistics.mean(r[0] for r in rows),
    ', '.join('%s %.2f' % (k, v / len(rows)) for k, v in sorted(per.items())),
    statistics.median(spans), spans[int(len(spans) * 0.9)]))
PY
  fi
  kill "$bpid" "$rpid" 2>/dev/null || true
  wait "$bpid" "$rpid" 2>/dev/null || true
  pids=()
done
