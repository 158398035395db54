#!/usr/bin/env bash
# latency.sh — command latency (publisher stamp `args.sent_at_us` -> receipt at the rig), side by
# side in one run, for:
#
#   fleetlink-fe-redis       fleetlink-fe in fleet mode; commands PUBLISHed on fleetlink:broker:fe-a;
#                            --cores = CPUs - 1, the playbook's fleet-mode setting (docs/tuning.md:
#                            the bridge thread gets a CPU of its own)
#   fleetlink-fe-redis-nopersist  the same with --session-ttl 0: no session kept in Redis, so
#                            the same guarantee as the baseline (commands are written at once)
#   fleetlink-fe-admin       fleetlink-fe standalone; commands POSTed to /v1/rigs/{id}/commands
#   tokio-baseline-default   the tokio baseline, tungstenite's default buffers; admin POSTs
#   tokio-baseline-rb4096    the baseline with --read-buffer 4096 --write-buffer 0; admin POSTs
#   tokio-baseline-redis-default  the baseline with --redis (broker id tb-a), default buffers;
#                                 commands PUBLISHed on fleetlink:broker:tb-a as for fleetlink-fe-redis
#   tokio-baseline-redis-rb4096   the same with --read-buffer 4096 --write-buffer 0
#   tokio-baseline-redis-store-rb4096  the same with --session-ttl 10m: every command is kept in
#                                 Redis (lua/persist.lua) before it is written, as with
#                                 fleetlink-fe-redis; the same guarantee's cost on tokio
#
# and two shapes each:
#
#   single   one rig connected; K commands to it one at a time, INTERVAL apart (idle latency)
#   fanout   N rigs connected; one command to every rig at once (Redis: all N PUBLISHes in one
#            pipeline; admin: N POSTs over 8 keep-alive connections), F times per session
#
#   bench/latency.sh [--name SUFFIX] [--rigs N] [--rounds R] [--single K] [--interval 10ms]
#                    [--fanouts F] [--fanout-gap 2s] [--brokers "fleetlink-fe-redis ..."]
#                    [--time-limit SECONDS] [--results DIR] [--nice N] [--no-build]
#
# Any broker name may end in "+nice" ("fleetlink-fe-redis+nice"): the same broker started under
# `nice -n N` (--nice, default -10: the priority of this VM's own control agent), compared only
# with the other "+nice" brokers. It asks whether a broker's tail is other processes holding
# its CPU.
#
# Defaults: N=10000, R=3, K=500, INTERVAL=10ms, F=2, all eight brokers, time limit 1800 s.
# A round runs one session per broker (the order rotates each round, so no broker always goes
# first); a session starts the broker, runs the single shape with a 1-rig loadgen, then the
# fan-out shape with an N-rig loadgen (`--until-commands` ends each loadgen once every command
# has arrived), and stops the broker. Each session's loadgen report gives p50/p99/p999/max;
# the summary quotes, per broker and shape, the MEDIAN over the R sessions of p50, p99 and
# p999, and the largest max; ratios compare each baseline with fleetlink-fe on the same path
# (admin POST: fleetlink-fe-admin; Redis: fleetlink-fe-redis). Loadgen, Redis and the broker
# share the machine's cores.
#
# Output (--results, default bench/results): latency-<broker>[-SUFFIX].json (every session's
# reports) and latency-summary[-SUFFIX].md, then the latency CDFs as SVGs, drawn by
# `fleetlink-bench plots` (FLEETLINK_BENCH, default from the target dir as for the brokers:
# FLEETLINK_FE, TOKIO_BASELINE, LOADGEN) from this run's files when that binary is built. Its own redis-server (port LATENCY_REDIS_PORT,
# default 24379, --save "" --appendonly no) and every broker/loadgen it starts are stopped on
# exit, failure or signal (bench/lib/procs.sh: each in its own process group, SIGKILLed if this
# script dies without its cleanup); --time-limit is checked before every session, and every
# step inside a session has its own bound. Ports: LATENCY_LISTEN_PORT (24080),
# LATENCY_ADMIN_PORT (24090); a broker that cannot start (say, a port taken meanwhile) is
# retried twice, 2 s apart. LATENCY_REDIS_UNIX=1 has every broker and the publisher reach Redis
# through its Unix socket (`unix://`) instead of TCP: Redis on the broker's own host.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
target="${CARGO_TARGET_DIR:-$root/target}/release"
loadgen="${LOADGEN:-$target/fleetlink-loadgen}"
fe="${FLEETLINK_FE:-$target/fleetlink-fe}"
baseline="${TOKIO_BASELINE:-$target/fleetlink-tokio-baseline}"
bench_bin="${FLEETLINK_BENCH:-$target/fleetlink-bench}"
lport="${LATENCY_LISTEN_PORT:-24080}"
aport="${LATENCY_ADMIN_PORT:-24090}"
rport="${LATENCY_REDIS_PORT:-24379}"
suffix=""
rigs=10000
rounds=3
single=500
interval=10ms
fanouts=2
fanout_gap=2s
brokers="fleetlink-fe-redis fleetlink-fe-redis-nopersist fleetlink-fe-admin tokio-baseline-default tokio-baseline-rb4096 tokio-baseline-redis-default tokio-baseline-redis-rb4096 tokio-baseline-redis-store-rb4096"
time_limit=1800
nice=-10
build=1
results="$here/results"

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-64}"; }
die() { echo "latency: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) suffix="$2"; shift 2 ;;
    --rigs) rigs="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --single) single="$2"; shift 2 ;;
    --interval) interval="$2"; shift 2 ;;
    --fanouts) fanouts="$2"; shift 2 ;;
    --fanout-gap) fanout_gap="$2"; shift 2 ;;
    --brokers) brokers="$2"; shift 2 ;;
    --time-limit) time_limit="$2"; shift 2 ;;
    --results) results="$2"; shift 2 ;;
    --nice) nice="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "latency: unknown argument $1" >&2; usage ;;
  esac
