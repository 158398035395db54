#!/usr/bin/env bash
# compare-density.sh — memory per idle connection of fleetlink-fe and the tokio baseline, side
# by side in one invocation, the brokers alternating.
#
#   bench/compare-density.sh [--rounds 3] [--steps "1000 5000 10000 19000"]
#                            [--brokers "fleetlink-fe tokio-baseline-default tokio-baseline-rb4096"]
#                            [--out DIR] [--name SFX] [STEPS]
#
# --brokers takes the names space-separated, in one argument. Brokers: fleetlink-fe
# (standalone), tokio-baseline-default (tungstenite's default buffers) and
# tokio-baseline-rb4096 (a 4 KiB read buffer, no write buffer). Each round measures every broker
# once with bench/density.sh (incremental steps, least-squares slope); the order rotates by one
# broker each round, so none always runs first on a fresh machine. A broker's figure is the
# median of its rounds' slopes; its density-<broker>.json (what `bench/run plots` draws) is the
# round closest to that median, and density-rounds.json keeps every round.
#
# Output, all under --out (bench/results by default): density-summary.md (also on stdout),
# density-<broker>.json and density-rounds.json (with --name, each named -SFX before its
# extension), then density-<broker>.svg ... drawn by `fleetlink-bench plots` from this run's
# files when that binary is built (bench/run builds it). BENCH_NO_BUILD=1 skips the cargo build; the binaries are
# then taken from ${CARGO_TARGET_DIR:-target}/release. A round of the three brokers at the
# default steps takes about half a minute.
#
# Ports: DENSITY_LISTEN_PORT (default 18080) and DENSITY_ADMIN_PORT (19090), on 127.0.0.1. On a
# host whose ip_local_port_range starts below them (docs/tuning.md recommends 10000-65535 for
# load generators), the loadgen's own sockets may hold them: set both below the range.
# fleetlink-fe runs with --drain 0s, so that density.sh's SIGTERM ends it at once rather than
# SIGKILLing it five seconds into the default 10 s drain. On HUP, INT, TERM or PIPE (or if this
# script is SIGKILLed) the running density.sh gets a SIGTERM and stops its broker and loadgens
# before this script exits.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
root="$(cd "$here/.." && pwd)"
rounds=3
steps="1000 5000 10000 19000"
brokers="fleetlink-fe tokio-baseline-default tokio-baseline-rb4096"
out="$here/results"
run_name=""
usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-64}"; }
die() { echo "compare-density: $*" >&2; exit 1; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --brokers) brokers="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --name) run_name="$2"; shift 2 ;;
    -h|--help) usage 0 ;;
    -*) echo "compare-density: unknown flag $1" >&2; usage ;;
    *) steps="$1"; shift ;;
  esac
