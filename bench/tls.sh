#!/usr/bin/env bash
# tls.sh — what wss costs fleetlink-fe and the tokio baseline, side by side in one run.
#
#   bench/tls.sh [--steps "1000 5000 10000"] [--handshakes 5000] [--rounds 5] [--no-plain]
#                [--no-density] [--no-handshakes] [--max-time 1800] [--results DIR]
#   bench/tls.sh --summary-only [--results DIR]   # rewrite tls-summary.md from tls-*.json
#
# Brokers: fleetlink-fe; fleetlink-tokio-baseline with tungstenite's default buffers; the
# baseline with `--read-buffer 4096 --write-buffer 0`. Certificates come from
# `fleetlink-fe dev-certs` in a temp dir; the loadgen trusts ca.pem and verifies the name
# `localhost` (`--server-name`) while connecting to wss://127.0.0.1:PORT.
#
# (a) Density: user-space RSS per idle TLS connection (server-auth TLS: no --client-ca, so one
#     loadgen identity does not trip the 4403 check), incremental steps via bench/density.sh
#     with a wss URL. Unless --no-plain, the same brokers over plain ws too, in the same run,
#     so the TLS overhead per connection is a difference of two slopes measured minutes apart.
# (b) Full handshakes per broker CPU-second with one core: fleetlink-fe `--cores 1`
#     (`--accept-rate 100000 --accept-burst 100000`), the baseline `--workers 1`; the broker
#     pinned to CPU 0 and the loadgen (one process, 256 handshakes in flight, no resumption) to
#     CPU 1. N rigs are opened as fast as the loadgen can; the broker's utime+stime
#     (/proc/PID/stat, all threads) is read before the loadgen starts and as soon as it prints
#     ALL_WELCOMED. N / CPU seconds = handshakes (TCP accept + TLS + upgrade + hello/welcome)
#     per CPU-second, i.e. per core. Rounds are interleaved across brokers; medians are quoted.
#
# Output (--results, default bench/results): tls-<broker>.json (density, plain density, every handshake round, the
# medians) and tls-summary.md. Everything started here is stopped on exit,
# failure or signal (bench/lib/procs.sh: each in its own process group, killed if this script
# dies without its cleanup); --max-time (seconds, default 1800) bounds the whole run. Ports:
# TLS_LISTEN_PORT (18443) and TLS_ADMIN_PORT (19443); keep them below the host's
# ip_local_port_range, where the loadgen's own sockets may hold them.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
target="${CARGO_TARGET_DIR:-$root/target}/release"
fe="$target/fleetlink-fe"
tb="$target/fleetlink-tokio-baseline"
loadgen="$target/fleetlink-loadgen"
steps="1000 5000 10000"
handshakes=5000
rounds=5
plain=1
do_density=1
do_handshakes=1
summary_only=0
max_time=1800
port="${TLS_LISTEN_PORT:-18443}"
admin="${TLS_ADMIN_PORT:-19443}"
results="$here/results"

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-64}"; }
die() { echo "tls: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --handshakes) handshakes="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --no-plain) plain=0; shift ;;
    --no-density) do_density=0; shift ;;
    --no-handshakes) do_handshakes=0; shift ;;
    --max-time) max_time="$2"; shift 2 ;;
    --results) results="$2"; shift 2 ;;
    --summary-only) summary_only=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "tls: unknown argument $1" >&2; usage ;;
  esac
