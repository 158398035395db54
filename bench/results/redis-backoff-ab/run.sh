#!/bin/bash
# 3 alternating pairs of the full Redis-outage fault (5,000 rigs, 30 s), the build before the
# backoff change against the one after
cd /work/main
for i in 1 2 3; do
  for b in old new; do
    if [ $b = old ]; then td=/tmp/fx/oldtarget; else td=/work/main/target; fi
    CARGO_TARGET_DIR=$td FAULTS_NO_BUILD=1 bench/faults.sh --only redis --out /tmp/fx/redis-ab-$b-$i.json > /tmp/fx/redis-ab-$b-$i.log 2>&1
    echo "$b $i rc=$? $(jq -c '[.results.redis.redis_back_to_broker_resubscribed_ms, .results.redis.redis_back_to_registry_whole_ms, .results.redis.rig_connections_dropped]' /tmp/fx/redis-ab-$b-$i.json)"
  done
done
