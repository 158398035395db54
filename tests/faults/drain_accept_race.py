#!/usr/bin/env python3
"""Reproducer: connections accepted at the instant a drain starts are never served nor closed.

    python3 tests/faults/drain_accept_race.py [--runs 10] [--drain 2] [--driver io_uring|epoll|both]

Each run starts a standalone `fleetlink-fe` (release build, loopback, port 0: the ports it bound
are read from its ready line), lets 8 client threads open connections and send a websocket
upgrade as fast as they can, sends SIGTERM, and then lists the established sockets the broker
process still holds on its rig port, again and again until none is left or the drain window is
about to end (the exit at its end would close them anyway): what is still held then is the
problem. A healthy drain soon holds none (the listeners are closed, connections in the handshake
are closed with 1001). What happens instead, now and then:

- io_uring: the broker holds sockets whose upgrade request sits unread (Recv-Q 145); the client
  hangs until the process exits at the end of the drain window, then gets a TCP reset.
- epoll (`--force-epoll`): the same, and a core thread then spins at 100 % CPU and the process
  never exits; the run kills it (-9) after drain + 5 s.

Prints one line per run and a summary; exit code 1 if any run showed the problem. Bounded: every
broker is killed at drain + 5 s at the latest, client threads stop with it.
"""

import argparse
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FE = str(Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "fleetlink-fe")
REQ = (b"GET /agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
       b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


# How long the broker may take to print its ready line.
READY_TIMEOUT = 20.0
# How long before the drain's end the last look at the held sockets is taken.
HELD_MARGIN = 0.3


def held_sockets(port, pid):
    """Established sockets on the rig port that process `pid` holds (one `ss` line each)."""
    ss = subprocess.run(["ss", "-tnpH", "state", "established", f"sport = :{port}"],
                        capture_output=True, text=True, check=True).stdout
    return [" ".join(l.split()) for l in ss.splitlines() if f"pid={pid}," in l]


def core_threads(pid):
    out = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
            st = Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if comm.startswith("fleetlink-core"):
            out.append((comm, st[0], int(st[11]) + int(st[12])))
    return out


def ready_line(broker):
    """The broker's ready line, read with a deadline (a thread reads, we wait on a queue); on
    timeout or early exit the broker is killed and the run fails."""
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(broker.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=READY_TIMEOUT)
    except queue.Empty:
        line = b""
    text = line.decode(errors="replace")
    if "listen=" not in text:
        broker.kill()
        broker.wait()
        raise RuntimeError(f"fleetlink-fe printed no ready line within {READY_TIMEOUT}s "
                           f"(exit {broker.returncode}): {text!r}")
    return text


def one_run(drain, epoll):
    argv = [FE, "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
            "--drain", f"{drain}s", "--accept-rate", "100000", "--accept-burst", "100000"]
    if epoll:
        argv.append("--force-epoll")
    broker = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    line = ready_line(broker)
    port = int(re.search(r"\blisten=\S+:(\d+)", line).group(1))
    stop = threading.Event()
    slow = []
    t_term = [None]

    def client():
        while not stop.is_set():
            started = time.monotonic()
            what = "answered"
            s = None
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=drain + 10)
                s.sendall(REQ)
                if not s.recv(64):
                    what = "eof"
            except ConnectionRefusedError:
                what = "refused"
            except ConnectionResetError:
                what = "reset"
            except OSError as e:
                what = f"error {e.errno}"
            finally:
                if s:
                    s.close()
            took = time.monotonic() - started
            if took > 0.5 and t_term[0] is not None:
                slow.append((round(started - t_term[0], 3), round(took, 2), what))
            time.sleep(0.0005)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for th in threads:
        th.start()
    time.sleep(1.0)
    t_term[0] = time.monotonic()
    broker.send_signal(signal.SIGTERM)
    # Poll until the broker holds nothing on its rig port. The deadline stays a margin short of
    # the drain's end: at its end the process exits and its sockets go with it, bug or not.
    deadline = t_term[0] + max(drain - HELD_MARGIN, HELD_MARGIN)
    while True:
        held = held_sockets(port, broker.pid)
        if not held or time.monotonic() >= deadline:
            break
        if broker.poll() is not None:
            held = []  # it exited early: nothing was held to the drain's end
            break
        time.sleep(0.05)
    hang = None
    try:
        broker.wait(timeout=drain + 5)
    except subprocess.TimeoutExpired:
        first = core_threads(broker.pid)
        time.sleep(1.0)
        hang = (first, core_threads(broker.pid))
        broker.kill()
        broker.wait()
    exited_after = time.monotonic() - t_term[0]
    stop.set()
    for th in threads:
        th.join(timeout=drain + 15)
    return held, slow, hang, exited_after


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--drain", type=float, default=2.0)
    ap.add_argument("--driver", choices=["io_uring", "epoll", "both"], default="both")
    args = ap.parse_args()
    drivers = ["io_uring", "epoll"] if args.driver == "both" else [args.driver]
    bad = Counter()
    for driver in drivers:
        for i in range(args.runs):
            held, slow, hang, exited = one_run(args.drain, driver == "epoll")
            problem = bool(held) or bool(hang)
            bad[driver] += problem
            print(f"{driver} run {i + 1}: still held near the drain's end={len(held)} "
                  f"slow clients={slow[:3]} exited after {exited:.1f}s"
                  + (f" HANG core threads (comm, state, cpu ticks) {hang[0]} then {hang[1]}"
                     if hang else ""))
            for line in held[:2]:
                print(f"    {line}")
    for driver in drivers:
        print(f"SUMMARY {driver}: {bad[driver]} of {args.runs} runs held or hung")
    sys.exit(1 if sum(bad.values()) else 0)


if __name__ == "__main__":
    main()
