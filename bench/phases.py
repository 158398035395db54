#!/usr/bin/env python3
"""Memory per connection, phase by phase: N raw TCP connections, then the websocket upgrade on
each, then a hello on each. Prints RSS growth per connection of the broker process and, when the
broker was built with `--features heap-stats`, the live heap growth per connection (so the
allocator's own overhead shows as the difference).

    cargo build --release --features heap-stats --bin fleetlink-fe
    target/release/fleetlink-fe --listen 127.0.0.1:18558 --admin 127.0.0.1:19558 --cores 1 \
        --accept-rate 100000 --accept-burst 100000 --hello-timeout 60s &
    bench/phases.py 18558 19558 10000 $!

Standard library only. Uses 8 source addresses (127.0.0.1-8); N is bounded by this process's
open-file limit.
"""
import json, os, re, socket, struct, sys, time, urllib.request

port, admin, N, pid = (int(a) for a in sys.argv[1:5])


def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024


def heap():
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics").read().decode()
    m = re.search(r"fleetlink_heap_live_bytes (\d+)", text)
    return int(m.group(1)) if m else 0


def report(tag, base):
    time.sleep(1.5)  # let the broker finish the phase's work (this is a measurement, not a sync)
    r, h = rss(), heap()
    print(f"{tag:10s} rss/conn {(r - base[0]) / N:8.0f}  heap/conn {(h - base[1]) / N:8.0f}", flush=True)


def uuid7():
    b = bytearray(int(time.time() * 1000).to_bytes(6, "big") + os.urandom(10))
    b[6] = 0x70 | (b[6] & 15)
    b[8] = 0x80 | (b[8] & 0x3F)
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def masked_text(payload):
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + struct.pack(">H", n)
    return head + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(payload))


base = (rss(), heap())
socks = []
for i in range(N):
    s = socket.socket()
    s.bind((f"127.0.0.{1 + i % 8}", 0))
    s.connect(("127.0.0.1", port))
    socks.append(s)
report("tcp", base)
for s in socks:
    s.send(b"GET /agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
for s in socks:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(4096)
report("upgraded", base)
for i, s in enumerate(socks):
    hello = {"type": "hello", "rig_id": f"rig-{i:06d}", "boot_id": uuid7(), "version": "phases"}
    s.send(masked_text(json.dumps(hello).encode()))
for s in socks:
    s.recv(4096)
report("welcomed", base)
