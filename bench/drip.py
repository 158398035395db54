#!/usr/bin/env python3
"""What a rig that sends its bytes one TCP segment at a time costs a broker.

Connects to a running broker's /agent as one rig (plain ws), says hello, then sends MESSAGES
events of about 60 KB (--size), each one byte per write with TCP_NODELAY, and reports the broker's CPU
(utime + stime from /proc) per byte sent. A PING carrying a marker follows, so the figure
covers every byte read.

With --tls CA_PEM (a broker started with --tls-cert/--tls-key) each byte goes in a TLS record
of its own instead, and the records go out 4,096 to a write: many records to each of the
broker's reads, the case a per-read charge alone does not see.

usage: bench/drip.py --port PORT --pid BROKER_PID [--messages 3] [--size 60000] [--tls CA_PEM]
Run two brokers side by side (one build each, same flags: --cores 1) and compare medians of
a few rounds; docs/protocol.md ("fairness") quotes such a comparison.
"""
import argparse, json, os, socket, ssl, struct, time, uuid


class Plain:
    def __init__(self, s):
        self.s = s

    def send(self, data):
        self.s.sendall(data)

    def drip(self, data):
        for k in range(len(data)):
            self.s.send(data[k:k + 1])

    def recv(self):
        return self.s.recv(65536)


class Tls:
    """TLS through memory BIOs, so that each write can be a record of its own."""

    def __init__(self, s, ca):
        ctx = ssl.create_default_context(cafile=ca)
        self.s, self.inc, self.out = s, ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.inc, self.out, server_hostname='localhost')
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.flush()
                self.inc.write(self.s.recv(65536))
        self.flush()

    def flush(self):
        data = self.out.read()
        if data:
            self.s.sendall(data)

    def send(self, data):
        self.obj.write(data)
        self.flush()

    def drip(self, data):
        for k in range(0, len(data), 4096):
            for b in data[k:k + 4096]:
                self.obj.write(bytes([b]))
            self.flush()

    def recv(self):
        while True:
            try:
                return self.obj.read(65536)
            except ssl.SSLWantReadError:
                chunk = self.s.recv(65536)
                if not chunk:
                    return b''
                self.inc.write(chunk)


def cpu(pid):
    f = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf('SC_CLK_TCK')


def frame(op, payload):
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        head = struct.pack('!BB', 0x80 | op, 0x80 | n)
    elif n < 65536:
        head = struct.pack('!BBH', 0x80 | op, 0x80 | 126, n)
    else:
        head = struct.pack('!BBQ', 0x80 | op, 0x80 | 127, n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def read_frame(s, buf):
    while True:
        if len(buf) >= 2:
            n, at = buf[1] & 0x7F, 2
            if n == 126 and len(buf) >= 4:
                n, at = struct.unpack('!H', buf[2:4])[0], 4
            elif n == 127 and len(buf) >= 10:
                n, at = struct.unpack('!Q', buf[2:10])[0], 10
            if n < 126 or at > 2:
                if len(buf) >= at + n:
                    return buf[0] & 0x0F, bytes(buf[at:at + n]), buf[at + n:]
        chunk = s.recv()
        if not chunk:
            raise SystemExit('the broker closed the connection')
        buf += chunk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--port', type=int, required=True)
    ap.add_argument('--pid', type=int, required=True)
    ap.add_argument('--messages', type=int, default=3)
    ap.add_argument('--tls', metavar='CA_PEM')
    ap.add_argument('--size', type=int, default=60000, help="each event's data, in bytes")
    a = ap.parse_args()
    sock = socket.create_connection(('127.0.0.1', a.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s = Tls(sock, a.tls) if a.tls else Plain(sock)
    s.send(b'GET /agent HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n'
              b'Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n')
    buf = bytearray()
    while b'\r\n\r\n' not in buf:
        buf += s.recv()
    buf = buf.split(b'\r\n\r\n', 1)[1]
    boot = str(uuid.UUID(int=(int(time.time() * 1000) << 80) | (0x7 << 76) | (0x2 << 62)))
    hello = {'type': 'hello', 'rig_id': 'rig-drip', 'boot_id': boot, 'version': 'drip'}
    s.send(frame(1, json.dumps(hello).encode()))
    _, welcome, buf = read_frame(s, buf)
    assert b'welcome' in welcome, welcome
    msg = frame(1, json.dumps({'type': 'event', 'name': 'drip', 'data': 'a' * a.size}).encode())
    c0, t0, n = cpu(a.pid), time.time(), 0
    for _ in range(a.messages):
        s.drip(msg)
        n += len(msg)
    s.send(frame(9, b'drip-done'))
    while True:
        op, payload, buf = read_frame(s, buf)
        if op == 10 and payload == b'drip-done':
            break
    dc = cpu(a.pid) - c0
    unit = 'TLS record, 4,096 records a write' if a.tls else 'segment'
    wall = time.time() - t0
    print(f'{n} bytes one per {unit}: broker cpu {dc * 1000:.0f} ms = {dc * 1e9 / n:.0f} ns/byte, '
          f'wall {wall:.2f} s, broker cpu {dc / wall * 100:.0f}% of a core meanwhile')


if __name__ == '__main__':
    main()
