#!/usr/bin/env bash
# irq-affinity.sh: steer a NIC's packet processing for fleetlink-fe's thread-per-core workers.
#
# Usage: irq-affinity.sh --iface IFACE --mode isolate|colocate [--broker-cpus LIST]
#                        [--irq-cpus LIST] [--apply]
#   LIST is a kernel cpu list, e.g. 0-1 or 2-15,18.
#   --mode isolate   NIC IRQs (and RPS) on --irq-cpus only; the broker runs on the other cores
#                    (set CPUAffinity= in fleetlink-fe.service to --broker-cpus).
#   --mode colocate  NIC IRQs spread over --broker-cpus, one queue per core, plus RFS when
#                    there are fewer RX queues than broker cores.
#   XPS (transmit queue per sending CPU) is set in both modes: the broker sends from its own
#   cores, so each broker core gets its own TX queue and never shares a queue lock.
#   Default is a dry run: it prints every value it would write and the current one. --apply
#   writes only values that differ (idempotent: a second run changes nothing).
#
# The trade-off (docs/tuning.md, "NIC queues and IRQs"):
#   isolate:  softirq work (TCP receive, ACKs, TLS records arriving) never preempts a worker's
#             event loop, so worker latency is predictable; the cost is that each packet's data is
#             handled on one core and read on another (cache misses, wakeup IPIs), and the IRQ
#             cores must keep up with the whole host's packet rate.
#   colocate: softirq runs on the core that will read the socket: caches stay hot, no IPIs. It
#             pays off only if a connection's packets land on the core of the worker that owns
#             it. SO_REUSEPORT picks the listener by a hash of the 4-tuple, not by the receiving
#             CPU, so that needs either SO_INCOMING_CPU on each listener or RFS (which follows
#             the reading CPU). Under a storm, softirq steals time from the workers.
#   For 1M mostly idle rigs the packet rate is low; isolate with 1-2 IRQ cores is the safe
#   default. Measure before choosing colocate.
#
# irqbalance rewrites IRQ affinity every few seconds: stop it, or ban the IRQ cores with
# IRQBALANCE_BANNED_CPULIST, or this script's settings will not stay.
#
# FLEETLINK_SYSFS / FLEETLINK_PROCFS override /sys and /proc (for testing on a copied tree).
set -euo pipefail

SYS=${FLEETLINK_SYSFS:-/sys}
PROC=${FLEETLINK_PROCFS:-/proc}
IFACE=""
MODE=""
BROKER_CPUS=""
IRQ_CPUS="0"
APPLY=0
CHANGES=0
FAILURES=0

# usage [CODE]: the header's usage text; exit CODE (64, a usage error, unless asked for help).
usage() {
    sed -n '4,14p' "$0" | sed 's/^# \{0,1\}//'
    exit "${1:-64}"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --iface) IFACE=${2:?}; shift 2 ;;
        --mode) MODE=${2:?}; shift 2 ;;
        --broker-cpus) BROKER_CPUS=${2:?}; shift 2 ;;
        --irq-cpus) IRQ_CPUS=${2:?}; shift 2 ;;
        --apply) APPLY=1; shift ;;
        --dry-run) APPLY=0; shift ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument: $1" >&2; usage ;;
    esac
done
[ -n "$IFACE" ] && [ -d "$SYS/class/net/$IFACE" ] || { echo "no such interface: '$IFACE'" >&2; usage; }
case "$MODE" in isolate|colocate) ;; *) echo "--mode isolate|colocate" >&2; usage ;; esac

# Expands a cpu list (0-3,8) into one cpu per line.
expand() {
    local part
    for part in ${1//,/ }; do
        case "$part" in
            *-*) seq "${part%-*}" "${part#*-}" ;;
            *) echo "$part" ;;
        esac
    done
}

# Hex cpumask, comma-separated 32-bit words, as /proc/irq/*/smp_affinity and rps_cpus take it.
mask() {
    local -a cpus words
    local cpu max=0 i out=""
    mapfile -t cpus < <(expand "$1")
    for cpu in "${cpus[@]}"; do
        if [ "$cpu" -gt "$max" ]; then max=$cpu; fi
    done
    for ((i = 0; i <= max / 32; i++)); do words[i]=0; done
    for cpu in "${cpus[@]}"; do
        words[cpu / 32]=$(( words[cpu / 32] | (1 << (cpu % 32)) ))
    done
    for ((i = max / 32; i >= 0; i--)); do
        out+=$(printf '%08x' "${words[i]}")
        if [ "$i" -gt 0 ]; then out+=","; fi
    done
    echo "$out"
}

# Strips commas and leading zeros so masks of different widths compare equal.
normal() {
    local v
    v=$(echo "$1" | tr -d ',\n' | sed 's/^0*//')
    echo "${v:-0}"
}

