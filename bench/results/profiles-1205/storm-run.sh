#!/bin/bash
# one storm of 10,000 rigs against a standalone broker, perf recording the broker
B=/work/main/target/release
ulimit -n 20000
$B/fleetlink-fe --listen 127.0.0.1:26080 --admin 127.0.0.1:26090 --accept-rate 1000000 --accept-burst 1000000 > broker.log 2>&1 &
BP=$!
for i in $(seq 50); do curl -sf http://127.0.0.1:26090/healthz >/dev/null && break; sleep 0.1; done
perf record -F 4999 -g -p $BP -o perf.data 2>perf.err &
PP=$!
sleep 0.5
/usr/bin/time -f "loadgen %e s" $B/fleetlink-loadgen rigs --url ws://127.0.0.1:26080/agent --rigs 10000 --concurrency 1024 --sources 127.0.0.1-127.0.0.16 --hold 1s --max-time 60s --procs 2 --report rep.json > lg.log 2>&1
kill -INT $PP; wait $PP
grep -E "^(utime|stime)" /proc/$BP/stat 2>/dev/null; awk '{print "utime",$14,"stime",$15}' /proc/$BP/stat
kill $BP; wait $BP
