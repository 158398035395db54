#!/usr/bin/env python3
"""Where persist.lua's Redis time per command goes (pass 1206a's section of docs/benchmarks.md).

Runs its own redis-server on a free loopback port. 10,000 leased rigs get their 2nd and 3rd
command in calls of 500 (as the bridge batches a fan-out to connections that had one before),
and Redis's own time per command is read from INFO commandstats; medians over rounds x 2.

    python3 bench/results/pass-1206a/persist_cost.py parts [rounds]
        the script as fleetlink-fe runs it (lease_holder.lua + lapse_end.lua + persist.lua)
        against copies with one of its checks taken out each
    python3 bench/results/pass-1206a/persist_cost.py calls [rounds]
        minimal scripts making only its calls into Redis (HSET; lease GET + HSET; GET + HGET +
        HSET), an empty one, and the same commands sent plain, pipelined
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "lib"))
from scratch_redis import leased, scratch_redis  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
N, BATCH = 10_000, 500
BOOT = "018bcfe5-6801-71b2-bdcf-cbe7b3b4a717"
CMD = '{"type":"command","seq":1,"id":"x","name":"n","args":{}}'


def lua(name):
    return open(os.path.join(ROOT, "lua", name)).read()


def without(text, check, instead):
    assert check in text, check
    return text.replace(check, instead)


def shipped():
    return lua("lease_holder.lua") + lua("lapse_end.lua") + lua("persist.lua")


def parts():
    pre, p = lua("lease_holder.lua") + lua("lapse_end.lua"), lua("persist.lua")
    return {
        "shipped": shipped(),
        "no-prelude": p.replace("lapse_held_score", "LHS"),
        "no-seq-check": pre + without(p, "if #seq > 15 or not seq:match('^%d+$') then", "if false then"),
        "call-not-pcall": pre + without(without(p, "redis.pcall('GET'", "redis.call('GET'"),
                                        "redis.pcall('HGET'", "redis.call('HGET'"),
        "no-next-text-check": pre + without(
            p, "if type(have) ~= 'string' or #have > 15 or not have:match('^%d+$') then",
            "if not have then"),
        "no-format": pre + without(p, "string.format('%.0f', seqs[i] + 1)", "seqs[i] + 1"),
    }


def loop(body):
    return ("local out = {}\nfor i = 1, #KEYS / 2 do\n" + body
            + "  out[i] = 'ok'\nend\nreturn out\n")


HSET = "redis.call('HSET', KEYS[2*i], 'c:' .. ARGV[3*i], ARGV[3*i+1], 'next', ARGV[3*i] + 1)\n"
LEASE = "if redis.call('GET', KEYS[2*i-1]) == ARGV[3*i-1] then\n"


def calls():
    return {
        "shipped": shipped(),
        "empty": loop(""),
        "hset": loop(HSET),
        "lease+hset": loop(LEASE + HSET + "end\n"),
        "lease+hget+hset": loop(LEASE + "redis.call('HGET', KEYS[2*i], 'next')\n" + HSET + "end\n"),
    }


PLAIN = {
    "plain HSET": lambda p, i: p.hset(f"sess:r{i}:{BOOT}", mapping={"c:9": CMD, "next": "10"}),
    "plain HDEL": lambda p, i: p.hdel(f"sess:r{i}:{BOOT}", "c:9"),
    "plain PUBLISH (no subscriber)": lambda p, i: p.publish("fleetlink:broker:fe-a", CMD),
}



def script_us(r, text):
    """Redis's time per command for the 2nd and 3rd command of each rig: two figures."""
    sha = leased(r, text, N, BOOT)
    out = []
    for seq in (1, 2, 3):
        r.config_resetstat()
        pipe = r.pipeline(transaction=False)
        for c in range(0, N, BATCH):
            keys, args = [], ["600000"]
            for i in range(c, c + BATCH):
                keys += [f"rig:r{i}", f"sess:r{i}:{BOOT}"]
                args += [f"{BOOT}|fe-a", str(seq), CMD]
            pipe.evalsha(sha, len(keys), *keys, *args)
        assert all(o == [b"ok"] * BATCH for o in pipe.execute())
        if seq > 1:
            out.append(r.info("commandstats")["cmdstat_evalsha"]["usec"] / N)
    return out


def plain_us(r, add):
    r.config_resetstat()
    pipe = r.pipeline(transaction=False)
    for i in range(N):
        add(pipe, i)
    pipe.execute()
    return [sum(v["usec"] for v in r.info("commandstats").values()) / N]


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("parts", "calls"):
        sys.exit(__doc__)
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    scripts = parts() if mode == "parts" else calls()
    with scratch_redis() as r:
        res = {}
        for _ in range(rounds):
            for name, text in scripts.items():
                res.setdefault(name, []).extend(script_us(r, text))
            if mode == "calls":
                for name, add in PLAIN.items():
                    res.setdefault(name, []).extend(plain_us(r, add))
        for name, v in res.items():
            v.sort()
            print(f"{name:30} median {v[len(v) // 2]:.2f} us of Redis time per command ("
                  + ", ".join(f"{x:.2f}" for x in v) + ")")


if __name__ == "__main__":
    main()
