"""Measure a link between two network namespaces: TCP round-trip time and one-stream throughput.

``python -m bench.netprobe serve HOST PORT`` serves one client; ``python -m bench.netprobe probe HOST PORT BYTES``
times 50 one-byte echoes, sends BYTES, waits for the acknowledgement and prints one JSON line. Standard library
only, so it starts in milliseconds.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time

PINGS = 50


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed")
        out += chunk
    return out


def drain(conn: socket.socket, total: int, chunk: int = 1 << 20) -> int:
    """Receive and discard up to ``total`` bytes (fewer if the sender closes); returns the count."""
    buf, got = memoryview(bytearray(chunk)), 0
    while got < total:
        n = conn.recv_into(buf)
        if n == 0:
            break
        got += n
    return got


def serve(host: str, port: int) -> None:
    with socket.create_server((host, port)) as srv:
        print("ready", flush=True)
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(PINGS):
            conn.sendall(conn.recv(1))
        drain(conn, struct.unpack("<Q", _recv_exact(conn, 8))[0])
        conn.sendall(b"k")
        conn.close()


def probe(host: str, port: int, total: int) -> dict:
    deadline = time.monotonic() + 20
    while True:
        try:
            s = socket.create_connection((host, port), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(PINGS):
        t0 = time.perf_counter()
        s.sendall(b"e")
        _recv_exact(s, 1)
        rtts.append(1000 * (time.perf_counter() - t0))
    s.sendall(struct.pack("<Q", total))
    t0 = time.perf_counter()
    s.sendall(bytes(total))
    _recv_exact(s, 1)
    seconds = time.perf_counter() - t0
    s.close()
    return {"rtt_ms_median": statistics.median(rtts), "rtt_ms_max": max(rtts), "bytes": total,
            "mbit_per_s": 8 * total / seconds / 1e6}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))), flush=True)
