#!/usr/bin/env python3
"""Kernel memory of idle TCP sockets, and TCP buffer pages with one unread message each.

Usage: measure-sockmem.py [N]   (default 9000; needs 2 * N fds split over two processes)

Opens N loopback connections (2N sockets: a client and a server process), then reads
/proc/slabinfo (root) and /proc/net/sockstat: per-socket slab growth with every socket idle,
TCP "mem" pages idle, with one unread 100-byte message on each server socket, and after the
server read them. Other processes on the host add noise to the slab deltas: run it twice.
Results from the dev machine are in docs/tuning.md ("Measured on the dev machine").
"""
import socket
import subprocess
import sys
import time


def connections_arg(argv):
    """N from the command line: a positive integer, or the usage and exit 2 (--help: exit 0)."""
    if len(argv) > 1 and argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    if len(argv) > 2 or (len(argv) == 2 and not argv[1].isdigit()) or (len(argv) == 2 and int(argv[1]) < 1):
        print("usage: measure-sockmem.py [N]   (N connections, a positive integer; default 9000)", file=sys.stderr)
        sys.exit(2)
    return int(argv[1]) if len(argv) == 2 else 9000


N = connections_arg(sys.argv)
CACHES = ["TCP", "sock_inode_cache", "filp", "dentry", "eventpoll_epi"]

SERVER = r'''
import socket, sys
n = int(sys.argv[1])
ls = socket.socket()
ls.bind(("127.0.0.1", 0)); ls.listen(4096)
print(ls.getsockname()[1], flush=True)
conns = [ls.accept()[0] for _ in range(n)]
print("accepted", flush=True)
sys.stdin.readline()
for c in conns:
    c.setblocking(False)
    try:
        while c.recv(65536):
            pass
    except BlockingIOError:
        pass
print("read", flush=True)
sys.stdin.readline()
'''


def slab():
    out = {}
    for line in open("/proc/slabinfo"):
        f = line.split()
        if f and f[0] in CACHES:
            out[f[0]] = (int(f[1]), int(f[3]))  # active objects, object size
    return out


def tcp_mem_pages():
    for line in open("/proc/net/sockstat"):
        if line.startswith("TCP:"):
            f = line.split()
            return dict(zip(f[1::2], map(int, f[2::2])))["mem"]


def main():
    base_slab, base_mem = slab(), tcp_mem_pages()
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(N)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(srv.stdout.readline())
    clients = []
    for i in range(N):
        c = socket.socket()
        # Spread over source addresses: one address has only the ephemeral range of ports.
        c.bind((f"127.0.{1 + i // 20000}.{2 + (i // 250) % 250}", 0))
        c.connect(("127.0.0.1", port))
        clients.append(c)
    assert srv.stdout.readline().strip() == "accepted"
    time.sleep(0.5)
    idle_slab, idle_mem = slab(), tcp_mem_pages()
    sockets = 2 * N
    print(f"{N} loopback connections = {sockets} sockets")
    for name in CACHES:
        if name in base_slab and name in idle_slab:
            grown = idle_slab[name][0] - base_slab[name][0]
            size = idle_slab[name][1]
            print(f"  {name:18} objsize {size:5}  {grown / sockets:5.2f} objects/socket"
                  f"  {grown * size / sockets:7.1f} B/socket")
    print(f"  tcp mem pages: before {base_mem}, idle {idle_mem}")
    for c in clients:
        c.send(b"x" * 100)
    time.sleep(0.5)
    queued = tcp_mem_pages()
    print(f"  one unread message per server socket: {queued} pages,"
          f" {(queued - idle_mem) / N:.2f} pages/connection")
    srv.stdin.write("go\n"); srv.stdin.flush()
    assert srv.stdout.readline().strip() == "read"
    time.sleep(0.5)
    print(f"  after the server read them: {tcp_mem_pages()} pages")
    srv.stdin.write("go\n"); srv.stdin.flush(); srv.wait()
    for c in clients:
        c.close()


if __name__ == "__main__":
    main()
