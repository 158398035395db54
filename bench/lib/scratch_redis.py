"""A redis-server of a bench script's own, on a free loopback port, stopped on the way out.

    sys.path.insert(0, os.path.join(ROOT, "bench", "lib"))
    from scratch_redis import scratch_redis
    with scratch_redis() as r:   # a redis.Redis client, the server answering PING
        ...
"""
import contextlib
import socket
import subprocess
import time

import redis


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def scratch_redis(wait_s=10.0):
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield r
    finally:
        server.kill()
        server.wait()


def leased(r, script, rigs, boot, broker="fe-a"):
    """Empties the scratch Redis, loads `script` and leases rigs r0..r<rigs-1> to boot|broker, as
    a persist needs: the script's sha."""
    r.flushall()
    sha = r.script_load(script)
    pipe = r.pipeline(transaction=False)
    for i in range(rigs):
        pipe.set(f"rig:r{i}", f"{boot}|{broker}")
    pipe.execute()
    return sha
