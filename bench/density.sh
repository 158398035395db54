#!/usr/bin/env bash
# density.sh — user-space memory per idle websocket connection of a broker.
#
#   bench/density.sh [--name NAME] [--steps "1000 5000 10000"] [--url ws://127.0.0.1:18080/agent]
#                    [--out FILE] [--loadgen PATH] [--loadgen-arg ARG]... -- BROKER_CMD [ARGS...]
#
# --url may be wss://HOST:PORT/PATH for a TLS broker; pass the loadgen's TLS flags with
# --loadgen-arg (once per word), e.g. --loadgen-arg --ca --loadgen-arg ca.pem.
#
# Starts BROKER_CMD (it must listen on --url's port; pass the binary itself, not a wrapper such
# as `cargo run`, since the RSS of that PID is what is measured). Give fleetlink-fe `--drain 0s`:
# on exit this script sends SIGTERM and SIGKILLs what still runs 5 s later, which would be
# mid-way through the default 10 s drain. It waits until the broker accepts TCP,
# records its idle RSS, then for each N in --steps adds rigs with `fleetlink-loadgen rigs` until
# N are connected, waits for ALL_WELCOMED and for RSS to settle (two reads 1 s apart within 1 %),
# and records VmRSS plus smaps_rollup Private_Dirty and Anonymous.
#
# Method: INCREMENTAL. Connections stay open between steps: step k starts one more loadgen for
# rigs [N(k-1), N(k)) with distinct rig ids, so every point is the same broker process holding
# exactly N connections. This avoids re-ramping (and allocator warm-up noise) per step; the
# least-squares slope over (0, idle), (N1, rss1), … is the bytes per connection.
#
# Limits: the broker holds one fd per rig and the platform caps a process at 20,000 fds, so the
# largest step may be at most 19,000.
#
# Ports: --url's, by default DENSITY_URL, else ws://127.0.0.1:DENSITY_LISTEN_PORT/agent with
# DENSITY_LISTEN_PORT 18080. On a host whose ip_local_port_range starts below it
# (docs/tuning.md recommends 10000-65535 for load generators), the loadgen's own sockets may
# hold that port: use one below the range, for the broker's --admin too.
#
# Output: a table on stdout and bench/results/density-<NAME>.json (or --out). Everything this
# script starts is stopped on exit, failure or signal (HUP, INT, TERM, PIPE; another one during
# that cleanup skips to SIGKILL), with its process group, so whatever the broker command forks
# goes too; if this script is SIGKILLed, they are SIGKILLed too (bench/lib/procs.sh).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=lib/procs.sh
. "$here/lib/procs.sh"
name=""
steps="${DENSITY_STEPS:-1000 5000 10000}"
url="${DENSITY_URL:-ws://127.0.0.1:${DENSITY_LISTEN_PORT:-18080}/agent}"
out=""
loadgen="${LOADGEN:-${CARGO_TARGET_DIR:-$here/../target}/release/fleetlink-loadgen}"
lg_extra=()
ready_timeout="${DENSITY_READY_TIMEOUT:-20}"    # s, broker start to accepting
stable_timeout="${DENSITY_STABLE_TIMEOUT:-60}"  # s, per step, for RSS to settle
concurrency="${DENSITY_CONCURRENCY:-256}"

usage() { awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit "${1:-64}"; }
die() { echo "density: $*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --url) url="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --loadgen) loadgen="$2"; shift 2 ;;
    --loadgen-arg) lg_extra+=("$2"); shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || usage
