#!/usr/bin/env python3
"""Redis's own CPU per rig for a batch of hellos' session reads: resume.lua as shipped at
be251c9 plus the offline take as a MULTI of LRANGE and DEL per rig (what src/registry/fleet.rs
sends), against that script with resume-folded.diff applied, which takes the offline list
inside the script, reads and moves the sessof: pointer with one SET ... GET, and answers a new
session with nothing found as a bare 0. Both come from git (`git show be251c9:lua/resume.lua`),
so later changes to the script do not change what this compares.

Starts its own redis-server on a free port and stops it. Each batch is 128 rigs (RESUME_CHUNK);
before each, every rig is given an older boot's session and pointer (--same-boot: its own
boot's), as in a storm of rebooted (or reconnecting) rigs. The arms alternate, their order
swapped every batch; CPU is Redis's used_cpu_user + used_cpu_sys (INFO cpu) around each batch's
calls only. Prints the median per rig of each arm over the batches, and their ratio.

    python3 bench/results/resume-fold/resume_cost.py [--batches 200] [--same-boot]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))
from faults import Resp, free_port, poll  # noqa: E402  (the fault runner's RESP client)

RIGS = 128
BASE = "be251c9"


def scripts():
    """The shipped script at BASE, and the same with resume-folded.diff applied."""
    shipped = subprocess.run(["git", "-C", ROOT, "show", f"{BASE}:lua/resume.lua"],
                             check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "resume.lua")
        with open(path, "w") as f:
            f.write(shipped)
        subprocess.run(["patch", "-s", path, os.path.join(HERE, "resume-folded.diff")],
                       check=True)
        with open(path) as f:
            return shipped, f.read()


def cpu(r):
    """Redis's own CPU-seconds so far (user + system)."""
    info = r.cmd("INFO", "cpu").decode()
    fields = dict(line.split(":", 1) for line in info.split("\r\n") if ":" in line)
    return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])


def boot(k):
    return "0190%04x-0000-7000-8000-%012x" % (k >> 48 & 0xFFFF, k & 0xFFFFFFFFFFFF)


def connect(port):
    try:
        r = Resp(port)
        r.cmd("PING")
        return r
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--same-boot", action="store_true")
    o = ap.parse_args()
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        r = poll("redis-server up", 10, lambda: connect(port))
        shipped, folded = (r.cmd("SCRIPT", "LOAD", text) for text in scripts())
        per_rig = {"shipped": [], "folded": []}
        k = 0
        for batch in range(o.batches):
            for arm in ("shipped", "folded") if batch % 2 == 0 else ("folded", "shipped"):
                rigs = [f"r{arm[0]}{batch}-{i}" for i in range(RIGS)]
                k += 2
                old, new = boot(k), boot(k + 1)
                had = new if o.same_boot else old
                r.pipeline([c for rig in rigs for c in (
                    ("HSET", f"sess:{rig}:{had}", "next", "1"),
                    ("SET", f"sessof:{rig}", had),
                )])
                argv = [a for rig in rigs for a in (new, rig)]
                c0 = cpu(r)
                if arm == "shipped":
                    keys = [k for rig in rigs for k in (f"sess:{rig}:{new}", f"sessof:{rig}")]
                    r.cmd("EVALSHA", shipped, len(keys), *keys, 600000, "fe-a",
                          "2026-12-02T00:00:00.000Z", *argv)
                    take = [c for rig in rigs for c in (
                        ("LRANGE", f"offline:{rig}", 0, -1), ("DEL", f"offline:{rig}"))]
                    r.pipeline([("MULTI",), *take, ("EXEC",)])
                else:
                    keys = [k for rig in rigs
                            for k in (f"sess:{rig}:{new}", f"sessof:{rig}", f"offline:{rig}")]
                    r.cmd("EVALSHA", folded, len(keys), *keys, 600000, "fe-a",
                          "2026-12-02T00:00:00.000Z", *argv)
                per_rig[arm].append((cpu(r) - c0) / RIGS * 1e6)
        m = {arm: statistics.median(v) for arm, v in per_rig.items()}
        print(f"{o.batches} batches of {RIGS} rigs, {'same boot' if o.same_boot else 'new boot'}: "
              f"shipped {m['shipped']:.2f} us/rig, folded {m['folded']:.2f} us/rig "
              f"(folded / shipped {m['folded'] / m['shipped']:.3f})")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
