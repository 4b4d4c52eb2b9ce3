"""Linux network namespaces for the benchmarks (``ip netns``, ``tc``); everything is removed in ``finally``.

Addresses such as 10.123.0.0/24 live only inside the namespaces created here, never on the host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator


class NetnsUnavailable(RuntimeError):
    pass


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def ns_name(tag: str) -> str:
    return f"dsb{os.getpid()}{tag}"


def netns_check() -> tuple[bool, str]:
    """Whether ``ip netns add`` works here; the reason when it does not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "not root, so `ip netns add` is refused"
    if shutil.which("ip") is None:
        return False, "`ip` (iproute2) is not installed"
    name = ns_name("chk")
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        return True, ""
    except NetnsUnavailable as e:
        return False, str(e)
    finally:
        sh("ip", "netns", "del", name, check=False)


def tc_qdisc_kinds() -> dict[str, bool]:
    """Which of tbf / netem this kernel accepts (tried on a throwaway namespace's veth)."""
    out = {"tbf": False, "netem": False}
    name = ns_name("qd")
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "netns", "exec", name, "ip", "link", "add", "qa", "type", "veth", "peer", "name", "qb")
        for kind, args in (("tbf", ["tbf", "rate", "100mbit", "burst", "64kb", "latency", "100ms"]),
                           ("netem", ["netem", "delay", "10ms"])):
            r = sh("ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", "qa", "root", *args, check=False)
            out[kind] = r.returncode == 0
    except NetnsUnavailable:
        pass
    finally:
        sh("ip", "netns", "del", name, check=False)
    return out


@contextlib.contextmanager
def private_netns(tag: str) -> Iterator[str]:
    """A fresh namespace with only ``lo`` (up); yields its name; deleted on exit."""
    name = ns_name(tag)
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name
    finally:
        sh("ip", "netns", "del", name, check=False)


@contextlib.contextmanager
def star_topology(n: int, rate: str | None, subnet: str = "10.123.0") -> Iterator[list[tuple[str, str]]]:
    """``n`` peer namespaces, each joined by a veth pair to a bridge in a hub namespace.

    With ``rate`` (e.g. ``"100mbit"``), a ``tbf`` qdisc limits both directions of every peer's link:
    the peer side's egress (upload) and the bridge side's egress toward the peer (download).

    :yields: ``[(namespace, address)]`` for the peers, addresses ``{subnet}.1`` .. ``{subnet}.n``.
    """
    hub = ns_name("h")
    peers = [(ns_name(f"p{i}"), f"{subnet}.{i + 1}") for i in range(n)]
    created: list[str] = []
    try:
        sh("ip", "netns", "add", hub)
        created.append(hub)
        sh("ip", "netns", "exec", hub, "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", hub, "ip", "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(peers):
            sh("ip", "netns", "add", ns)
            created.append(ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            # create the pair inside the hub, then move the peer end: no interface ever appears on the host
            sh("ip", "netns", "exec", hub, "ip", "link", "add", f"vb{i}", "type", "veth", "peer", "name", f"vp{i}")
            sh("ip", "netns", "exec", hub, "ip", "link", "set", f"vp{i}", "netns", ns)
            sh("ip", "netns", "exec", hub, "ip", "link", "set", f"vb{i}", "master", "br0")
            sh("ip", "netns", "exec", hub, "ip", "link", "set", f"vb{i}", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", f"vp{i}")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", f"vp{i}", "up")
            if rate:
                tbf = ["tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", f"vp{i}", "root", *tbf)
                sh("ip", "netns", "exec", hub, "tc", "qdisc", "replace", "dev", f"vb{i}", "root", *tbf)
        yield peers
    finally:
        for ns in reversed(created):
            sh("ip", "netns", "del", ns, check=False)


def link_bytes(ns: str, dev: str) -> tuple[int, int] | None:
    """(rx, tx) bytes of ``dev`` inside namespace ``ns``."""
    r = sh("ip", "netns", "exec", ns, "cat", "/proc/net/dev", check=False)
    for line in r.stdout.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == dev:
            f = rest.split()
            return int(f[0]), int(f[8])
    return None
