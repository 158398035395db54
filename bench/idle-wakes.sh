#!/usr/bin/env bash
# idle-wakes.sh — how often each broker's threads (and Redis) go to sleep and wake up per idle
# command: 1 rig, K commands PUBLISHed one at a time INTERVAL apart, counting the voluntary
# context switches of every broker thread and of redis-server (/proc/<pid>/task/*/status) from
# just before the first PUBLISH until the rig has them all. A thread that sleeps and is woken
# again costs one switch; on an idle host each of those is a sleeping CPU woken up.
#
#   bench/idle-wakes.sh [--count 500] [--interval 10ms] [--brokers "fleetlink-fe-redis ..."] [--trace]
#
# --trace (root, perf): also records sched_waking/sched_wakeup/sched_switch system-wide over
# the commands. From sched_wakeup alone (the count earlier figures were made with) it counts,
# per command, the broker's wake-ups between the publisher waking Redis (the PUBLISH) and the
# rig being woken (the command written), with that span's p50/p90. A command whose rig wake-up
# is not found within 8 ms (lost events, or the rig already awake) is left out, and the number
# followed is printed. From sched_waking it then splits the commands into latency bands
# (fastest half, p50-p90, p90-p98, slowest 2%) and prints, per command in each band, how many
# broker and Redis threads were woken from sleep on its way, how many of those onto another,
# idle CPU (a vCPU to wake) and how long those wake-ups took; how long the others waited for a
# busy CPU and who held it; and how long threads of the broker, Redis or the rig were taken
# off a CPU while they still had work, and by whom.
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
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
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
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "idle-wakes: unknown argument $1" >&2
       awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 64 ;;
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
  procs_cleanup_begin # signals from here on only hurry the stops below to SIGKILL
  trap - EXIT
  procs_stop 150 ${pids[@]+"${pids[@]}"} # SIGTERM (process groups), SIGKILL 15 s later
  procs_stop_all 50 # anything a signal caught before its pid was recorded above
  rm -rf "$work"
}
trap cleanup EXIT
# HUP, INT, TERM and PIPE end the script through that trap (bench/lib/procs.sh).
procs_traps

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
  procs_spawn -o "$work/redis.log" -e - redis-server --port "$rport" --bind 127.0.0.1 --save "" \
    --appendonly no --daemonize no
  rpid=$PROCS_PID; pids+=("$rpid")
  wait_for 10 redis-cli -p "$rport" ping >/dev/null 2>&1 || { echo "idle-wakes: redis-server did not start" >&2; exit 1; }
  # shellcheck disable=SC2086  # plain words
  procs_spawn -o "$work/$b.log" -e - $cmd
  bpid=$PROCS_PID; pids+=("$bpid")
  wait_for 30 curl -sf -o /dev/null "http://127.0.0.1:$aport/readyz" \
    || { echo "idle-wakes: $b not ready (log: $(tail -1 "$work/$b.log"))" >&2; exit 1; }
  procs_spawn -o "$work/$b.rigs.out" -e /dev/null "$target/fleetlink-loadgen" rigs \
    --url "ws://127.0.0.1:$lport/agent" --rigs 1 --prefix one --hold 300s --max-time 400s \
    --until-commands "$count" --report "$work/$b.rigs.json"
  lg=$PROCS_PID; pids+=("$lg")
  wait_for 30 grep -q '^ALL_WELCOMED' "$work/$b.rigs.out" || { echo "idle-wakes: $b: no welcome" >&2; exit 1; }
  perf_pid=""
  if (( trace )); then
    span_ms=$(( count * $(ms "$interval") + 3000 ))
    procs_spawn -o /dev/null -e - perf record -q \
      -e sched:sched_waking,sched:sched_wakeup,sched:sched_switch -a -o "$work/$b.perf" \
      -- sleep "$(awk -v m="$span_ms" 'BEGIN {printf "%.1f", m / 1000}')"
    perf_pid=$PROCS_PID; pids+=("$perf_pid")
    sleep 0.5 # perf's own start-up, so the first commands are in the recording
  fi
  before="$(by_thread "$bpid")"; b0=$(total "$bpid"); r0=$(total "$rpid")
  procs_spawn -o /dev/null -e - "$target/fleetlink-loadgen" redis-publish --redis "$url" \
    --broker-id iw --prefix one --max-time 300s --mode single --count "$count" \
    --interval "$interval" --report "$work/$b.pub.json"
  pub_pid=$PROCS_PID; pids+=("$pub_pid")
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
import collections, os, re, statistics, sys
path, broker, redis, rig, pub = sys.argv[1], *map(int, sys.argv[2:])
line = re.compile(r'^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$')
woke = re.compile(r'comm=(.+?) pid=(\d+) prio=\d+ target_cpu=(\d+)')
switch = re.compile(r'prev_pid=(\d+) .*prev_state=(\S+) ==> next_comm=(.+?) next_pid=(\d+)')
proc, ev = {}, []
for l in open(path):
    m = line.match(l)
    if not m:
        continue
    comm, pid, tid, cpu, t, kind, rest = m.groups()
    proc[int(tid)] = int(pid)
    if kind in ('sched_waking', 'sched_wakeup'):
        w = woke.search(rest)
        ev.append((float(t), kind[-2:], int(pid), int(cpu), int(w.group(2)), int(w.group(3)), w.group(1)))
    elif kind == 'sched_switch':
        s = switch.search(rest)
        ev.append((float(t), 'sw', int(pid), int(cpu), int(s.group(4)), re.sub(r'[/\d]+$', '', s.group(3)),
                   int(s.group(1)), s.group(2)))
