#!/usr/bin/env python3
"""The TCP segments of one rig's handshake with a broker on loopback: connect, upgrade, hello,
welcome, close. Prints each segment seen on `lo` for the first rig (direction, flags, payload
bytes), then, over all rigs, how many segments each client socket sent and received up to the
welcome (TCP_INFO tcpi_segs_out / tcpi_segs_in). Needs root (an AF_PACKET socket on lo).

    python3 bench/results/handshake-acks/handshake_segments.py --port 8080 [--rigs 200]
"""
import argparse
import base64
import collections
import json
import os
import socket
import struct
import threading
import time


def ws_text(payload):
    """A masked text frame (a client's)."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + struct.pack(">H", n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def uuid7():
    ms = int(time.time() * 1000)
    b = bytearray(ms.to_bytes(6, "big") + os.urandom(10))
    b[6] = (b[6] & 0x0F) | 0x70
    b[8] = (b[8] & 0x3F) | 0x80
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def sniff(port, client_port, out, stop):
    """Appends (direction, flags, payload bytes) of every segment between the broker's port
    and `client_port[0]` once it is known."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    s.bind(("lo", 0))
    s.settimeout(0.1)
    while not stop.is_set():
        try:
            pkt, addr = s.recvfrom(70000)
        except socket.timeout:
            continue
        if addr[2] == socket.PACKET_OUTGOING:  # lo shows each packet twice
            continue
        ip = pkt[14:]
        if ip[9] != 6:
            continue
        ihl = (ip[0] & 15) * 4
        total = struct.unpack(">H", ip[2:4])[0]
        tcp = ip[ihl:]
        sport, dport = struct.unpack(">HH", tcp[:4])
        payload = total - ihl - (tcp[12] >> 4) * 4
        flags = "".join(c for c, bit in zip("FSRPA", [1, 2, 4, 8, 16]) if tcp[13] & bit)
        if (sport, dport) == (client_port[0], port):
            out.append(("rig -> broker", flags, payload))
        elif (sport, dport) == (port, client_port[0]):
            out.append(("broker -> rig", flags, payload))


def handshake(s, port, i):
    """One rig up to its welcome."""
    s.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(("GET /agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(4096)
    head, _, rest = buf.partition(b"\r\n\r\n")
    if b" 101 " not in head.split(b"\r\n")[0]:
        raise SystemExit(f"no upgrade: {head!r}")
    hello = {"type": "hello", "rig_id": f"seg-{os.getpid()}-{i}", "boot_id": uuid7(),
             "version": "1"}
    s.sendall(ws_text(json.dumps(hello).encode()))
    buf = rest
    while b"welcome" not in buf:
        more = s.recv(4096)
        if not more:
            raise SystemExit("closed before the welcome")
        buf += more


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rigs", type=int, default=200)
    o = ap.parse_args()
    seen, stop, client_port = [], threading.Event(), [0]
    t = threading.Thread(target=sniff, args=(o.port, client_port, seen, stop), daemon=True)
    t.start()
    time.sleep(0.2)
    counts, socks = collections.Counter(), []
    for i in range(o.rigs):
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.bind(("127.0.0.1", 0))
        if i == 0:
            client_port[0] = s.getsockname()[1]
        handshake(s, o.port, i)
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
        counts[struct.unpack_from("<II", info, 136)] += 1
        socks.append(s)
        if i == 0:
            # Past a delayed ACK's 40 ms, then the close, for the trace.
            time.sleep(0.1)
            s.close()
            time.sleep(0.2)
    stop.set()
    t.join()
    print("the first rig's segments (close included):")
    for d, flags, n in seen:
        print(f"  {d}  {flags:5} {n} bytes")
    print("segments sent, received by each rig up to its welcome: "
          + ", ".join(f"{out}/{inn}: {c} rigs" for (out, inn), c in sorted(counts.items())))
    for s in socks:
        s.close()


if __name__ == "__main__":
    main()