[[ -x "$loadgen" ]] || die "loadgen not found at $loadgen (build it: cargo build --release -p fleetlink-loadgen, or pass --loadgen)"
[[ "$url" =~ ^wss?://([^:/]+):([0-9]+)(/.*)?$ ]] || die "--url must be ws://HOST:PORT/PATH or wss://…"
host="${BASH_REMATCH[1]}"; port="${BASH_REMATCH[2]}"
name="${name:-$(basename "$1")}"
out="${out:-$here/results/density-$name.json}"

prev=0
for n in $steps; do
  [[ "$n" =~ ^[0-9]+$ ]] || die "step $n is not a number"
  (( n > prev )) || die "steps must be strictly increasing"
  prev=$n
done
(( prev <= 19000 )) || die "largest step $prev exceeds 19000 (20,000 fds per broker process)"

work="$(mktemp -d /tmp/density.XXXXXX)"
broker_pid=""
lg_pids=()

cleanup() {
  local rc=$?
  procs_cleanup_begin # signals from here on only hurry the stops below to SIGKILL
  trap - EXIT
  # Broker first: the rigs then see closes and their loadgens exit quickly.
  procs_stop 50 "$broker_pid"
  procs_stop 300 ${lg_pids[@]+"${lg_pids[@]}"}
  procs_stop_all 50 # anything a signal caught before its pid was recorded above
  if (( rc != 0 )); then echo "density: failed (rc=$rc); logs kept in $work" >&2; else rm -rf "$work"; fi
  exit "$rc"
}
trap cleanup EXIT
procs_traps

# kB values of the broker: VmRSS, Private_Dirty, Anonymous (smaps_rollup covers all mappings).
mem_kb() {
  local rss pd anon
  rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$broker_pid/status")
  pd=$(awk '/^Private_Dirty:/ {print $2}' "/proc/$broker_pid/smaps_rollup")
  anon=$(awk '/^Anonymous:/ {print $2}' "/proc/$broker_pid/smaps_rollup")
  echo "$rss ${pd:-0} ${anon:-0}"
}

# The kernel's side of the same connections, machine-wide: bytes in the slab caches a socket
# uses (active objects x object size, /proc/slabinfo, root only; -1 when unreadable) and TCP
# buffer pages (/proc/net/sockstat "mem", which stays near 0 while sockets are idle). On
# loopback both ends are on this host: per broker connection the slab holds two sockets.
SLABS="TCP sock_inode_cache filp dentry eventpoll_epi io_kiocb"
kernel_mem() {
  local slab=-1 pages
  if [[ -r /proc/slabinfo ]]; then
    slab=$(awk -v want=" $SLABS " 'index(want, " " $1 " ") {s += $2 * $4} END {print s + 0}' /proc/slabinfo)
  fi
  pages=$(awk '/^TCP:/ {for (i = 1; i < NF; i++) if ($i == "mem") print $(i + 1)}' /proc/net/sockstat)
  echo "$slab ${pages:-0}"
}

# The same slab caches one by one, as a JSON object of bytes (empty when unreadable).
slab_by_cache() {
  [[ -r /proc/slabinfo ]] || { echo '{}'; return; }
  awk -v want=" $SLABS " 'index(want, " " $1 " ") {s[$1] += $2 * $4}
    END {printf "{"; sep = ""; for (c in s) {printf "%s\"%s\":%d", sep, c, s[c]; sep = ","}; print "}"}' /proc/slabinfo
}

# Waits for RSS to settle: two reads 1 s apart within 1 %. Sets settled="rss pd anon stable".
# It runs in this shell, not in a <(...) subshell, which would outlive an interrupted run.
settle() {
  local deadline=$((SECONDS + stable_timeout)) a b
  a=$(mem_kb)
  while :; do
    sleep 1
    kill -0 "$broker_pid" 2>/dev/null || die "broker exited (log: $work/broker.log)"
    b=$(mem_kb)
    local ra=${a%% *} rb=${b%% *}
    if (( (ra > rb ? ra - rb : rb - ra) * 100 <= rb )); then settled="$b true"; return; fi
    if (( SECONDS >= deadline )); then
      echo "density: RSS did not settle within ${stable_timeout}s; using last read" >&2
      settled="$b false"; return
    fi
    a=$b
  done
}

echo "density: starting broker: $*" >&2
procs_spawn -o "$work/broker.log" -e - "$@"
broker_pid=$PROCS_PID

deadline=$((SECONDS + ready_timeout))
until (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; do
  kill -0 "$broker_pid" 2>/dev/null || { cat "$work/broker.log" >&2; die "broker exited before accepting"; }
  (( SECONDS < deadline )) || die "broker not accepting on $host:$port after ${ready_timeout}s"
  sleep 0.1
done

settle
read -r idle_rss idle_pd idle_anon idle_stable <<<"$settled"
read -r idle_slab idle_pages <<<"$(kernel_mem)"
idle_caches=$(slab_by_cache)
echo "density: broker pid $broker_pid idle RSS ${idle_rss} kB" >&2

rows=()
prev=0
for n in $steps; do
  add=$((n - prev))
  log="$work/lg-$n"
  : >"$log.out" # before the loop below greps it
  procs_spawn -o "$log.out" -e "$log.err" "$loadgen" rigs --url "$url" --rigs "$add" \
    --start-index "$prev" --prefix density --concurrency "$concurrency" --hold 3600s \
    --max-time 3600s --report "$log.json" ${lg_extra[@]+"${lg_extra[@]}"}
  lg=$PROCS_PID
  lg_pids+=("$lg")
  deadline=$((SECONDS + 120 + add / 100))
  until grep -q '^ALL_WELCOMED' "$log.out"; do
    if grep -q '^RAMP_INCOMPLETE' "$log.out"; then die "step $n: $(cat "$log.out"); see $log.err"; fi
    kill -0 "$lg" 2>/dev/null || die "step $n: loadgen exited; see $log.err"
    kill -0 "$broker_pid" 2>/dev/null || die "broker exited (log: $work/broker.log)"
    (( SECONDS < deadline )) || die "step $n: no ALL_WELCOMED in time; see $log.err"
    sleep 0.1
  done
  ramp_ms=$(sed -n 's/^ALL_WELCOMED .*elapsed_ms=\([0-9]*\).*/\1/p' "$log.out")
  settle
  read -r rss pd anon stable <<<"$settled"
  read -r slab pages <<<"$(kernel_mem)"
  echo "density: N=$n RSS ${rss} kB (ramp of +$add in ${ramp_ms} ms, stable=$stable), kernel slab ${slab} B, TCP mem ${pages} pages" >&2
  rows+=("$n $rss $pd $anon $ramp_ms $stable $slab $pages")
  prev=$n
done
last_caches=$(slab_by_cache)

# Table and least-squares slopes (bytes/connection) over (0, idle) and every step.
summary=$(printf '%s\n' "0 $idle_rss $idle_pd $idle_anon 0 $idle_stable $idle_slab $idle_pages" "${rows[@]}" | awk '
  # Columns 1-3 are kB; 4 (slab) is bytes, hence the unit factor.
  function slope(col, unit,   i, mx, my, sxx, sxy) {
    mx = 0; my = 0
    for (i = 1; i <= k; i++) { mx += n[i]; my += v[col, i] }
    mx /= k; my /= k; sxx = 0; sxy = 0
    for (i = 1; i <= k; i++) { sxx += (n[i] - mx)^2; sxy += (n[i] - mx) * (v[col, i] - my) }
    return sxx ? sxy / sxx * unit : 0
  }
  { k++; n[k] = $1; v[1, k] = $2; v[2, k] = $3; v[3, k] = $4; ramp[k] = $5; st[k] = $6; v[4, k] = $7; pg[k] = $8 }
  END {
    printf "%8s %12s %12s %12s %14s %14s %9s\n", "conns", "rss_kB", "privdirty_kB", "anon_kB", "B/conn(vs 0)", "B/conn(step)", "ramp_ms" > "/dev/stderr"
    for (i = 1; i <= k; i++) {
      tot = i > 1 ? (v[1, i] - v[1, 1]) * 1024 / n[i] : 0
      step = i > 1 ? (v[1, i] - v[1, i - 1]) * 1024 / (n[i] - n[i - 1]) : 0
      printf "%8d %12d %12d %12d %14.0f %14.0f %9d\n", n[i], v[1, i], v[2, i], v[3, i], tot, step, ramp[i] > "/dev/stderr"
      printf "STEP %d %d %d %d %d %s %.0f %.0f %d %d\n", n[i], v[1, i], v[2, i], v[3, i], ramp[i], st[i], tot, step, v[4, i], pg[i]
    }
    slab = v[4, 1] < 0 ? -1 : slope(4, 1)
    printf "SLOPE %.0f %.0f %.0f %.0f\n", slope(1, 1024), slope(2, 1024), slope(3, 1024), slab
    printf "least-squares slope: RSS %.0f B/conn, Private_Dirty %.0f B/conn, Anonymous %.0f B/conn; kernel slab %.0f B per connection (both loopback ends)\n", slope(1, 1024), slope(2, 1024), slope(3, 1024), slab > "/dev/stderr"
  }')
read -r _ slope_rss slope_pd slope_anon slope_slab < <(echo "$summary" | grep '^SLOPE')

mkdir -p "$(dirname "$out")"
echo "$summary" | grep '^STEP' | jq -R -s \
  --arg broker "$name" --arg url "$url" --arg date "$(date -u +%FT%TZ)" \
  --arg kernel "$(uname -r)" --arg nproc "$(nproc)" \
  --argjson slope_rss "$slope_rss" --argjson slope_pd "$slope_pd" --argjson slope_anon "$slope_anon" \
  --argjson slope_slab "$slope_slab" --arg slabs "$SLABS" \
  --argjson idle_caches "$idle_caches" --argjson last_caches "$last_caches" --argjson last_n "$prev" \
  --argjson command "$(printf '%s\n' "$@" | jq -R . | jq -s -c .)" \
  --argjson loadgen_args "$(printf '%s\n' ${lg_extra[@]+"${lg_extra[@]}"} | jq -R . | jq -s -c 'map(select(length > 0))')" '{
    broker: $broker, command: $command, url: $url, loadgen_args: $loadgen_args, date: $date,
    host: {kernel: $kernel, nproc: ($nproc | tonumber)},
    method: "incremental: connections stay open between steps; each step adds rigs with a new loadgen (distinct rig ids); RSS read after ALL_WELCOMED once two reads 1 s apart agree within 1%",
    slope_bytes_per_conn: {rss: $slope_rss, private_dirty: $slope_pd, anonymous: $slope_anon},
    kernel: {slab_caches: ($slabs | split(" ")),
             slab_bytes_per_conn_both_ends: (if $slope_slab < 0 then null else $slope_slab end),
             slab_bytes_per_socket: (if $slope_slab < 0 then null else ($slope_slab / 2 | round) end),
             slab_bytes_per_socket_by_cache: ($last_caches | with_entries(.value =
               (((.value - ($idle_caches[.key] // 0)) / ($last_n * 2)) | round))),
             note: "machine-wide slab growth (other processes add noise); on loopback each broker connection has both of its sockets on this host; by_cache is the growth from idle to the last step, not a slope"},
    points: [split("\n")[] | select(length > 0) | split(" ") | {
      conns: (.[1] | tonumber), rss_kb: (.[2] | tonumber), private_dirty_kb: (.[3] | tonumber),
      anonymous_kb: (.[4] | tonumber), ramp_ms: (.[5] | tonumber), stable: (.[6] == "true"),
      bytes_per_conn_vs_idle: (.[7] | tonumber), bytes_per_conn_marginal: (.[8] | tonumber),
      kernel_slab_bytes: (.[9] | tonumber), tcp_mem_pages: (.[10] | tonumber)}]
  }' >"$out"
echo "density: wrote $out" >&2
echo "SLOPE_BYTES_PER_CONN rss=$slope_rss private_dirty=$slope_pd anonymous=$slope_anon kernel_slab_both_ends=$slope_slab"
