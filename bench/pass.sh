#!/usr/bin/env bash
# bench/pass.sh — every scenario once, back to back, at one commit: the run the summary of
# docs/benchmarks.md is read from. Each scenario alternates fleetlink-fe and the baselines
# itself; this only runs them in a row so that every figure comes from the same build and
# the same hour.
#
#   bench/pass.sh [--name NAME] [--rounds 3] [--no-build]
#
# Writes bench/results/pass-NAME/, its files suffixed passNAME: latency, accept-storm,
# idle-cost, throughput and fanout-cpu JSON and markdown, density/ and tls/, the plots, and
# pass-log.txt (commit, kernel, when each scenario started). About 30 minutes on the 2-CPU
# machine of docs/benchmarks.md. Needs what the scenarios need: jq, redis-server, loopback
# 127.0.0.1-16. Run it on a quiet machine; it does not check for other load.
#
# Ports: the shell scenarios read their own variables (LATENCY_*_PORT, DENSITY_*_PORT,
# FANOUT_*_PORT, TLS_*_PORT; bench/README.md lists them), and the fleetlink-bench ones get
# BENCH_LISTEN_PORT/BENCH_ADMIN_PORT (25080/25090) as --listen-port/--admin-port. On a host
# whose ip_local_port_range starts below them, set them all below it.
#
# On HUP, INT, TERM or PIPE (or if this script is SIGKILLed) the running scenario gets a SIGTERM,
# stops what it started, and only then does this script exit.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$root/bench/lib/procs.sh"
name="$(date -u +%m%d)"
rounds=3
build=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "pass.sh: unknown argument $1 (see --help)" >&2; exit 64 ;;
  esac
done
cd "$root"
if [[ $build == 1 ]]; then
  cargo build --release -q -p fleetlink -p fleetlink-bench -p fleetlink-loadgen \
    -p fleetlink-tokio-baseline
fi
export BENCH_NO_BUILD=1
# Each scenario runs in the background, waited for, so that a signal here is acted on at once and
# passed on to it by the cleanup (its own cleanup takes up to a minute or so: give it two).
step_pid=""
cleanup() {
  local rc=$?
  procs_cleanup_begin
  trap - EXIT
  procs_stop 1200 "$step_pid"
  procs_stop_all 50
  exit "$rc"
}
trap cleanup EXIT
procs_traps
run() {
  procs_spawn -s TERM "$@"
  step_pid=$PROCS_PID
  wait "$step_pid"
  step_pid=""
}
bench_ports=(--listen-port "${BENCH_LISTEN_PORT:-25080}" --admin-port "${BENCH_ADMIN_PORT:-25090}")
out="bench/results/pass-$name"
sfx="pass$name"
mkdir -p "$out"
log="$out/pass-log.txt"
stamp() { echo "$1 $(date -u +%FT%TZ)" | tee -a "$log"; }
echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src lua bench ':(exclude)bench/results' Cargo.toml Cargo.lock || echo ' (dirty)') kernel $(uname -r)" | tee "$log"
redis_brokers="fleetlink-fe-redis fleetlink-fe-redis-nopersist tokio-baseline-redis-rb4096 tokio-baseline-redis-store-rb4096"

stamp "latency start"
run bench/latency.sh --no-build --rounds "$rounds" --name "$sfx" --results "$out"
stamp "density start"
run bench/compare-density.sh --rounds "$rounds" --out "$out/density"
stamp "accept-storm start"
run bench/run accept-storm --rounds "$rounds" --out "$out" --name "$sfx" "${bench_ports[@]}"
stamp "idle-cost start"
# Spread timers: fleetlink-fe reads each PONG at its deadline, so with every rig's PING at the
# same moment its last round of PONG reads would fall after the window (bench/SCENARIOS.md).
run bench/run idle-cost --rounds "$rounds" --waves 10 --out "$out" --name "$sfx" "${bench_ports[@]}"
stamp "throughput start"
run bench/run throughput --rounds "$rounds" --out "$out" --name "$sfx" "${bench_ports[@]}"
stamp "fanout-cpu start"
run bench/fanout-cpu.sh --rounds "$rounds" --name "$sfx" --brokers "$redis_brokers"
mv "bench/results/fanout-cpu-$sfx.json" "$out/"
stamp "tls start"
run bench/tls.sh --rounds "$rounds" --results "$out/tls"
stamp "plots start"
for f in "$out"/density/density-*.json; do
  b="$(basename "$f" .json)"
  [[ $b == density-rounds ]] || cp "$f" "$out/$b-$sfx.json"
done
run "${CARGO_TARGET_DIR:-target}/release/fleetlink-bench" plots --out "$out" --name "$sfx"
stamp "end"
