#!/usr/bin/env bash
# offline-hold.sh — how long a broker takes to hold a fan-out for rigs that are all away
# (`queue_if_offline`, docs/protocol.md): N commands for N distinct offline rigs, written as one
# pipeline of PUBLISHes on one socket, timed until `fleetlink_registry_ops_total{op="offline",
# result="held"}` reads N (polled every 20 ms).
#
#   bench/offline-hold.sh [--count 10000] [--rounds 3] [--fe PATH]...
#
# Each --fe is a fleetlink-fe binary (default: the workspace's target/release/fleetlink-fe);
# give two to compare builds, which then alternate round by round. Every round starts its own
# redis-server on a free port and a broker (`--cores 1`) on free ports, and stops both, also on
# failure or signal. Prints one line per round and build. Needs redis-server, python3, curl.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
count=10000 rounds=3 fes=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --count) count="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --fe) fes+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 64 ;;
  esac
done
(( ${#fes[@]} > 0 )) || fes=("${CARGO_TARGET_DIR:-$here/../target}/release/fleetlink-fe")
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
work="$(mktemp -d /tmp/offline-hold.XXXXXX)"
pids=()
stop_round() { procs_stop 150 ${pids[@]+"${pids[@]}"}; pids=(); }
cleanup() {
  procs_cleanup_begin # signals from here on only hurry the stops below to SIGKILL
  trap - EXIT
  stop_round
  procs_stop_all 50 # anything a signal caught before its pid was recorded above
  rm -rf "$work"
}
trap cleanup EXIT
procs_traps

# One round; sets `held` to the python's line. It runs in this shell (a round in a $(...)
# subshell kept its pids from the trap above: a signal left its Redis and broker running), and
# the python in the background, waited for, so that a signal is acted on at once.
one() {
  local fe="$1" rport lport aport
  rport=$(free_port) lport=$(free_port) aport=$(free_port)
  procs_spawn -o /dev/null -e - redis-server --port "$rport" --bind 127.0.0.1 --save "" \
    --appendonly no
  pids+=("$PROCS_PID")
  for _ in $(seq 100); do [[ "$(redis-cli -p "$rport" ping 2>/dev/null)" == PONG ]] && break; sleep 0.05; done
  procs_spawn -o /dev/null -e - "$fe" --redis "redis://127.0.0.1:$rport/" --broker-id fe-a \
    --listen "127.0.0.1:$lport" --admin "127.0.0.1:$aport" --cores 1
  pids+=("$PROCS_PID")
  for _ in $(seq 200); do curl -sf -o /dev/null "http://127.0.0.1:$aport/readyz" && break; sleep 0.05; done
  procs_spawn -o "$work/held" python3 -c "$hold_py" "$rport" "$aport" "$count"
  pids+=("$PROCS_PID")
  wait "$PROCS_PID" || true
  held=$(<"$work/held")
  stop_round
}

hold_py=$(cat <<'PY'
import json, socket, sys, time, urllib.request
rport, aport, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def resp(*parts):
    return f"*{len(parts)}\r\n" + "".join(f"${len(p.encode())}\r\n{p}\r\n" for p in parts)
wire = "".join(resp("PUBLISH", "fleetlink:broker:fe-a", json.dumps(
    {"type": "command", "id": f"h{i}", "rig_id": f"away-{i:05d}", "name": "fw", "args": {},
     "reply_to": "fleetlink:bench:replies", "queue_if_offline": True, "ttl_ms": 60000}))
    for i in range(n)).encode()
def held():
    body = urllib.request.urlopen(f"http://127.0.0.1:{aport}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith('fleetlink_registry_ops_total{op="offline",result="held"}'):
            return int(float(line.split()[-1]))
    return 0
s = socket.create_connection(("127.0.0.1", rport))
t0 = time.monotonic()
s.sendall(wire)
while (h := held()) < n and time.monotonic() - t0 < 120:
    time.sleep(0.02)
print(f"held {h} of {n} in {time.monotonic() - t0:.3f} s")
PY
)

for ((r = 1; r <= rounds; r++)); do
  for fe in "${fes[@]}"; do
    one "$fe"
    echo "round $r $fe: $held"
  done
done
