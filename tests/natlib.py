"""Linux network namespaces for the NAT tests and the benchmarks (``ip netns``, ``tc``, ``iptables``).

``nat_topology`` (tests/test_nat.py), home routers::

    public hosts         pub1 10.77.0.1   pub2 10.77.0.2        (one bridge: "the internet")
    home routers         r1 WAN 10.77.0.11                r2 WAN 10.77.0.12
                          | MASQUERADE, drops new inbound   | (each its own NAT: one shared NAT
    home PCs             nat1 192.168.11.2                nat2 192.168.12.2      would hide the problem)

The public side has no route to 192.168.x and the routers drop unsolicited inbound traffic, so
a home PC can dial out but nobody can dial it. ``star_topology`` (bench netns and overlap): peers
joined by veth pairs to a bridge in a hub namespace, optionally behind ``tc tbf``. Every address
lives only inside namespaces made here; all of them are deleted on exit, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterator

PUBLIC = {"pub1": "10.77.0.1", "pub2": "10.77.0.2"}
HOMES = {"nat1": ("10.77.0.11", "192.168.11"), "nat2": ("10.77.0.12", "192.168.12")}


class NetnsUnavailable(RuntimeError):
    pass


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


@dataclass
class Host:
    name: str
    netns: str
    address: str  # the host's own address (a private one for a home PC)

    def wrap(self) -> list[str]:
        """Command prefix that runs a program inside this host."""
        return ["ip", "netns", "exec", self.netns]


@contextlib.contextmanager
def _namespaces(tag: str) -> Iterator:
    """``add(name)``: a fresh namespace ``{tag}{name}`` with ``lo`` up; all of them are deleted on exit."""
    created: list[str] = []

    def add(name: str) -> str:
        full = f"{tag}{name}"
        sh("ip", "netns", "add", full)
        created.append(full)
        sh("ip", "netns", "exec", full, "ip", "link", "set", "lo", "up")
        return full

    try:
        yield add
    finally:
        for netns in reversed(created):
            sh("ip", "netns", "del", netns, check=False)


def _run(netns: str, *args: str) -> None:
    sh("ip", "netns", "exec", netns, *args)


def _bridge(add) -> str:
    hub = add("hub")
    _run(hub, "ip", "link", "add", "br0", "type", "bridge")
    _run(hub, "ip", "link", "set", "br0", "up")
    return hub


def _plug(hub: str, i: int, netns: str, dev: str, addr: str) -> None:
    """A veth pair from the hub's bridge (``vb{i}``) to ``dev`` in ``netns``, created inside the hub and
    moved: no interface ever appears on the host."""
    _run(hub, "ip", "link", "add", f"vb{i}", "type", "veth", "peer", "name", dev)
    _run(hub, "ip", "link", "set", dev, "netns", netns)
    _run(hub, "ip", "link", "set", f"vb{i}", "master", "br0")
    _run(hub, "ip", "link", "set", f"vb{i}", "up")
    _run(netns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
    _run(netns, "ip", "link", "set", dev, "up")


def netns_check() -> tuple[bool, str]:
    """Whether ``ip netns add`` works here; the reason when it does not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "not root, so `ip netns add` is refused"
    if shutil.which("ip") is None:
        return False, "`ip` (iproute2) is not installed"
    try:
        with _namespaces(f"dsb{os.getpid()}") as add:
            add("chk")
        return True, ""
    except NetnsUnavailable as e:
        return False, str(e)


def unavailable_reason() -> str | None:
    """Why the NAT tests cannot run here (skip reason), or None."""
    ok, why = netns_check()
    if not ok:
        return f"network namespaces unavailable: {why}"
    if shutil.which("iptables") is None:
        return "iptables is not installed (Debian package iptables; .ci/run installs it)"
    return None


def tc_qdisc_kinds() -> dict[str, bool]:
    """Which of tbf / netem this kernel accepts (tried on a throwaway namespace's veth)."""
    out = {"tbf": False, "netem": False}
    with contextlib.suppress(NetnsUnavailable), _namespaces(f"dsb{os.getpid()}") as add:
        name = add("qd")
        _run(name, "ip", "link", "add", "qa", "type", "veth", "peer", "name", "qb")
        for kind, args in (("tbf", ["tbf", "rate", "100mbit", "burst", "64kb", "latency", "100ms"]),
                           ("netem", ["netem", "delay", "10ms"])):
            r = sh("ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", "qa", "root", *args, check=False)
            out[kind] = r.returncode == 0
    return out