ev.sort(key=lambda e: e[0])
# The first count (kept so that earlier figures reproduce): sched_wakeup only, the broker's
# wake-ups between the PUBLISH and the rig's.
wakes = [(e[0], e[2], e[4], e[6]) for e in ev if e[1] == 'up']
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
if rows:
    per = collections.Counter()
    for r in rows:
        per.update(r[2])
    spans = sorted(r[1] for r in rows)
    print('  trace: %d commands followed; broker wake-ups between the PUBLISH and the rig: median %s, mean %.2f (%s); span p50 %.0f us, p90 %.0f us' % (
        len(rows), statistics.median(r[0] for r in rows), statistics.mean(r[0] for r in rows),
        ', '.join('%s %.2f' % (k, v / len(rows)) for k, v in sorted(per.items())),
        statistics.median(spans), spans[int(len(spans) * 0.9)]))
ours = (broker, redis)
# The thread a switch puts on the CPU. PID 1's threads (on the dev VM, its agent) are told
# apart from the baseline's tokio workers, which share their thread name; perf records no event
# with them current, so they are listed from /proc.
pid1 = {int(t) for t in os.listdir('/proc/1/task')} if os.path.isdir('/proc/1/task') else set()
name = lambda e: ('pid1:' if e[4] in pid1 else '') + e[5]
# A command: the publisher waking Redis (the PUBLISH) until the broker wakes the rig (the write).
cmds = []
for i, e in enumerate(ev):
    if e[1] != 'ng' or e[2] != pub or proc.get(e[4]) != redis:
        continue
    for j in range(i + 1, len(ev)):
        f = ev[j]
        if f[0] - e[0] > 0.008:
            break
        if f[1] == 'ng' and f[2] == broker and proc.get(f[4]) == rig:
            cmds.append((f[0] - e[0], i, j))
            break
if not cmds:
    print('  trace: no command followed from the PUBLISH to the rig')
    sys.exit(0)
# Along each command: every broker or Redis thread woken from sleep, and the time from the
# wake-up call until it ran, split by where it was put: onto another CPU that was idle (a vCPU
# to wake), or onto a busy one, with whoever held that CPU when the call was made.
window = {}
for c, (_, i, j) in enumerate(cmds):
    for k in range(i, j + 1):
        window[k] = c
stats = [collections.Counter() for _ in cmds]
pend = [{} for _ in cmds]
pre = [{} for _ in cmds]
running, idle_since = {}, {}
for k, e in enumerate(ev):
    t, kind, waker, cpu = e[:4]
    c = window.get(k)
    if kind == 'sw':
        if c is not None:
            # A thread of ours, or the rig, taken off its CPU while it still had work.
            if e[7].startswith('R') and proc.get(e[6]) in ours + (rig,):
                pre[c][e[6]] = (t, name(e))
            q = pre[c].pop(e[4], None)
            if q:
                stats[c]['preempted_us'] += (t - q[0]) * 1e6
                stats[c]['by:' + q[1]] += (t - q[0]) * 1e6
            p = pend[c].pop(e[4], None)
            if p and p[2] is not None:
                r, took = stats[c], (t - p[0]) * 1e6
                r['hops'] += 1
                if p[2] == 'idle':
                    r['to_idle'] += 1
                    r['idle_us'] += took
                else:
                    r['busy_us'] += took
                    if took > 50:
                        r['held:' + p[2]] += took
        running[cpu] = name(e)
        if e[5] == 'swapper':
            idle_since[cpu] = t
        else:
            idle_since.pop(cpu, None)
    elif c is None:
        continue
    elif kind == 'ng' and proc.get(e[4]) in ours:
        # Who holds each CPU as the wake-up is asked for; the target is known at sched_wakeup.
        pend[c][e[4]] = [t, cpu, None, dict(running), set(idle_since)]
    elif kind == 'up' and e[4] in pend[c] and pend[c][e[4]][2] is None:
        p, target = pend[c][e[4]], e[5]
        idle = target in p[4] and target != p[1]
        p[2] = 'idle' if idle else ('itself' if target == p[1] else p[3].get(target, '?'))
rows = [(span, stats[c]) for c, (span, _, _) in enumerate(cmds)]
rows.sort(key=lambda r: r[0])
n = len(rows)
print('  trace: %d commands followed from the PUBLISH to the rig; per command, by latency band:' % n)
for band, lo, hi in (('fastest half', 0, n // 2), ('p50-p90', n // 2, int(n * .9)),
                     ('p90-p98', int(n * .9), int(n * .98)), ('slowest 2%', int(n * .98), n)):
    g = rows[lo:hi]
    if not g:
        continue
    t = collections.Counter()
    for _, r in g:
        t.update(r)
    k = len(g)
    held = ', '.join('%s %.0f' % (c[5:], v / k) for c, v in t.most_common() if c.startswith('held:') and v / k >= 10)
    by = ', '.join('%s %.0f' % (c[3:], v / k) for c, v in t.most_common() if c.startswith('by:') and v / k >= 10)
    print('    %-12s span %5.0f us | threads woken %.1f: onto an idle CPU %.1f taking %3.0f us in all, '
          'onto a busy one %.1f taking %3.0f us%s | preempted %3.0f us%s' % (band, statistics.mean(sp for sp, _ in g) * 1e6,
          t['hops'] / k, t['to_idle'] / k, t['idle_us'] / k, (t['hops'] - t['to_idle']) / k, t['busy_us'] / k,
          (' (held by: %s)' % held) if held else '', t['preempted_us'] / k, (' (by: %s)' % by) if by else ''))
PY
  fi
  kill "$bpid" "$rpid" 2>/dev/null || true
  wait "$bpid" "$rpid" 2>/dev/null || true
  pids=()
done