done
summary() {
python3 - "$results" <<'PY' | tee "$results/tls-summary.md"
import json, os, sys
d = sys.argv[1]
names = ["fleetlink-fe", "tokio-baseline-default", "tokio-baseline-rb4096"]
res = {k: json.load(open(os.path.join(d, f"tls-{k}.json"))) for k in names}
fe = res["fleetlink-fe"]
print("# TLS costs: fleetlink-fe vs the tokio baseline\n")
print(f"Measured {fe['date']} by `bench/tls.sh` (one run, all three brokers), kernel {fe['host']['kernel']}, "
      f"{fe['host']['nproc']} cores shared with other work, loopback, release builds. Certificates from "
      "`fleetlink-fe dev-certs` (ECDSA P-256); rustls 0.23 with ring on all sides, TLS 1.3 negotiated, "
      "key exchange X25519; no session resumption anywhere (fleetlink-fe has none; the baseline is "
      "configured the same; the loadgen disables it), so every handshake is a full one. The baseline "
      "accepts TLS with tokio-rustls 0.26 before the websocket upgrade.\n")
if fe["density"]["wss"]:
    steps = " / ".join(str(p["conns"]) for p in fe["density"]["wss"]["points"][1:])
    print(f"## User-space RSS per idle TLS connection\n")
    print(f"`bench/density.sh` with a wss URL: server-auth TLS (no `--client-ca`), incremental steps "
          f"{steps}, least-squares slope of VmRSS over (0, idle) and every step. The ws column is the "
          "same broker over plain ws in the same run; TLS overhead = wss slope - ws slope.\n")
    pts = [p["conns"] for p in fe["density"]["wss"]["points"]]
    print("| broker | **wss B/conn** | ws B/conn | TLS overhead B/conn | " + " | ".join(f"wss RSS @{c}" for c in pts) + " | wss ramp per step (ms) |")
    print("|---|---|---|---|" + "---|" * len(pts) + "---|")
    for k in names:
        dd = res[k]["density"]
        w, p = dd["wss"], dd["ws"]
        ws_slope = f"{p['slope_bytes_per_conn']['rss']:,}" if p else "-"
        ovh = dd["tls_overhead_bytes_per_conn"]
        ovh = f"{ovh:,}" if ovh is not None else "-"
        cells = " | ".join(f"{q['rss_kb']/1024:.1f} MiB" for q in w["points"])
        ramps = " / ".join(f"{q['ramp_ms']:,}" for q in w["points"][1:])
        print(f"| {k} | **{w['slope_bytes_per_conn']['rss']:,}** | {ws_slope} | {ovh} | {cells} | {ramps} |")
    base = fe["density"]["wss"]["slope_bytes_per_conn"]["rss"]
    print()
    for k in names[1:]:
        r = res[k]["density"]["wss"]["slope_bytes_per_conn"]["rss"] / max(base, 1)
        line = f"- {k} / fleetlink-fe over wss: **{r:.1f}x**"
        if res[k]["density"]["ws"] and fe["density"]["ws"]:
            rp = res[k]["density"]["ws"]["slope_bytes_per_conn"]["rss"] / max(fe["density"]["ws"]["slope_bytes_per_conn"]["rss"], 1)
            line += f" (over plain ws in the same run: {rp:.1f}x)"
        print(line)
    dev = max(abs(res[k]["density"][sch]["slope_bytes_per_conn"][f] - res[k]["density"][sch]["slope_bytes_per_conn"]["rss"])
              / max(res[k]["density"][sch]["slope_bytes_per_conn"]["rss"], 1)
              for k in names for sch in ("wss", "ws") if res[k]["density"][sch]
              for f in ("private_dirty", "anonymous"))
    print(f"\nPrivate_Dirty and Anonymous slopes are within {dev:.1%} of the RSS slopes (all in the JSON): "
          "the growth is private anonymous memory.\n")
hs = fe["handshakes"]
if hs["median"]:
    n = hs["rounds"][0]["rigs"]
    print(f"## Full TLS handshakes per core\n")
    print(f"{n:,} wss rigs opened as fast as the loadgen can, {len(hs['rounds'])} rounds interleaved across "
          "the brokers, medians. Broker on one core (fleetlink-fe `--cores 1 --accept-rate 100000 "
          "--accept-burst 100000`, baseline `--workers 1`) pinned to CPU 0; loadgen (one process, 256 "
          "handshakes in flight) pinned to CPU 1. Broker CPU = utime+stime of all its threads "
          "(/proc/PID/stat) from just before the loadgen starts to its ALL_WELCOMED line; a handshake "
          "is the whole connection setup (TCP accept, TLS, upgrade, hello/welcome).\n")
    print(f"| broker | **handshakes per CPU-second** | CPU us per handshake | broker CPU s per {n:,} (user + sys) | minor faults per conn | wall rate (rigs/s) | broker core busy | loadgen CPU s | handshake p50 | p99 | per round (handshakes/CPU-s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in names:
        m = res[k]["handshakes"]["median"]
        per = ", ".join(f"{r['handshakes_per_cpu_s']:,}" for r in res[k]["handshakes"]["rounds"])
        print(f"| {k} | **{m['handshakes_per_cpu_s']:,.0f}** | {1e6 / m['handshakes_per_cpu_s']:.0f} | "
              f"{m['broker_cpu_s']:.2f} ({m['broker_user_s']:.2f} + {m['broker_sys_s']:.2f}) | {m['broker_minor_faults_per_conn']:.0f} | {m['wall_rate_per_s']:,.0f} | {m['broker_core_utilisation']:.0%} | "
              f"{m['loadgen_cpu_s']:.2f} | {m['handshake_p50_us']/1000:.1f} ms | {m['handshake_p99_us']/1000:.1f} ms | {per} |")
    base = hs["median"]["handshakes_per_cpu_s"]
    print()
    for k in names[1:]:
        r = res[k]["handshakes"]["median"]["handshakes_per_cpu_s"] / max(base, 1)
        print(f"- {k} / fleetlink-fe, handshakes per CPU-second: **{r:.2f}x**")
    print("\nThe wall rate is the loadgen's, not the broker's: the client does more crypto per handshake "
          "than the server (it verifies the chain and the server's signature) and its CPU seconds are "
          "about its whole ramp time, while the broker's core is partly idle. Wall rates also swing with "
          "the other work on these 2 cores; handshakes per CPU-second is the number to compare. Loopback "
          "softirq work is charged to whichever process is running, for every broker alike.\n")
PY
echo "tls: wrote $results/tls-summary.md" >&2
}
if (( summary_only )); then summary; exit 0; fi

for b in "$fe" "$tb" "$loadgen"; do
  [[ -x "$b" ]] || die "$b not built: cd $root && cargo build --release -p fleetlink --bin fleetlink-fe && cargo build --release -p fleetlink-loadgen -p fleetlink-tokio-baseline"
done
command -v jq >/dev/null || die "jq is needed"
command -v taskset >/dev/null || die "taskset is needed"
(( $(nproc) >= 2 )) || die "needs 2 CPUs (broker on CPU 0, loadgen on CPU 1)"

work="$(mktemp -d /tmp/tls-bench.XXXXXX)"
pids=()        # brokers and loadgens started by the handshake rounds
density_pid="" # a running density.sh (it stops its own broker and loadgens)
watchdog=""

stop_pid() { # PID GRACE_TENTHS: SIGTERM, wait up to the grace, then SIGKILL (with its group)
  procs_stop "$2" "$1"
}

cleanup() {
  local rc=$?
  procs_cleanup_begin # signals from here on only hurry the stops below to SIGKILL
  trap - EXIT
  stop_pid "$watchdog" 10
  # density.sh's own trap stops its broker and loadgens; give it time to.
  stop_pid "$density_pid" 400
  for p in ${pids[@]+"${pids[@]}"}; do stop_pid "$p" 50; done
  procs_stop_all 50 # anything a signal caught before its pid was recorded above
  if (( rc != 0 )); then echo "tls: failed (rc=$rc); logs kept in $work" >&2; else rm -rf "$work"; fi
  exit "$rc"
}
trap cleanup EXIT
procs_traps
# The watchdog is stopped with the rest, and dies with this script however it ends (so its
# SIGTERM cannot reach a recycled pid), its sleep too.
# shellcheck disable=SC2016  # expanded by the watchdog's shell
procs_spawn bash -c '${3:+setpriv --pdeathsig KILL --} sleep "$1" || exit 0
  echo "tls: --max-time ${1}s reached; stopping" >&2; kill -TERM "$2"' \
  tls-watchdog "$max_time" "$$" "${PROCS_PDEATHSIG_OK#0}"
watchdog=$PROCS_PID

echo "tls: certificates in $work/pki" >&2
"$fe" dev-certs --out "$work/pki" --rigs 1 >/dev/null
pki="$work/pki"
tls_flags=(--tls-cert "$pki/broker.pem" --tls-key "$pki/broker.key")
lg_tls=(--ca "$pki/ca.pem" --server-name localhost)

names=(fleetlink-fe tokio-baseline-default tokio-baseline-rb4096)
# Broker command lines (without TLS flags; the listen/admin ports are added by the callers).
broker_cmd() { # NAME MODE(density|handshake)
  case "$1:$2" in
    # --drain 0s: density.sh stops its broker with SIGTERM and SIGKILLs it 5 s later.
    fleetlink-fe:density) echo "$fe --accept-rate 100000 --accept-burst 100000 --drain 0s" ;;
    fleetlink-fe:handshake) echo "$fe --accept-rate 100000 --accept-burst 100000 --cores 1" ;;
    tokio-baseline-default:density) echo "$tb" ;;
    tokio-baseline-default:handshake) echo "$tb --workers 1" ;;
    tokio-baseline-rb4096:density) echo "$tb --read-buffer 4096 --write-buffer 0" ;;
    tokio-baseline-rb4096:handshake) echo "$tb --workers 1 --read-buffer 4096 --write-buffer 0" ;;
  esac
}

