#!/usr/bin/env bash
# Density side by side, in one run: fleetlink-fe, then the tokio baseline with tungstenite's
# default buffers, then the baseline with a 4 KiB read buffer (and no write buffer).
#
#   bench/compare-density.sh [STEPS]      # default "1000 5000 10000 19000"
#
# Each broker is measured by bench/density.sh (incremental steps, least-squares slope) and the
# summary goes to bench/results/density-summary.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
steps="${1:-1000 5000 10000 19000}"
target="${CARGO_TARGET_DIR:-$root/target}/release"
(cd "$root" && cargo build --release --bin fleetlink-fe -p fleetlink -p fleetlink-loadgen -p fleetlink-tokio-baseline >/dev/null)
port=18080
admin=19090
run() {
  local name="$1"; shift
  "$here/density.sh" --name "$name" --steps "$steps" --url "ws://127.0.0.1:$port/agent" --loadgen "$target/fleetlink-loadgen" -- "$@"
}
run fleetlink-fe "$target/fleetlink-fe" --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin" \
  --accept-rate 100000 --accept-burst 100000
run tokio-baseline-default "$target/fleetlink-tokio-baseline" --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin"
run tokio-baseline-rb4096 "$target/fleetlink-tokio-baseline" --listen "127.0.0.1:$port" --admin "127.0.0.1:$admin" \
  --read-buffer 4096 --write-buffer 0
python3 - "$here/results" "$steps" <<'PY' | tee "$here/results/density-summary.md"
import json, sys, os
d, steps = sys.argv[1], sys.argv[2]
names = ["fleetlink-fe", "tokio-baseline-default", "tokio-baseline-rb4096"]
res = {n: json.load(open(os.path.join(d, f"density-{n}.json"))) for n in names}
print(f"Measured {res['fleetlink-fe']['date']}, kernel {res['fleetlink-fe']['host']['kernel']}, steps {steps} (incremental)\n")
print("| broker | RSS slope (B/conn) | anon slope (B/conn) | " + " | ".join(f"RSS @{p['conns']}" for p in res['fleetlink-fe']['points']) + " |")
print("|---|---|---|" + "---|" * len(res['fleetlink-fe']['points']))
for n in names:
    r = res[n]
    cells = " | ".join(f"{p['rss_kb']/1024:.1f} MiB" for p in r["points"])
    print(f"| {n} | {r['slope_bytes_per_conn']['rss']:,} | {r['slope_bytes_per_conn']['anonymous']:,} | {cells} |")
print("\nKernel floor (machine-wide slab growth per connection: " + ", ".join(res["fleetlink-fe"]["kernel"]["slab_caches"]) + "; both loopback ends, so about half is the broker's socket):\n")
print("| broker | slab per connection, both ends (B) | per socket (B) | TCP mem pages at the last step |")
print("|---|---|---|---|")
for n in names:
    k = res[n]["kernel"]
    b = k["slab_bytes_per_conn_both_ends"]
    print(f"| {n} | {b:,.0f} | {k['slab_bytes_per_socket']:,} | {res[n]['points'][-1]['tcp_mem_pages']} |" if b is not None else f"| {n} | unreadable | | |")
fe = res["fleetlink-fe"]["slope_bytes_per_conn"]["rss"]
for n in names[1:]:
    print(f"\n{n} / fleetlink-fe = {res[n]['slope_bytes_per_conn']['rss'] / max(fe, 1):.1f}x")
PY
