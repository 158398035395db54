#!/usr/bin/env bash
# fanout-cpu.sh — where the CPU of a Redis fan-out goes: for each broker, N rigs, then F
# fan-outs of one command per rig (each one pipeline of N PUBLISHes), and the CPU every broker
# thread, the rigs' loadgen and Redis spent from just before the first PUBLISH until the last
# command arrived. Brokers alternate, R rounds.
#
#   bench/fanout-cpu.sh [--rigs 10000] [--fanouts 3] [--rounds 2] [--name SUFFIX]
#                       [--brokers "fleetlink-fe-redis fleetlink-fe-redis-allcores
#                                   fleetlink-fe-redis-nopersist tokio-baseline-redis-rb4096"]
#
# fleetlink-fe runs in fleet mode with --cores = CPUs - 1 (docs/tuning.md: the bridge gets a
# CPU); fleetlink-fe-redis-allcores is the same with a core on every CPU, for comparison.
# Also known: tokio-baseline-redis-default, and tokio-baseline-redis-store-rb4096 (the tuned
# baseline with --session-ttl 10m: every command kept in Redis before it is written).
#
# Prints one line per session and a summary (medians over rounds: CPU ms per 1,000 commands of
# the broker, Redis, the loadgen and all three, context switches per 1,000 commands, p99), and
# writes bench/results/fanout-cpu.json, or fanout-cpu-SUFFIX.json with --name (without it, the
# previous run's fanout-cpu.json is overwritten). Its own redis-server on
# FANOUT_REDIS_PORT (default 26379), brokers on FANOUT_LISTEN_PORT/FANOUT_ADMIN_PORT (26080/26090;
# keep all three below the host's ip_local_port_range); everything it starts is stopped on
# exit, failure or signal (bench/lib/procs.sh). Needs release builds (`bench/run` builds them)
# and jq.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
target="${CARGO_TARGET_DIR:-$here/../target}/release"
rigs=10000 fanouts=3 rounds=2
brokers="fleetlink-fe-redis fleetlink-fe-redis-allcores fleetlink-fe-redis-nopersist tokio-baseline-redis-rb4096"
suffix=""
rport="${FANOUT_REDIS_PORT:-26379}" lport="${FANOUT_LISTEN_PORT:-26080}" aport="${FANOUT_ADMIN_PORT:-26090}"
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rigs) rigs="$2"; shift 2 ;;
    --fanouts) fanouts="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --brokers) brokers="$2"; shift 2 ;;
    --name) suffix="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "fanout-cpu: unknown argument $1" >&2; usage; exit 64 ;;
  esac
done
(( rigs <= 19000 )) || { echo "fanout-cpu: --rigs at most 19000" >&2; exit 64; }
[[ "$suffix" =~ ^[A-Za-z0-9._-]*$ ]] || { echo "fanout-cpu: --name: letters, digits, . _ - only" >&2; exit 64; }
result="$here/results/fanout-cpu${suffix:+-$suffix}.json"
work="$(mktemp -d /tmp/fanout-cpu.XXXXXX)"
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

for bin in fleetlink-fe fleetlink-loadgen fleetlink-tokio-baseline; do
  [[ -x "$target/$bin" ]] || { echo "fanout-cpu: $target/$bin is missing (cargo build --release)" >&2; exit 1; }
done
# Each session FLUSHALLs its Redis: never one this script did not start.
if redis-cli -p "$rport" ping >/dev/null 2>&1; then
  echo "fanout-cpu: something already answers on port $rport; set FANOUT_REDIS_PORT to a free one" >&2
  exit 1
fi
procs_spawn -o "$work/redis.log" -e - redis-server --port "$rport" --bind 127.0.0.1 --save "" \
  --appendonly no --daemonize no
rpid=$PROCS_PID; pids+=("$rpid")
for _ in $(seq 100); do
  redis-cli -p "$rport" ping >/dev/null 2>&1 && break
  kill -0 "$rpid" 2>/dev/null || { echo "fanout-cpu: redis-server did not start: $(tail -1 "$work/redis.log")" >&2; exit 1; }
  sleep 0.1
done
url="redis://127.0.0.1:$rport/"

