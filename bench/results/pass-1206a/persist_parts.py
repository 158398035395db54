#!/usr/bin/env python3
"""What persist.lua's own checks cost Redis: the script as fleetlink-fe runs it (lease_holder.lua +
lapse_end.lua + persist.lua) against copies with one check taken out each. Runs its own
redis-server on a free loopback port; 10,000 leased rigs get their 2nd and 3rd command in calls
of 500; prints Redis's own time per command (INFO commandstats), medians over rounds x 2.

    python3 bench/results/pass-1206a/persist_parts.py [rounds]
"""
import os, re, socket, subprocess, sys, time
import redis
ROOT=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."); N,BATCH=10_000,500
BOOT="018bcfe5-6801-71b2-bdcf-cbe7b3b4a717"
CMD='{"type":"command","seq":1,"id":"x","name":"n","args":{}}'
pre="".join(open(f"{ROOT}/lua/{n}").read() for n in ("lease_holder.lua","lapse_end.lua"))
p=open(f"{ROOT}/lua/persist.lua").read()
def sub(a,b,t):
    assert a in t, a; return t.replace(a,b)
V={"now":pre+p,
 "no-prelude":p.replace("lapse_held_score","LHS"),
 "no-seq-check":pre+sub("if #seq > 15 or not seq:match('^%d+$') then","if false then",p),
 "call-not-pcall":pre+sub("redis.pcall('GET'","redis.call('GET'",sub("redis.pcall('HGET'","redis.call('HGET'",p)),
 "no-have-match":pre+sub("if type(have) ~= 'string' or #have > 15 or not have:match('^%d+$') then","if not have then",p),
 "no-format":pre+sub("string.format('%.0f', seqs[i] + 1)","seqs[i] + 1",p),
}
def free_port():
    with socket.socket() as s: s.bind(("127.0.0.1",0)); return s.getsockname()[1]
port=free_port()
srv=subprocess.Popen(["redis-server","--port",str(port),"--bind","127.0.0.1","--save","","--appendonly","no"],stdout=subprocess.DEVNULL)
try:
    r=redis.Redis(port=port); d=time.monotonic()+10
    while True:
        try: r.ping(); break
        except redis.ConnectionError:
            if time.monotonic()>d: raise
            time.sleep(0.05)
    res={}
    for _ in range(int(sys.argv[1])):
        for name,text in V.items():
            r.flushall(); sha=r.script_load(text)
            pipe=r.pipeline(transaction=False)
            for i in range(N): pipe.set(f"rig:r{i}",f"{BOOT}|fe-a")
            pipe.execute()
            for seq in (1,2,3):
                r.config_resetstat(); pipe=r.pipeline(transaction=False)
                for c in range(0,N,BATCH):
                    keys,args=[],["600000"]
                    for i in range(c,c+BATCH):
                        keys+=[f"rig:r{i}",f"sess:r{i}:{BOOT}"]; args+=[f"{BOOT}|fe-a",str(seq),CMD]
                    pipe.evalsha(sha,len(keys),*keys,*args)
                out=pipe.execute()
                assert all(o==[b"ok"]*BATCH for o in out), out[0][:3]
                if seq>1: res.setdefault(name,[]).append(r.info("commandstats")["cmdstat_evalsha"]["usec"]/N)
    for k,v in res.items():
        v.sort(); print(f"{k:16} median {v[len(v)//2]:.2f}  ({', '.join(f'{x:.2f}' for x in v)})")
finally:
    srv.kill(); srv.wait()