# --- (a) density ---------------------------------------------------------------------------
density() { # NAME SCHEME OUT
  local name="$1" scheme="$2" out="$3" extra=() lg=()
  read -r -a cmd <<<"$(broker_cmd "$name" density)"
  if [[ "$scheme" == wss ]]; then
    extra=("${tls_flags[@]}")
    for a in "${lg_tls[@]}"; do lg+=(--loadgen-arg "$a"); done
  fi
  echo "tls: density $name over $scheme" >&2
  procs_spawn -s TERM -o "$work/density-$name-$scheme.out" -e "$work/density-$name-$scheme.err" \
    "$here/density.sh" --name "$name-$scheme" --steps "$steps" --out "$out" \
    --url "$scheme://127.0.0.1:$port/agent" --loadgen "$loadgen" ${lg[@]+"${lg[@]}"} -- \
    "${cmd[@]}" --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin" ${extra[@]+"${extra[@]}"}
  density_pid=$PROCS_PID
  wait "$density_pid" || { tail -20 "$work/density-$name-$scheme.err" >&2; die "density.sh failed for $name ($scheme)"; }
  density_pid=""
  grep '^SLOPE' "$work/density-$name-$scheme.out" >&2 || true
}

if (( do_density )); then
  for n in "${names[@]}"; do density "$n" wss "$work/density-$n-wss.json"; done
  if (( plain )); then
    for n in "${names[@]}"; do density "$n" ws "$work/density-$n-ws.json"; done
  fi