fleet_cores=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))
broker_cmd() {
  local fe=("$target/fleetlink-fe" --redis "$url" --listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport"
            --broker-id fx --accept-rate 100000 --accept-burst 100000 --drain 1s)
  local tb=("$target/fleetlink-tokio-baseline" --redis "$url" --listen "127.0.0.1:$lport"
            --admin "127.0.0.1:$aport" --broker-id fx)
  case "$1" in
    fleetlink-fe-redis) echo "${fe[@]}" --cores "$fleet_cores" ;;
    fleetlink-fe-redis-allcores) echo "${fe[@]}" ;;
    fleetlink-fe-redis-nopersist) echo "${fe[@]}" --cores "$fleet_cores" --session-ttl 0 ;;
    tokio-baseline-redis-default) echo "${tb[@]}" ;;
    tokio-baseline-redis-rb4096) echo "${tb[@]}" --read-buffer 4096 --write-buffer 0 ;;
    # The same keeping every command in Redis first, as fleetlink-fe-redis does.
    tokio-baseline-redis-store-rb4096)
      echo "${tb[@]}" --read-buffer 4096 --write-buffer 0 --session-ttl 10m ;;
    *) echo "fanout-cpu: unknown broker $1" >&2; exit 64 ;;
  esac
}
ticks() { awk '{print $14 + $15}' "$1" 2>/dev/null || echo 0; }
# Context switches of every thread of a process (voluntary + preempted).
switches() { { cat /proc/"$1"/task/*/status 2>/dev/null || true; } | awk '/ctxt_switches/ {s += $2} END {print s + 0}'; }
# "group ticks" per thread, summed by thread name (digits stripped: core-0, core-1 -> core-).
threads() {
  for t in /proc/"$1"/task/*; do echo "$(tr -d '0-9' <"$t/comm") $(ticks "$t/stat")"; done \
    | awk '{s[$1] += $2} END {for (k in s) print k, s[k]}'
}
hz=$(getconf CLK_TCK)
: >"$work/sessions.jsonl"
for ((r = 1; r <= rounds; r++)); do
  for b in $brokers; do
    redis-cli -p "$rport" flushall >/dev/null
    # shellcheck disable=SC2046  # plain words
    procs_spawn -o "$work/broker.log" -e - $(broker_cmd "$b")
    bpid=$PROCS_PID; pids+=("$bpid")
    for _ in $(seq 300); do
      curl -sf -o /dev/null "http://127.0.0.1:$aport/readyz" && break
      kill -0 "$bpid" 2>/dev/null || { echo "fanout-cpu: $b exited at start: $(tail -2 "$work/broker.log")" >&2; exit 1; }
      sleep 0.1
    done
    procs_spawn -o "$work/rigs.out" -e "$work/rigs.err" "$target/fleetlink-loadgen" rigs \
      --url "ws://127.0.0.1:$lport/agent" --rigs "$rigs" --prefix rig --hold 120s --max-time 200s \
      --until-commands $((rigs * fanouts)) --report "$work/rigs.json"
    lpid=$PROCS_PID; pids+=("$lpid")
    for _ in $(seq 600); do grep -q '^ALL_WELCOMED' "$work/rigs.out" && break; sleep 0.1; done
    grep -q '^ALL_WELCOMED' "$work/rigs.out" || { echo "fanout-cpu: $b ramp failed" >&2; exit 1; }
    sleep 1
    before=$(threads "$bpid"); lg0=$(ticks "/proc/$lpid/stat"); rd0=$(ticks "/proc/$rpid/stat")
    bs0=$(switches "$bpid"); ls0=$(switches "$lpid")
    "$target/fleetlink-loadgen" redis-publish --redis "$url" --broker-id fx --prefix rig --max-time 60s \
      --mode fanout --rigs "$rigs" --count "$fanouts" --interval 2s --report "$work/pub.json" >/dev/null
    # The loadgen prints COMMANDS_DONE once every command arrived, then closes its rigs: the
    # clocks are read when that line shows (polled every 20 ms), so the closing is not counted.
    for _ in $(seq 3000); do
      grep -q '^COMMANDS_DONE' "$work/rigs.out" && break
      kill -0 "$lpid" 2>/dev/null || { echo "fanout-cpu: $b: loadgen ended early" >&2; exit 1; }
      sleep 0.02
    done
    after=$(threads "$bpid"); rd1=$(ticks "/proc/$rpid/stat"); bs1=$(switches "$bpid")
    if kill -0 "$lpid" 2>/dev/null; then
      lg1=$(ticks "/proc/$lpid/stat"); ls1=$(switches "$lpid")
    else
      # A small fan-out: the loadgen was done and gone before its clocks were read.
      echo "fanout-cpu: $b: the loadgen ended before its CPU could be read; its figures read 0 (more --rigs avoids it)" >&2
      lg1=$lg0; ls1=$ls0
    fi
    wait "$lpid" 2>/dev/null || true
    jq -c --arg b "$b" --argjson r "$r" --argjson hz "$hz" --argjson n $((rigs * fanouts)) \
      --arg before "$before" --arg after "$after" --argjson lg $((lg1 - lg0)) --argjson rd $((rd1 - rd0)) \
      --argjson bsw $((bs1 - bs0)) --argjson lsw $((ls1 - ls0)) '
      def tab(s): s | split("\n") | map(select(length > 0) | split(" ") | {(.[0]): (.[1] | tonumber)}) | add;
      (tab($after)) as $a | (tab($before)) as $z |
      {broker: $b, round: $r, commands: $n, received: .commands_received,
       latency_ms: {p50: (.latency_us.p50 / 1000), p99: (.latency_us.p99 / 1000)},
       context_switches: {broker: $bsw, loadgen: $lsw},
       cpu_ms: ({broker_total: ([$a | to_entries[] | .value - ($z[.key] // 0)] | add * 1000 / $hz),
                 loadgen: ($lg * 1000 / $hz), redis: ($rd * 1000 / $hz)}
                + ($a | with_entries(.value = ((.value - ($z[.key] // 0)) * 1000 / $hz))))}' \
      "$work/rigs.json" | tee -a "$work/sessions.jsonl"
    # CPU is read in clock ticks (10 ms at 100 Hz): a reading of a few ticks is mostly rounding,
    # and 0 ms does not mean no CPU. Say so rather than let it pass as a figure.
    for part in broker_total redis loadgen; do
      ms=$(tail -n 1 "$work/sessions.jsonl" | jq ".cpu_ms.$part")
      if jq -en --argjson ms "$ms" --argjson hz "$hz" '$ms < 5 * 1000 / $hz' >/dev/null; then
        echo "fanout-cpu: $b round $r: $part CPU reads $ms ms, under five clock ticks ($hz Hz): rounding, not a figure (more --rigs or --fanouts)" >&2
      fi
    done
    kill "$bpid" 2>/dev/null || true; wait "$bpid" 2>/dev/null || true
  done
done
mkdir -p "$here/results"
jq -s '{method: "per-thread utime+stime (/proc/PID/task/*/stat, 10 ms ticks) from just before the first PUBLISH until every command arrived; Redis and the rigs loadgen likewise",
        sessions: .,
        median_cpu_ms_per_1000_commands: (group_by(.broker) | map({(.[0].broker): (
          [.[] | .cpu_ms.broker_total * 1000 / .commands] | sort | .[length / 2 | floor])}) | add),
        medians: (group_by(.broker) | map(def med(f): [.[] | f] | sort | .[length / 2 | floor];
          {(.[0].broker): {
            broker_cpu_ms_per_1000: med(.cpu_ms.broker_total * 1000 / .commands),
            redis_cpu_ms_per_1000: med(.cpu_ms.redis * 1000 / .commands),
            loadgen_cpu_ms_per_1000: med(.cpu_ms.loadgen * 1000 / .commands),
            all_cpu_ms_per_1000: med((.cpu_ms.broker_total + .cpu_ms.redis + .cpu_ms.loadgen) * 1000 / .commands),
            broker_switches_per_1000: med(.context_switches.broker * 1000 / .commands),
            loadgen_switches_per_1000: med(.context_switches.loadgen * 1000 / .commands),
            p99_ms: med(.latency_ms.p99)}}) | add)}' \
  "$work/sessions.jsonl" | tee "$result" | jq '.medians'
echo "fanout-cpu: wrote $result" >&2
