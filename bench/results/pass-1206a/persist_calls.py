#!/usr/bin/env python3
"""What each of persist.lua's calls into Redis costs: minimal scripts doing only the HSET, the
lease GET and HSET, and GET + HGET + HSET, beside the shipped script and an empty one, and the
same commands sent plain (pipelined). Same set-up as persist_parts.py.

    python3 bench/results/pass-1206a/persist_calls.py [rounds]
"""
import os, socket, subprocess, sys, time
import redis
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
N, BATCH = 10_000, 500
BOOT = "018bcfe5-6801-71b2-bdcf-cbe7b3b4a717"
CMD = '{"type":"command","seq":1,"id":"x","name":"n","args":{}}'
def lua(*names):
    return "".join(open(os.path.join(ROOT, "lua", n)).read() for n in names)
MIN_HSET = """
local n = #KEYS / 2
local out = {}
for i = 1, n do
  redis.call('HSET', KEYS[2*i], 'c:' .. ARGV[3*i], ARGV[3*i+1], 'next', ARGV[3*i] + 1)
  out[i] = 'ok'
end
return out
"""
LEASE_HSET = """
local n = #KEYS / 2
local out = {}
for i = 1, n do
  if redis.call('GET', KEYS[2*i-1]) == ARGV[3*i-1] then
    redis.call('HSET', KEYS[2*i], 'c:' .. ARGV[3*i], ARGV[3*i+1], 'next', ARGV[3*i] + 1)
  end
  out[i] = 'ok'
end
return out
"""
LEASE_HGET_HSET = """
local n = #KEYS / 2
local out = {}
for i = 1, n do
  if redis.call('GET', KEYS[2*i-1]) == ARGV[3*i-1] then
    local have = redis.call('HGET', KEYS[2*i], 'next')
    redis.call('HSET', KEYS[2*i], 'c:' .. ARGV[3*i], ARGV[3*i+1], 'next', ARGV[3*i] + 1)
  end
  out[i] = 'ok'
end
return out
"""
EMPTY = """
local out = {}
for i = 1, #KEYS / 2 do out[i] = 'ok' end
return out
"""
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]
def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    scripts = {"now": lua("lease_holder.lua", "lapse_end.lua", "persist.lua"),
               "empty": EMPTY, "hset": MIN_HSET, "lease+hset": LEASE_HSET, "lease+hget+hset": LEASE_HGET_HSET}
    scripts = {k: v for k, v in scripts.items() if v}
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try: r.ping(); break
            except redis.ConnectionError:
                if time.monotonic() > deadline: raise
                time.sleep(0.05)
        res = {}
        for _ in range(rounds):
            for name, text in scripts.items():
                r.flushall(); sha = r.script_load(text)
                pipe = r.pipeline(transaction=False)
                for i in range(N): pipe.set(f"rig:r{i}", f"{BOOT}|fe-a")
                pipe.execute()
                for seq in (1, 2, 3):
                    r.config_resetstat()
                    pipe = r.pipeline(transaction=False)
                    for c in range(0, N, BATCH):
                        keys, args = [], ["600000"]
                        for i in range(c, c + BATCH):
                            keys += [f"rig:r{i}", f"sess:r{i}:{BOOT}"]
                            args += [f"{BOOT}|fe-a", str(seq), CMD]
                        pipe.evalsha(sha, len(keys), *keys, *args)
                    pipe.execute()
                    st = r.info("commandstats")["cmdstat_evalsha"]
                    if seq > 1: res.setdefault(name, []).append(st["usec"] / N)
            # raw: pipeline HSET, HDEL, PUBLISH
            for name, fn in (("raw HSET", lambda p, i: p.hset(f"sess:r{i}:{BOOT}", mapping={"c:9": CMD, "next": "10"})),
                             ("raw HDEL", lambda p, i: p.hdel(f"sess:r{i}:{BOOT}", "c:9")),
                             ("raw PUBLISH(no sub)", lambda p, i: p.publish("fleetlink:broker:fe-a", CMD))):
                r.config_resetstat()
                pipe = r.pipeline(transaction=False)
                for i in range(N): fn(pipe, i)
                pipe.execute()
                st = r.info("commandstats")
                tot = sum(v["usec"] for k, v in st.items())
                res.setdefault(name, []).append(tot / N)
        for name, v in res.items():
            v.sort()
            print(f"{name:22} median {v[len(v)//2]:.2f} us/command  ({', '.join(f'{x:.2f}' for x in v)})")
    finally:
        server.kill(); server.wait()
main()