done
[[ "$nice" =~ ^-?[0-9]+$ ]] && (( nice >= -20 && nice <= 19 )) || die "--nice must be an integer (-20..19)"
for v in rigs rounds single fanouts time_limit; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "--${v//_/-} must be a positive integer"
done
(( rigs <= 19000 )) || die "--rigs $rigs exceeds 19000 (20,000 fds per broker process)"
for b in $brokers; do
  case "${b%+nice}" in
    fleetlink-fe-redis|fleetlink-fe-redis-nopersist|fleetlink-fe-admin) ;;
    tokio-baseline-default|tokio-baseline-rb4096) ;;
    tokio-baseline-redis-default|tokio-baseline-redis-rb4096|tokio-baseline-redis-store-rb4096) ;;
    *) die "unknown broker $b" ;;
  esac
done
# Durations as milliseconds, for the bounds below.
ms() {
  [[ "$1" =~ ^([0-9]+)(ms|s)$ ]] || die "duration $1: use NNms or NNs"
  if [[ "${BASH_REMATCH[2]}" == ms ]]; then echo "${BASH_REMATCH[1]}"; else echo $((BASH_REMATCH[1] * 1000)); fi
}
interval_ms=$(ms "$interval")
gap_ms=$(ms "$fanout_gap")
command -v redis-server >/dev/null || die "redis-server not found"
command -v jq >/dev/null || die "jq not found"
command -v python3 >/dev/null || die "python3 not found"

if (( build )); then
  echo "latency: building (release)" >&2
  (cd "$root" && cargo build --release -p fleetlink -p fleetlink-loadgen -p fleetlink-tokio-baseline \
    --bin fleetlink-fe --bin fleetlink-loadgen --bin fleetlink-tokio-baseline >/dev/null 2>&1) \
    || die "cargo build failed (run it by hand to see why)"
fi
for x in "$loadgen" "$fe" "$baseline"; do [[ -x "$x" ]] || die "$x not found (build first)"; done

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for p in "$lport" "$aport" "$rport"; do port_free "$p" || die "port $p is in use (set LATENCY_*_PORT)"; done

work="$(mktemp -d /tmp/latency.XXXXXX)"
redis_pid=""
broker_pid=""
lg_pid=""
pub_pid=""
start_s=$SECONDS
redis_url="redis://127.0.0.1:$rport/"
redis_unix=()
if [[ "${LATENCY_REDIS_UNIX:-0}" == 1 ]]; then
  redis_unix=(--unixsocket "$work/redis.sock" --unixsocketperm 700)
  redis_url="unix://$work/redis.sock"
