"""What persist.lua costs Redis per command, by Redis's own count.

Starts a redis-server on a free port, gives 30,000 rigs a lease and a session (as a hello
would), then keeps one command for each through persist.lua (or the script named as the
first argument) in calls of 500, as the bridge does (PERSIST_CHUNK), and forgets them with
pipelined HDELs as acks do. Prints INFO commandstats and Redis's CPU per command.

    python3 bench/results/persist-cost/persist_cost.py [script.lua]
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../../tests/faults"))
from faults import Resp, free_port, poll  # noqa: E402  (the fault runner's RESP client)

RIGS = 30000
PERSIST_CHUNK = 500
BOOT = "019a0000-0000-7000-8000-000000000000"
TUPLE = f"{BOOT}|b1"
COMMAND = json.dumps({"type": "command", "seq": 1, "id": "c-0000000001", "name": "reboot",
                      "args": {"delay_s": 5, "reason": "bench"}})


def connect(port):
    try:
        return Resp(port)
    except OSError:
        return None


def cpu_s(r):
    """Redis's own CPU-seconds so far (user + system), finer than /proc's 10 ms ticks."""
    info = r.cmd("INFO", "cpu").decode()
    fields = dict(line.split(":", 1) for line in info.split("\r\n") if ":" in line)
    return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


def main():
    script = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "../../../lua/persist.lua")
    src = open(script).read()
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = poll("redis-server to accept", 5, lambda: connect(port))
        sha = r.cmd("SCRIPT", "LOAD", src)
        rigs = [f"rig-{i:05d}" for i in range(RIGS)]
        for i in range(0, RIGS, 1000):
            batch = rigs[i:i + 1000]
            r.cmd("MSET", *[x for rg in batch for x in (f"rig:{rg}", TUPLE)])
            r.pipeline([("HSET", f"sess:{rg}:{BOOT}", "next", "1") for rg in batch])
            r.pipeline([("PEXPIRE", f"sess:{rg}:{BOOT}", "600000") for rg in batch])
        r.cmd("CONFIG", "RESETSTAT")
        c0 = cpu_s(r)
        for i in range(0, RIGS, PERSIST_CHUNK):
            batch = rigs[i:i + PERSIST_CHUNK]
            keys = [k for rg in batch for k in (f"rig:{rg}", f"sess:{rg}:{BOOT}")]
            argv = ["600000"] + [a for _ in batch for a in (TUPLE, "1", COMMAND)]
            r.cmd("EVALSHA", sha, str(len(keys)), *keys, *argv)
        c1 = cpu_s(r)
        for i in range(0, RIGS, 1000):
            r.pipeline([("HDEL", f"sess:{rg}:{BOOT}", "c:1") for rg in rigs[i:i + 1000]])
        c2 = cpu_s(r)
        print(r.cmd("INFO", "commandstats").decode())
        print(f"persist: redis cpu {c1 - c0:.3f}s = {(c1 - c0) / RIGS * 1e6:.1f} us/cmd; "
              f"hdel (pipelined) {c2 - c1:.3f}s = {(c2 - c1) / RIGS * 1e6:.1f} us/cmd")
    finally:
        redis.terminate()
        redis.wait()


if __name__ == "__main__":
    main()