fi

# --- (b) handshakes per CPU-second ---------------------------------------------------------
hz=$(getconf CLK_TCK)
proc_stat() { # "utime stime minflt" of PID, all threads (fields 14, 15, 10 of /proc/PID/stat)
  local s
  s=$(<"/proc/$1/stat")
  s=${s##*) } # after the "(comm)" field: field 3 is f[0]
  read -r -a f <<<"$s"
  echo "${f[11]} ${f[12]} ${f[7]}"
}
cpu_ticks() { local u s _m; read -r u s _m <<<"$(proc_stat "$1")"; echo $((u + s)); }

hs_round() { # NAME ROUND: prints one JSON object
  local name="$1" round="$2" log="$work/hs-$1-$2"
  read -r -a cmd <<<"$(broker_cmd "$name" handshake)"
  procs_spawn -o "$log.broker" -e - taskset -c 0 "${cmd[@]}" --listen "127.0.0.1:$port" \
    --admin "127.0.0.1:$admin" "${tls_flags[@]}"
  local bpid=$PROCS_PID
  pids+=("$bpid")
  local deadline=$((SECONDS + 20))
  until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    kill -0 "$bpid" 2>/dev/null || { cat "$log.broker" >&2; die "$name exited before accepting"; }
    (( SECONDS < deadline )) || die "$name not accepting after 20 s"
    sleep 0.1
  done
  sleep 1 # let start-up work finish: only the ramp's CPU should be counted
  local c0 t0 c1 t1 lc
  : >"$log.out"
  local u0 s0 f0 u1 s1 f1
  read -r u0 s0 f0 <<<"$(proc_stat "$bpid")"; t0=$(date +%s%N)
  procs_spawn -o "$log.out" -e "$log.err" taskset -c 1 "$loadgen" rigs \
    --url "wss://127.0.0.1:$port/agent" "${lg_tls[@]}" \
    --rigs "$handshakes" --procs 1 --prefix "hs$round" --concurrency 256 \
    --hold 120s --max-time 180s --report "$log.json"
  local lpid=$PROCS_PID
  pids+=("$lpid")
  deadline=$((SECONDS + 150))
  until grep -q '^\(ALL_WELCOMED\|RAMP_INCOMPLETE\)' "$log.out"; do
    kill -0 "$lpid" 2>/dev/null || die "loadgen exited during the $name ramp; see $log.err"
    (( SECONDS < deadline )) || die "$name: no ramp outcome in 150 s; see $log.err"
    sleep 0.02
  done
  read -r u1 s1 f1 <<<"$(proc_stat "$bpid")"; t1=$(date +%s%N); lc=$(cpu_ticks "$lpid")
  c0=$((u0 + s0)); c1=$((u1 + s1))
  grep -q '^ALL_WELCOMED' "$log.out" || die "$name round $round: $(cat "$log.out"); see $log.err"
  stop_pid "$lpid" 300 # writes its report (after closing every rig with 1000)
  stop_pid "$bpid" 50 # no rigs left: fleetlink-fe's drain ends at once
  [[ -s "$log.json" ]] || die "$name round $round: no loadgen report"
  local ramp_ms
  ramp_ms=$(sed -n 's/^ALL_WELCOMED .*elapsed_ms=\([0-9]*\).*/\1/p' "$log.out")
  jq -c --argjson round "$round" --argjson n "$handshakes" --argjson hz "$hz" \
    --argjson ticks $((c1 - c0)) --argjson lticks "$lc" --argjson wall_ns $((t1 - t0)) \
    --argjson uticks $((u1 - u0)) --argjson sticks $((s1 - s0)) --argjson minflt $((f1 - f0)) \
    --argjson ramp_ms "$ramp_ms" '{
      round: $round, rigs: $n, welcomed: .welcomed,
      broker_cpu_s: ($ticks / $hz), broker_user_s: ($uticks / $hz), broker_sys_s: ($sticks / $hz),
      broker_minor_faults_per_conn: ($minflt / $n * 10 | round / 10), loadgen_cpu_s: ($lticks / $hz),
      wall_ms: ($wall_ns / 1e6 | round), loadgen_ramp_ms: $ramp_ms,
      handshakes_per_cpu_s: (if $ticks > 0 then $n / ($ticks / $hz) | round else null end),
      wall_rate_per_s: ($n / ($ramp_ms / 1000) | round),
      broker_core_utilisation: (($ticks / $hz) / ($wall_ns / 1e9) * 100 | round / 100),
      handshake_us: .handshake_us
    }' "$log.json"
}

