#!/usr/bin/env python3
"""What an acked command's removal costs Redis: a plain HDEL (a broker's own commands) against
lua/forget.lua (commands given while Redis was away, or read back from it: removed, and the seq
marked acked with the id), with two versions of the script side by side. 5,000 acked commands
of 100 sessions, forget.lua in calls of 500 as the broker sends them, the three alternating in
each round. Redis's own CPU per command, from INFO commandstats.

usage: forget_cost.py ROUNDS OLD_FORGET_LUA NEW_FORGET_LUA   (run from the repo's top)
needs: redis-server on PATH, python3 with the `redis` package"""
import json, os, sys

sys.path.insert(0, os.path.join("bench", "lib"))
from scratch_redis import scratch_redis  # noqa: E402

ROUNDS = int(sys.argv[1])
SCRIPTS = {"old": sys.argv[2], "new": sys.argv[3]}
N, SESSIONS, CALL = 5000, 100, 500
BOOT = "0190f5c2-0000-7000-8000-000000000001"
guard = open("lua/before_event.lua").read()


def where(i):
    return f"sess:rig-{i % SESSIONS}:{BOOT}", i // SESSIONS + 1


def fill(r):
    p = r.pipeline(transaction=False)
    for i in range(N):
        sess, seq = where(i)
        p.hset(sess, f"c:{seq}", json.dumps({"type": "command", "v": 1, "seq": seq,
                                            "id": f"c{i}", "name": "n", "args": {}}))
    p.execute()


def run(r, how):
    r.flushall()
    fill(r)
    shas = {k: r.script_load(guard + open(path).read()) for k, path in SCRIPTS.items()}
    r.config_resetstat()
    if how == "hdel":
        p = r.pipeline(transaction=False)
        for i in range(N):
            sess, seq = where(i)
            p.hdel(sess, f"c:{seq}")
        p.execute()
        stat = "cmdstat_hdel"
    else:
        for start in range(0, N, CALL):
            keys, args = [], ["fe-a", "2026-12-07T00:00:00Z", "600000"]
            for i in range(start, start + CALL):
                sess, seq = where(i)
                keys.append(sess)
                args += [f"rig-{i % SESSIONS}", BOOT, str(seq), f"c{i}", "acked"]
            r.evalsha(shas[how], len(keys), *keys, *args)
        stat = "cmdstat_evalsha"
    return r.info("commandstats")[stat]["usec"] / N


with scratch_redis() as r:
    got = {"hdel": [], "old": [], "new": []}
    for rnd in range(ROUNDS):
        order = ["hdel", "old", "new"]
        for how in order if rnd % 2 == 0 else order[::-1]:
            got[how].append(run(r, how))
    for how, v in got.items():
        v.sort()
        print(f"{how}: Redis µs per command, median {v[len(v) // 2]:.2f}, all {[round(x, 2) for x in v]}")
