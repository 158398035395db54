#!/usr/bin/env bash
# bench/faults.sh — full-size fault injection (5,000 rigs by default), on demand:
#
#   bench/faults.sh [--rigs 5000] [--only redis,kill,vanish,drain,storm] [--out FILE]
#                   [--wait-busy SECONDS]
#
# Builds the release binaries (workspace target dir), then runs tests/faults/faults.py, which
# prints `FAULT <scenario> <figure>=<value>` lines, `CHECK PASS|FAIL` lines and one `FAULT_JSON`
# line per scenario, and writes all figures to bench/results/faults-full.json. The quick
# versions of the same faults run in the test suite: `cargo test --test faults_quick`.
# Needs redis-server, python3, curl; the `vanish` scenario needs root for `ip netns` (it
# fails otherwise, unless FLEETLINK_SKIP_NETNS=1 skips it). Env knobs: FAULTS_REDIS_OUTAGE_S
# (30), FAULTS_AGENTS (20), FAULTS_RATE (400 commands/s), FAULTS_FLOW_S (8), FAULTS_DRAIN_S
# (10), FAULTS_STORM_RATE (50), FAULTS_STORM_BURST (100). Set FAULTS_NO_BUILD=1 to skip the
# build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$root/bench/lib/procs.sh"
# Help first: it must not build, nor start the run.
for arg in "$@"; do
  if [[ $arg == -h || $arg == --help ]]; then
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0
  fi
done
if [[ -z "${FAULTS_NO_BUILD:-}" ]]; then
  (cd "$root" && cargo build --release -q -p fleetlink -p fleetlink-loadgen \
    --bin fleetlink-fe --bin fleetlink-agent --bin fleetlink-loadgen)
fi
# faults.py stops what it started on SIGTERM or SIGINT, but not on SIGHUP nor when it is killed,
# and fleetlink-fe and redis-server ignore SIGHUP: so it runs in the background, in its own
# process group, with SIGTERM as its parent-death signal, and this script passes HUP, INT, TERM
# and PIPE on to it as a SIGTERM (its cleanup) and waits for it.
py=""
cleanup() {
  local rc=$?
  procs_cleanup_begin
  trap - EXIT
  procs_stop 600 "$py"
  procs_stop_all 50
  exit "$rc"
}
trap cleanup EXIT
procs_traps
procs_spawn -s TERM python3 "$root/tests/faults/faults.py" "$@"
py=$PROCS_PID
wait "$py"