fi

# Stops one process we started (and its process group): TERM, up to $2 tenths of a second,
# then KILL.
stop_pid() {
  procs_stop "${2:-50}" "$1"
}

cleanup() {
  local rc=$?
  procs_cleanup_begin # signals from here on only hurry the stops below to SIGKILL
  trap - EXIT
  stop_pid "$pub_pid" 20
  stop_pid "$lg_pid" 200   # the loadgen closes its rigs and writes its report first
  stop_pid "$broker_pid" 50
  stop_pid "$redis_pid" 50
  procs_stop_all 50 # anything a signal caught before its pid was recorded above
  if (( rc != 0 )); then echo "latency: failed (rc=$rc); logs kept in $work" >&2; else rm -rf "$work"; fi
  exit "$rc"
}
trap cleanup EXIT
procs_traps

over_time() { (( SECONDS - start_s >= time_limit )); }

# --- Redis -------------------------------------------------------------------------------
procs_spawn -o /dev/null -e - redis-server --port "$rport" --bind 127.0.0.1 --save "" \
  --appendonly no --logfile "$work/redis.log" --daemonize no "${redis_unix[@]}"
redis_pid=$PROCS_PID
for _ in $(seq 100); do
  [[ "$(redis-cli -p "$rport" ping 2>/dev/null)" == PONG ]] && break
  kill -0 "$redis_pid" 2>/dev/null || die "redis-server exited (log: $work/redis.log)"
  sleep 0.1
done
[[ "$(redis-cli -p "$rport" ping 2>/dev/null)" == PONG ]] || die "redis-server not answering on $rport"

# --- Brokers -----------------------------------------------------------------------------
# Fleet mode leaves the bridge thread a CPU (docs/tuning.md, "Fleet mode: a CPU for the bridge").
fleet_cores=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))
broker_cmd() {
  if [[ "$1" == *+nice ]]; then
    echo nice -n "$nice" "$(broker_cmd "${1%+nice}")"
    return
  fi
  local common_fe=(--listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport" --broker-id fe-a
                   --accept-rate 100000 --accept-burst 100000 --drain 1s)
  local common_tb=(--listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport" --broker-id tb-a)
  case "$1" in
    fleetlink-fe-redis) echo "$fe" --redis "$redis_url" "${common_fe[@]}" --cores "$fleet_cores" ;;
    fleetlink-fe-redis-nopersist)
      echo "$fe" --redis "$redis_url" "${common_fe[@]}" --cores "$fleet_cores" --session-ttl 0 ;;
    fleetlink-fe-admin) echo "$fe" "${common_fe[@]}" ;;
    tokio-baseline-default) echo "$baseline" "${common_tb[@]}" ;;
    tokio-baseline-rb4096) echo "$baseline" "${common_tb[@]}" --read-buffer 4096 --write-buffer 0 ;;
    tokio-baseline-redis-default) echo "$baseline" --redis "$redis_url" "${common_tb[@]}" ;;
    tokio-baseline-redis-rb4096)
      echo "$baseline" --redis "$redis_url" "${common_tb[@]}" --read-buffer 4096 --write-buffer 0 ;;
    tokio-baseline-redis-store-rb4096)
      echo "$baseline" --redis "$redis_url" "${common_tb[@]}" --read-buffer 4096 --write-buffer 0 \
        --session-ttl 10m ;;
  esac
}

# The broker id a Redis-mode broker subscribes under; empty for the admin-POST brokers.
redis_broker_id() {
  case "${1%+nice}" in
    fleetlink-fe-redis|fleetlink-fe-redis-nopersist) echo fe-a ;;
    tokio-baseline-redis-*) echo tb-a ;;
    *) echo "" ;;
  esac
}

start_broker() {
  local b="$1" log="$2" attempt
  for attempt in 1 2 3; do
    if [[ -n "$(redis_broker_id "$b")" ]]; then redis-cli -p "$rport" flushall >/dev/null; fi
    # shellcheck disable=SC2046  # the command line is plain words (paths without spaces)
    procs_spawn -o "$log" -e - $(broker_cmd "$b")
    broker_pid=$PROCS_PID
    local deadline=$((SECONDS + 30))
    while :; do
      # Ready = our process answers /readyz (not someone else's on the same port).
      if kill -0 "$broker_pid" 2>/dev/null && curl -sf -o /dev/null "http://127.0.0.1:$aport/readyz"; then
        return 0
      fi
      kill -0 "$broker_pid" 2>/dev/null || break
      (( SECONDS < deadline )) || die "$b not ready after 30 s (log: $log)"
      sleep 0.1
    done
    wait "$broker_pid" 2>/dev/null || true
    broker_pid=""
    echo "latency: $b exited before ready (attempt $attempt): $(tail -1 "$log")" >&2
    sleep 2
  done
  die "$b did not start (log: $log)"
}

