#!/bin/bash
# 3 fan-outs to 10,000 rigs through Redis, perf recording the fleet-mode broker
B=/work/main/target/release
ulimit -n 20000
RP=27391
redis-server --port $RP --bind 127.0.0.1 --save "" --appendonly no > redis.log 2>&1 &
RPID=$!
for i in $(seq 50); do redis-cli -p $RP ping >/dev/null 2>&1 && break; sleep 0.1; done
$B/fleetlink-fe --redis redis://127.0.0.1:$RP/ --listen 127.0.0.1:27080 --admin 127.0.0.1:27090 --broker-id fx --accept-rate 100000 --accept-burst 100000 --drain 1s --cores 1 ${EXTRA} > broker.log 2>&1 &
BP=$!
for i in $(seq 100); do curl -sf http://127.0.0.1:27090/readyz >/dev/null && break; sleep 0.1; done
$B/fleetlink-loadgen rigs --url ws://127.0.0.1:27080/agent --rigs 10000 --prefix rig --hold 120s --max-time 200s --until-commands 30000 --report rigs.json > rigs.out 2> rigs.err &
LP=$!
for i in $(seq 600); do grep -q '^ALL_WELCOMED' rigs.out && break; sleep 0.1; done
sleep 1
perf record -F 2999 -g -p $BP -o perf.data 2>perf.err &
PP=$!
sleep 0.3
$B/fleetlink-loadgen redis-publish --redis redis://127.0.0.1:$RP/ --broker-id fx --prefix rig --max-time 60s --mode fanout --rigs 10000 --count 3 --interval 2s --report pub.json > /dev/null
for i in $(seq 3000); do grep -q '^COMMANDS_DONE' rigs.out && break; sleep 0.02; done
kill -INT $PP; wait $PP
jq -c '.latency_us' rigs.json 2>/dev/null
kill $LP $BP; wait $LP $BP 2>/dev/null
kill $RPID; wait $RPID 2>/dev/null