# set_value FILE WANT: print, and with --apply write when the current value differs.
set_value() {
    local file=$1 want=$2 cur
    if ! cur=$(cat "$file" 2>/dev/null); then
        echo "skip   $file (not readable: single-queue device or no such knob)"
        return
    fi
    if [ "$(normal "$cur")" = "$(normal "$want")" ]; then
        echo "ok     $file = $cur"
        return
    fi
    CHANGES=$((CHANGES + 1))
    if [ "$APPLY" -eq 0 ]; then
        echo "would  echo $want > $file   (now $cur)"
    elif echo "$want" > "$file" 2>/dev/null; then
        echo "set    $file = $want   (was $cur)"
    else
        # Managed IRQs (many multiqueue drivers) refuse affinity writes with EIO.
        FAILURES=$((FAILURES + 1))
        echo "FAILED $file = $want   (still $cur; a kernel-managed IRQ cannot be moved)"
    fi
}

online=$(cat "$SYS/devices/system/cpu/online")
[ -n "$BROKER_CPUS" ] || BROKER_CPUS=$online
mapfile -t broker < <(expand "$BROKER_CPUS")
mapfile -t irqcpus < <(expand "$IRQ_CPUS")
# A CPU this host does not have would leave its IRQs (or the broker) nowhere.
mapfile -t have < <(expand "$online")
for cpu in "${broker[@]}" "${irqcpus[@]}"; do
    if ! printf '%s\n' "${have[@]}" | grep -qx -- "$cpu"; then
        echo "cpu '$cpu' (in --broker-cpus or --irq-cpus) is not online here; online: $online" >&2
        exit 64
    fi
done

# The NIC's MSI/MSI-X vectors: on the PCI device, or its parent for virtio_net.
dev=$(readlink -f "$SYS/class/net/$IFACE/device" || true)
irqs=()
for d in "$dev/msi_irqs" "$dev/../msi_irqs"; do
    if [ -d "$d" ]; then
        mapfile -t irqs < <(ls "$d" | sort -n)
        break
    fi
done
mapfile -t rxq < <(ls -d "$SYS/class/net/$IFACE"/queues/rx-* 2>/dev/null | sort -V)
mapfile -t txq < <(ls -d "$SYS/class/net/$IFACE"/queues/tx-* 2>/dev/null | sort -V)

echo "# $IFACE: mode $MODE, broker cpus $BROKER_CPUS, irq cpus $IRQ_CPUS, online $online"
echo "# ${#irqs[@]} IRQs (${irqs[*]:-none}), ${#rxq[@]} rx / ${#txq[@]} tx queues; $([ "$APPLY" -eq 1 ] && echo applying || echo 'dry run (--apply to write)')"
if pgrep -x irqbalance >/dev/null 2>&1; then
    echo "# WARNING: irqbalance is running and will undo IRQ affinity: systemctl stop irqbalance (or IRQBALANCE_BANNED_CPULIST=$IRQ_CPUS)"
fi

# IRQ affinity: isolate puts every vector on the IRQ cores; colocate deals vectors round-robin
# over the broker cores, in vector order (drivers allocate queue vectors in queue order).
i=0
for irq in "${irqs[@]}"; do
    if [ "$MODE" = isolate ]; then
        set_value "$PROC/irq/$irq/smp_affinity" "$(mask "$IRQ_CPUS")"
    else
        set_value "$PROC/irq/$irq/smp_affinity" "$(mask "${broker[i % ${#broker[@]}]}")"
    fi
    i=$((i + 1))
done

# RPS/RFS: with fewer RX queues than cores, RPS spreads protocol processing in software.
# isolate: RPS onto the IRQ cores, RFS off (RFS would pull work onto the broker's cores).
# colocate: RPS over the broker cores and RFS on, so a flow is processed where it is read.
rps_cpus=$([ "$MODE" = isolate ] && echo "$IRQ_CPUS" || echo "$BROKER_CPUS")
targets=$([ "$MODE" = isolate ] && echo "${#irqcpus[@]}" || echo "${#broker[@]}")
if [ "${#rxq[@]}" -lt "$targets" ]; then
    rps=$(mask "$rps_cpus")
else
    rps=0
fi
# RFS table: global, so only colocate touches it; the kernel rounds both sizes up to a power
# of two, so the per-queue share is rounded here to keep reruns idempotent.
flows=0
if [ "$MODE" = colocate ] && [ "$rps" != 0 ]; then
    flows=65536
    set_value "$PROC/sys/net/core/rps_sock_flow_entries" "$flows"
fi
per_queue=0
if [ "$flows" -gt 0 ]; then
    per_queue=1
    while [ $((per_queue * ${#rxq[@]})) -lt "$flows" ]; do per_queue=$((per_queue * 2)); done
fi
for q in "${rxq[@]}"; do
    set_value "$q/rps_cpus" "$rps"
    set_value "$q/rps_flow_cnt" "$per_queue"
done

# XPS: each broker core transmits on one TX queue (core k -> queue k mod queues).
if [ "${#txq[@]}" -gt 1 ]; then
    for ((t = 0; t < ${#txq[@]}; t++)); do
        cpus=""
        for ((k = t; k < ${#broker[@]}; k += ${#txq[@]})); do
            cpus+="${cpus:+,}${broker[k]}"
        done
        set_value "${txq[t]}/xps_cpus" "$( [ -n "$cpus" ] && mask "$cpus" || echo 0)"
    done
else
    echo "skip   XPS: $IFACE has a single TX queue"
fi

echo "# $CHANGES change(s) $([ "$APPLY" -eq 1 ] && echo made || echo pending), $FAILURES failed"
[ "$FAILURES" -eq 0 ]