# --- One loadgen + publisher pass ----------------------------------------------------------
# run_shape BROKER SHAPE ROUND: writes $work/<broker>-r<round>-<shape>.{rigs,pub}.json
run_shape() {
  local b="$1" shape="$2" round="$3"
  local base="$work/$b-r$round-$shape" n prefix expect pub_bound hold
  if [[ "$shape" == single ]]; then
    n=1; prefix=single; expect=$single
    pub_bound=$((single * (interval_ms + 50) / 1000 + 30))
  else
    n=$rigs; prefix=rig; expect=$((rigs * fanouts))
    pub_bound=$((fanouts * (gap_ms / 1000 + 30) + 30))
  fi
  hold=$((pub_bound + 30))
  : >"$base.rigs.out"
  procs_spawn -o "$base.rigs.out" -e "$base.rigs.err" "$loadgen" rigs \
    --url "ws://127.0.0.1:$lport/agent" --rigs "$n" --prefix "$prefix" \
    --hold "${hold}s" --max-time "$((hold + 120))s" --until-commands "$expect" \
    --report "$base.rigs.json"
  lg_pid=$PROCS_PID
  local deadline=$((SECONDS + 60 + n / 100))
  until grep -q '^ALL_WELCOMED' "$base.rigs.out"; do
    grep -q '^RAMP_INCOMPLETE' "$base.rigs.out" && die "$b $shape: $(cat "$base.rigs.out"); see $base.rigs.err"
    kill -0 "$lg_pid" 2>/dev/null || die "$b $shape: loadgen exited during ramp; see $base.rigs.err"
    kill -0 "$broker_pid" 2>/dev/null || die "$b exited during ramp"
    (( SECONDS < deadline )) || die "$b $shape: ramp not done in time; see $base.rigs.err"
    sleep 0.1
  done
  sleep 1 # let the ramp's tail (registry writes, allocator) settle before measuring

  local pub=() bid
  bid="$(redis_broker_id "$b")"
  if [[ -n "$bid" ]]; then
    pub=("$loadgen" redis-publish --redis "$redis_url" --broker-id "$bid" --prefix "$prefix"
         --max-time "${pub_bound}s")
    if [[ "$shape" == single ]]; then
      pub+=(--mode single --count "$single" --interval "$interval")
    else
      pub+=(--mode fanout --rigs "$rigs" --count "$fanouts" --interval "$fanout_gap")
    fi
  else
    pub=("$loadgen" admin-fanout --admin "http://127.0.0.1:$aport" --prefix "$prefix"
         --max-time "${pub_bound}s")
    if [[ "$shape" == single ]]; then
      pub+=(--rigs 1 --count "$single" --interval "$interval")
    else
      pub+=(--rigs "$rigs" --count "$fanouts" --interval "$fanout_gap")
    fi
  fi
  procs_spawn -o "$base.pub.out" -e "$base.pub.err" "${pub[@]}" --report "$base.pub.json"
  pub_pid=$PROCS_PID
  local rc=0
  wait "$pub_pid" || rc=$?
  pub_pid=""
  (( rc == 0 )) || die "$b $shape: publisher failed (rc=$rc): $(cat "$base.pub.out" "$base.pub.err")"

  # The loadgen ends by itself once every command arrived; lost commands end it at --hold.
  deadline=$((SECONDS + hold + 30))
  while kill -0 "$lg_pid" 2>/dev/null; do
    (( SECONDS < deadline )) || { stop_pid "$lg_pid" 200; break; }
    sleep 0.1
  done
  wait "$lg_pid" 2>/dev/null || true
  lg_pid=""
  [[ -s "$base.rigs.json" ]] || die "$b $shape: no loadgen report; see $base.rigs.err"
  jq -c --arg broker "$b" --arg shape "$shape" --argjson round "$round" --argjson expected "$expect" \
    --slurpfile pub "$base.pub.json" \
    '{broker: $broker, round: $round, shape: $shape, expected: $expected,
      received: .commands_received, exit_reason, latency_us, ramp_ms, handshake_us,
      publisher: $pub[0]}' "$base.rigs.json" >>"$work/sessions.jsonl"
  jq -r --arg b "$b" --arg s "$shape" --argjson r "$round" \
    '"latency: round \($r) \($b) \($s): n=\(.latency_us.count) p50=\(.latency_us.p50)us p99=\(.latency_us.p99)us max=\(.latency_us.max)us"' \
    "$base.rigs.json" >&2
}