if (( do_handshakes )); then
  for r in $(seq "$rounds"); do
    for n in "${names[@]}"; do
      echo "tls: handshakes $n round $r/$rounds" >&2
      hs_round "$n" "$r" >>"$work/hs-$n.jsonl"
      jq -r '"tls:   \(.handshakes_per_cpu_s) handshakes per CPU-second (\(.broker_cpu_s) s), \(.wall_rate_per_s)/s wall, p50 \(.handshake_us.p50) us p99 \(.handshake_us.p99) us"' \
        <(tail -1 "$work/hs-$n.jsonl") >&2
    done
  done
fi

# --- results ---------------------------------------------------------------------------------
mkdir -p "$results"
date_utc=$(date -u +%FT%TZ)
slurp() { if [[ -s "$1" ]]; then cat "$1"; else echo null; fi; }
for n in "${names[@]}"; do
  rounds_json=$( [[ -s "$work/hs-$n.jsonl" ]] && jq -s -c . "$work/hs-$n.jsonl" || echo '[]')
  jq -n --arg broker "$n" --arg date "$date_utc" --arg kernel "$(uname -r)" --argjson nproc "$(nproc)" \
    --arg density_cmd "$(broker_cmd "$n" density)" --arg handshake_cmd "$(broker_cmd "$n" handshake)" \
    --argjson tls "$(slurp "$work/density-$n-wss.json")" --argjson plain "$(slurp "$work/density-$n-ws.json")" \
    --argjson rounds "$rounds_json" '
    def median: sort | if length == 0 then null elif length % 2 == 1 then .[length / 2 | floor]
                       else (.[length / 2 - 1] + .[length / 2]) / 2 end;
    {
      broker: $broker, date: $date, host: {kernel: $kernel, nproc: $nproc},
      tls: "server cert from fleetlink-fe dev-certs (ECDSA P-256), rustls 0.23 ring, TLS 1.3 negotiated, no resumption, no client certs",
      density: {
        command: ($density_cmd + " --tls-cert broker.pem --tls-key broker.key"),
        wss: $tls, ws: $plain,
        tls_overhead_bytes_per_conn: (if $tls != null and $plain != null
          then $tls.slope_bytes_per_conn.rss - $plain.slope_bytes_per_conn.rss else null end)
      },
      handshakes: {
        command: ($handshake_cmd + " --tls-cert broker.pem --tls-key broker.key"),
        pinning: "broker taskset -c 0, loadgen taskset -c 1 (one process, 256 in flight)",
        rounds: $rounds,
        median: (if ($rounds | length) == 0 then null else {
          handshakes_per_cpu_s: ([$rounds[].handshakes_per_cpu_s] | median),
          broker_cpu_s: ([$rounds[].broker_cpu_s] | median),
          broker_user_s: ([$rounds[].broker_user_s] | median),
          broker_sys_s: ([$rounds[].broker_sys_s] | median),
          broker_minor_faults_per_conn: ([$rounds[].broker_minor_faults_per_conn] | median),
          wall_rate_per_s: ([$rounds[].wall_rate_per_s] | median),
          loadgen_ramp_ms: ([$rounds[].loadgen_ramp_ms] | median),
          broker_core_utilisation: ([$rounds[].broker_core_utilisation] | median),
          loadgen_cpu_s: ([$rounds[].loadgen_cpu_s] | median),
          handshake_p50_us: ([$rounds[].handshake_us.p50] | median),
          handshake_p99_us: ([$rounds[].handshake_us.p99] | median)
        } end)
      }
    }' >"$results/tls-$n.json"
  echo "tls: wrote $results/tls-$n.json" >&2
done

summary
