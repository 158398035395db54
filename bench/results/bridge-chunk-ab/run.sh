#!/bin/bash
cd /work/main
for i in 1 2 3 4; do
  for b in old new; do
    if [ $b = old ]; then td=/tmp/fx/oldtarget; else td=/work/main/target; fi
    CARGO_TARGET_DIR=$td bench/fanout-cpu.sh --brokers "fleetlink-fe-redis" --rounds 1 --name memset-$b-$i > /tmp/fx/memset-$b-$i.log 2>&1
    echo "$b $i $(jq -c '.sessions[0] | [.latency_ms.p99, .cpu_ms.broker_total, .cpu_ms["fleetlink-bridg"], .cpu_ms["fleetlink-core-"], .cpu_ms.redis]' bench/results/fanout-cpu-memset-$b-$i.json)"
  done
done
