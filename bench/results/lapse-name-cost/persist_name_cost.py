#!/usr/bin/env python3
"""What naming a session in `sess:lapses` adds to `persist.lua`'s Redis time.

Runs its own redis-server on a free loopback port. For each round, and for the script before
the change (`git show cad6228:lua/persist.lua`, so run it in the repository) and as
fleetlink-fe ran it from stop 59 until the naming moved out of the keep (84d8964's
lua/lease_holder.lua + lua/lapse_end.lua + lua/persist.lua): 10,000 leased rigs get one
command each in calls of 500 (as the bridge batches a fan-out), then a second command each.
That script names every session with the first command (a connection's first kept
command) and none with the second. Prints Redis's own time per command (INFO commandstats).

    python3 bench/results/lapse-name-cost/persist_name_cost.py [rounds]
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "lib"))
from scratch_redis import leased, scratch_redis  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
N, BATCH = 10_000, 500
BOOT = "018bcfe5-6801-71b2-bdcf-cbe7b3b4a717"


def lua(*names):
    """The scripts as they were when the naming was in persist.lua (84d8964): it has moved
    out of the keep since (docs/benchmarks.md, "Since pass 1206a")."""
    return "".join(subprocess.check_output(
        ["git", "-C", ROOT, "show", f"84d8964:lua/{n}"], text=True) for n in names)



def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    scripts = {
        "before": (subprocess.check_output(
            ["git", "-C", ROOT, "show", "cad6228:lua/persist.lua"], text=True), False),
        "now": (lua("lease_holder.lua", "lapse_end.lua", "persist.lua"), True),
    }
    with scratch_redis() as r:
        results = {}
        for _ in range(rounds):
            for name, (text, names) in scripts.items():
                sha = leased(r, text, N, BOOT)
                for second in (False, True):
                    r.config_resetstat()
                    pipe = r.pipeline(transaction=False)
                    for c in range(0, N, BATCH):
                        keys, args = [], ["600000"]
                        for i in range(c, c + BATCH):
                            keys += [f"rig:r{i}", f"sess:r{i}:{BOOT}"]
                            args += [f"{BOOT}|fe-a", str(2 if second else 1),
                                     '{"type":"command","seq":1,"id":"x","name":"n","args":{}}']
                        if names and not second:
                            args += [str(j + 1) for j in range(BATCH)]
                        pipe.evalsha(sha, len(keys), *keys, *args)
                    assert all(o == [b"ok"] * BATCH for o in pipe.execute())
                    st = r.info("commandstats")["cmdstat_evalsha"]
                    results.setdefault((name, second), []).append(st["usec"] / N)
        for (name, second), v in sorted(results.items()):
            v.sort()
            print(f"{name:6} {'second' if second else 'first '} command: median "
                  f"{v[len(v) // 2]:.1f} us of Redis time per command (rounds: "
                  + ", ".join(f"{x:.1f}" for x in v) + ")")


if __name__ == "__main__":
    main()