done
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive integer"
read -r -a names <<<"$brokers"
(( ${#names[@]} > 0 )) || die "--brokers is empty"
target="${CARGO_TARGET_DIR:-$root/target}/release"
if [[ -z "${BENCH_NO_BUILD:-}" ]]; then
  (cd "$root" && cargo build --release -q --bin fleetlink-fe -p fleetlink -p fleetlink-loadgen \
    -p fleetlink-tokio-baseline)
fi
port="${DENSITY_LISTEN_PORT:-18080}"
admin="${DENSITY_ADMIN_PORT:-19090}"
[[ "$port" =~ ^[1-9][0-9]*$ && "$admin" =~ ^[1-9][0-9]*$ ]] || die "DENSITY_LISTEN_PORT and DENSITY_ADMIN_PORT must be port numbers"
broker_cmd() {
  case "$1" in
    fleetlink-fe) echo "$target/fleetlink-fe" --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin" \
      --accept-rate 100000 --accept-burst 100000 --drain 0s ;;
    tokio-baseline-default) echo "$target/fleetlink-tokio-baseline" --listen "127.0.0.1:$port" \
      --admin "127.0.0.1:$admin" ;;
    tokio-baseline-rb4096) echo "$target/fleetlink-tokio-baseline" --listen "127.0.0.1:$port" \
      --admin "127.0.0.1:$admin" --read-buffer 4096 --write-buffer 0 ;;
    *) return 1 ;;
  esac
}
for n in "${names[@]}"; do broker_cmd "$n" >/dev/null || die "unknown broker $n"; done
mkdir -p "$out"
work="$(mktemp -d /tmp/compare-density.XXXXXX)"
density_pid=""
cleanup() {
  local rc=$?
  procs_cleanup_begin
  trap - EXIT
  # density.sh stops its own broker and loadgens on SIGTERM (5 s + 30 s at most); give it time to.
  procs_stop 600 "$density_pid"
  procs_stop_all 50
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
procs_traps

count=${#names[@]}
for ((r = 1; r <= rounds; r++)); do
  for ((i = 0; i < count; i++)); do
    name="${names[$(((i + r - 1) % count))]}"
    echo "compare-density: round $r/$rounds: $name" >&2
    # In the background and waited for, so that a signal here is acted on at once (and passed
    # on by the cleanup), not when density.sh ends.
    # shellcheck disable=SC2046  # broker_cmd's words are the command line
    procs_spawn -s TERM -o /dev/null "$here/density.sh" --name "$name" --steps "$steps" \
      --url "ws://127.0.0.1:$port/agent" --loadgen "$target/fleetlink-loadgen" \
      --out "$work/$name-r$r.json" -- $(broker_cmd "$name")
    density_pid=$PROCS_PID
    wait "$density_pid"
    density_pid=""
  done
done

sfx="${run_name:+-$run_name}"
python3 - "$work" "$out" "$rounds" "$steps" "$sfx" "${names[@]}" <<'PY' | tee "$out/density-summary$sfx.md"
import json, os, shutil, statistics, sys
work, out, rounds, steps, sfx, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:]
runs = {n: [json.load(open(os.path.join(work, f"{n}-r{r}.json"))) for r in range(1, rounds + 1)] for n in names}
slope = lambda j: j["slope_bytes_per_conn"]["rss"]
med = {n: statistics.median(slope(j) for j in runs[n]) for n in names}
# The round a broker's plot and kernel figures come from: the one closest to its median.
pick = {n: min(range(rounds), key=lambda r: abs(slope(runs[n][r]) - med[n])) for n in names}
for n in names:
    shutil.copy(os.path.join(work, f"{n}-r{pick[n] + 1}.json"), os.path.join(out, f"density-{n}{sfx}.json"))
json.dump({"rounds": rounds, "steps": [int(s) for s in steps.split()], "order": "rotating by one broker per round",
           "median_rss_slope": med, "runs": runs}, open(os.path.join(out, f"density-rounds{sfx}.json"), "w"), indent=1)
first = runs[names[0]][0]
print(f"Measured {first['date']}, kernel {first['host']['kernel']}, steps {steps} (incremental), "
      f"{rounds} round(s), brokers alternating (order rotated each round); figures are medians over rounds.\n")
pts = runs[names[0]][pick[names[0]]]["points"]
print("| broker | RSS slope (B/conn), median | per round | anon slope (B/conn) | "
      + " | ".join(f"RSS @{p['conns']}" for p in pts) + " |")
print("|---|---|---|---|" + "---|" * len(pts))
for n in names:
    j = runs[n][pick[n]]
    per = ", ".join(f"{slope(x):,}" for x in runs[n])
    cells = " | ".join(f"{p['rss_kb'] / 1024:.1f} MiB" for p in j["points"])
    print(f"| {n} | {med[n]:,.0f} | {per} | {j['slope_bytes_per_conn']['anonymous']:,} | {cells} |")
print("\nKernel floor (machine-wide slab growth per connection: " + ", ".join(first["kernel"]["slab_caches"])
      + "; both loopback ends, so about half is the broker's socket; from each broker's median round):\n")
print("| broker | slab per connection, both ends (B) | per socket (B) | TCP mem pages at the last step |")
print("|---|---|---|---|")
for n in names:
    j = runs[n][pick[n]]
    k = j["kernel"]
    b = k["slab_bytes_per_conn_both_ends"]
    print(f"| {n} | {b:,.0f} | {k['slab_bytes_per_socket']:,} | {j['points'][-1]['tcp_mem_pages']} |"
          if b is not None else f"| {n} | unreadable | | |")
ref = names[0]
for n in names[1:]:
    print(f"\n{n} / {ref} = {med[n] / max(med[ref], 1):.1f}x")
PY
if [[ -x "$target/fleetlink-bench" ]]; then
  "$target/fleetlink-bench" plots --out "$out" ${run_name:+--name "$run_name"} >&2 ||
    echo "compare-density: the plots failed; the figures above stand" >&2
else
  echo "compare-density: no $target/fleetlink-bench: no plots (bench/run plots draws them)" >&2
fi