@contextlib.contextmanager
def private_netns(tag: str) -> Iterator[str]:
    """A fresh namespace with only ``lo`` (up); yields its name."""
    with _namespaces(f"dsb{os.getpid()}") as add:
        yield add(tag)


@contextlib.contextmanager
def star_topology(n: int, rate: str | None, subnet: str = "10.123.0",
                  up_rate: str | None = None) -> Iterator[list[tuple[str, str]]]:
    """``n`` peer namespaces on a hub's bridge; with ``rate`` (e.g. ``"100mbit"``) a ``tbf`` qdisc limits both
    directions of every peer's link (the peer's egress: upload; the bridge port's egress: download);
    ``up_rate`` (e.g. ``"20mbit"``) limits the upload alone instead, as a home link's.

    :yields: ``[(namespace, address)]``, addresses ``{subnet}.1`` .. ``{subnet}.n``, the devices ``vp0`` ...
    """
    with _namespaces(f"dsb{os.getpid()}") as add:
        hub = _bridge(add)
        peers = [(add(f"p{i}"), f"{subnet}.{i + 1}") for i in range(n)]
        for i, (ns, addr) in enumerate(peers):
            _plug(hub, i, ns, f"vp{i}", addr)
            if rate:
                tbf = ["tbf", "rate", rate, "burst", "64kb", "latency", "100ms"]
                up = ["tbf", "rate", up_rate, "burst", "64kb", "latency", "100ms"] if up_rate else tbf
                _run(ns, "tc", "qdisc", "replace", "dev", f"vp{i}", "root", *up)
                _run(hub, "tc", "qdisc", "replace", "dev", f"vb{i}", "root", *tbf)
        yield peers


def star_link_bytes(peers: list[tuple[str, str]]) -> list[tuple[int, int]]:
    """(rx, tx) bytes so far of each peer's link of a :func:`star_topology` ((0, 0) when unreadable)."""
    out = []
    for i, (ns, _) in enumerate(peers):
        r = sh("ip", "netns", "exec", ns, "cat", "/proc/net/dev", check=False)
        f = next((line.partition(":")[2].split() for line in r.stdout.splitlines()
                  if line.partition(":")[0].strip() == f"vp{i}"), None)
        out.append((int(f[0]), int(f[8])) if f else (0, 0))
    return out


@contextlib.contextmanager
def nat_topology() -> Iterator[dict[str, Host]]:
    """Two public hosts and two home PCs behind separate NAT routers (see the module docstring)."""
    with _namespaces(f"dst{os.getpid() % 100000}") as add:
        hub = _bridge(add)
        wan_hosts = [(name, addr) for name, addr in PUBLIC.items()] + [(f"r{n[-1]}", w) for n, (w, _) in HOMES.items()]
        spaces: dict[str, str] = {}
        for i, (name, addr) in enumerate(wan_hosts):
            spaces[name] = add(name)
            _plug(hub, i, spaces[name], "wan", addr)
        for home, (_, lan) in HOMES.items():
            router, pc = spaces[f"r{home[-1]}"], add(home)
            spaces[home] = pc
            _run(router, "ip", "link", "add", "lan", "type", "veth", "peer", "name", "eth0")
            _run(router, "ip", "link", "set", "eth0", "netns", pc)
            _run(router, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan")
            _run(router, "ip", "link", "set", "lan", "up")
            _run(pc, "ip", "addr", "add", f"{lan}.2/24", "dev", "eth0")
            _run(pc, "ip", "link", "set", "eth0", "up")
            _run(pc, "ip", "route", "add", "default", "via", f"{lan}.1")
            _run(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            _run(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack",
                 "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _run(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
        hosts = {name: Host(name, spaces[name], addr) for name, addr in PUBLIC.items()}
        hosts.update({home: Host(home, spaces[home], f"{lan}.2") for home, (_, lan) in HOMES.items()})
        yield hosts