# --- Rounds --------------------------------------------------------------------------------
read -r -a blist <<<"$brokers"
nb=${#blist[@]}
for ((r = 1; r <= rounds; r++)); do
  for ((j = 0; j < nb; j++)); do
    b="${blist[$(((j + r - 1) % nb))]}"
    over_time && die "time limit ${time_limit}s reached before round $r $b"
    echo "latency: round $r/$rounds: $b" >&2
    start_broker "$b" "$work/$b-r$r.broker.log"
    run_shape "$b" single "$r"
    run_shape "$b" fanout "$r"
    stop_pid "$broker_pid" 100
    broker_pid=""
  done
done

# --- Results -------------------------------------------------------------------------------
mkdir -p "$results"
cmds_json=$(for b in "${blist[@]}"; do jq -n --arg b "$b" --arg c "$(broker_cmd "$b" | sed "s|$root/||g")" '{($b): $c}'; done | jq -s -c add)
python3 - "$work/sessions.jsonl" "$results" "$suffix" "$cmds_json" <<PY
import json, statistics, sys, datetime, platform, os, subprocess
path, outdir, suffix, cmds = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
rows = [json.loads(l) for l in open(path) if l.strip()]
sfx = f"-{suffix}" if suffix else ""
date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
def ver(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except Exception:
        return None
host = {"nproc": os.cpu_count(), "kernel": platform.release(), "rustc": ver(["rustc", "--version"]),
        "redis": ver(["redis-server", "--version"])}
params = {"rigs": $rigs, "rounds": $rounds, "single_count": $single, "single_interval": "$interval",
          "fanouts_per_session": $fanouts, "fanout_gap": "$fanout_gap",
          "admin_http_connections": 8, "loadgen": "1 process, tokio current-thread"}
order = [b for b in "$brokers".split()]
path_of = {"fleetlink-fe-redis": "Redis PUBLISH", "fleetlink-fe-redis-nopersist": "Redis PUBLISH", "fleetlink-fe-admin": "admin POST",
           "tokio-baseline-default": "admin POST", "tokio-baseline-rb4096": "admin POST",
           "tokio-baseline-redis-default": "Redis PUBLISH", "tokio-baseline-redis-rb4096": "Redis PUBLISH",
           "tokio-baseline-redis-store-rb4096": "Redis PUBLISH"}
# "+nice": the same broker started under nice(1); compared only with its like at that priority.
nice_sfx = lambda b: "+nice" if b.endswith("+nice") else ""
path_of.update({b: path_of[b.removesuffix("+nice")] for b in order})
summary = {}
for b in order:
    summary[b] = {}
    for shape in ("single", "fanout"):
        rs = [r for r in rows if r["broker"] == b and r["shape"] == shape]
        if not rs:
            continue
        def med(k):
            v = [r["latency_us"][k] for r in rs if r["latency_us"][k] is not None]
            return statistics.median(v) if v else None
        summary[b][shape] = {
            "sessions": len(rs),
            "samples": sum(r["latency_us"]["count"] for r in rs),
            "expected": sum(r["expected"] for r in rs),
            "lost": sum(r["expected"] - r["received"] for r in rs),
            "p50_us": med("p50"), "p99_us": med("p99"), "p999_us": med("p999"),
            "max_us": max((r["latency_us"]["max"] for r in rs if r["latency_us"]["max"] is not None), default=None),
            "p50_us_by_session": [r["latency_us"]["p50"] for r in sorted(rs, key=lambda r: r["round"])],
            "p99_us_by_session": [r["latency_us"]["p99"] for r in sorted(rs, key=lambda r: r["round"])],
        }
    doc = {"broker": b, "path": path_of[b], "command": cmds.get(b), "date": date, "host": host,
           "params": params,
           "method": "publisher stamps args.sent_at_us (unix us) just before each PUBLISH/POST (fan-out via Redis: as each PUBLISH is appended to the round's pipeline); the rig loadgen records now - sent_at_us on receipt; per-session p50/p99/p999/max from a log-linear histogram (<0.8% error); summary = median over sessions of each percentile, max over sessions",
           "summary": summary[b],
           "sessions": [r for r in rows if r["broker"] == b]}
    with open(os.path.join(outdir, f"latency-{b}{sfx}.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

ms = lambda us: "-" if us is None else f"{us / 1000:.2f}"
out = []
out.append(f"Measured {date}, {host['nproc']} cores, kernel {host['kernel']}, {host['rustc']}, {host['redis']}.")
out.append(f"single: 1 rig, {$single} commands {params['single_interval']} apart; fanout: {$rigs} rigs, one command each, "
           f"{$fanouts} fan-outs {params['fanout_gap']} apart per session. {$rounds} sessions per broker, alternating. "
           "Latency = publisher stamp to receipt at the rig, in ms; p50/p99/p999 = median over sessions, max = over all.\n")
out.append("| broker | path | shape | samples | p50 | p99 | p999 | max | lost |")
out.append("|---|---|---|---|---|---|---|---|---|")
for shape in ("single", "fanout"):
    for b in order:
        s = summary[b].get(shape)
        if not s:
            continue
        out.append(f"| {b} | {path_of[b]} | {shape} | {s['samples']:,} | {ms(s['p50_us'])} | {ms(s['p99_us'])} | "
                   f"{ms(s['p999_us'])} | {ms(s['max_us'])} | {s['lost']} |")
# Each baseline against fleetlink-fe on the same control path.
ref_of = lambda b: ("fleetlink-fe-redis" if path_of[b] == "Redis PUBLISH" else "fleetlink-fe-admin") + nice_sfx(b)
ratios = []
for shape in ("single", "fanout"):
    for b in order:
        ref = ref_of(b)
        if b.startswith("fleetlink-fe") or ref not in summary or shape not in summary[b] or shape not in summary[ref]:
            continue
        a, c = summary[ref][shape], summary[b][shape]
        if None in (a["p50_us"], a["p99_us"], c["p50_us"], c["p99_us"]):
            continue
        ratios.append(f"- {shape}: {b} / {ref}: p50 {c['p50_us'] / a['p50_us']:.2f}x, p99 {c['p99_us'] / a['p99_us']:.2f}x")
        # Same guarantee on both sides: the baseline keeps no session in Redis either (the
        # store arm does, so fleetlink-fe-redis above is already its like-for-like).
        np = "fleetlink-fe-redis-nopersist" + nice_sfx(b)
        if ref == "fleetlink-fe-redis" + nice_sfx(b) and "-store-" not in b and np in summary and shape in summary[np]:
            a = summary[np][shape]
            if None not in (a["p50_us"], a["p99_us"]):
                ratios.append(f"- {shape}: {b} / {np}: p50 {c['p50_us'] / a['p50_us']:.2f}x, p99 {c['p99_us'] / a['p99_us']:.2f}x")
if ratios:
    out.append("")
    out.extend(ratios)
out.append("")
out.append("p50 per session (ms), in round order:\n")
for shape in ("single", "fanout"):
    for b in order:
        s = summary[b].get(shape)
        if s:
            out.append(f"- {b} {shape}: " + ", ".join(ms(v) for v in s["p50_us_by_session"]))
text = "\n".join(out) + "\n"
open(os.path.join(outdir, f"latency-summary{sfx}.md"), "w").write(text)
print(text)
PY
echo "latency: wrote $results/latency-*${suffix:+-$suffix}.json and latency-summary${suffix:+-$suffix}.md (in $((SECONDS - start_s)) s)" >&2
if [[ -x "$bench_bin" ]]; then
  "$bench_bin" plots --out "$results" ${suffix:+--name "$suffix"} >&2 ||
    echo "latency: the plots failed; the figures above stand" >&2
else
  echo "latency: no $bench_bin: no plots (bench/run plots draws them)" >&2
fi
