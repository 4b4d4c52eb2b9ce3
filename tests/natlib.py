"""Home-router topologies in Linux network namespaces, for the NAT tests (tests/test_nat.py).

    public hosts         pub1 10.77.0.1   pub2 10.77.0.2        (one bridge: "the internet")
    home routers         r1 WAN 10.77.0.11                r2 WAN 10.77.0.12
                          | MASQUERADE, drops new inbound   | (each its own NAT: one shared NAT
    home PCs             nat1 192.168.11.2                nat2 192.168.12.2      would hide the problem)

The public side has no route to 192.168.x and the routers drop unsolicited inbound traffic, so
a home PC can dial out but nobody can dial it. Every address lives only inside namespaces made
here; all of them are deleted on exit, also on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from typing import Iterator

from bench.netutil import NetnsUnavailable, netns_check, sh

PUBLIC = {"pub1": "10.77.0.1", "pub2": "10.77.0.2"}
HOMES = {"nat1": ("10.77.0.11", "192.168.11"), "nat2": ("10.77.0.12", "192.168.12")}


@dataclass
class Host:
    name: str
    netns: str
    address: str  # the host's own address (a private one for a home PC)

    def wrap(self) -> list[str]:
        """Command prefix that runs a program inside this host."""
        return ["ip", "netns", "exec", self.netns]


def unavailable_reason() -> str | None:
    """Why these tests cannot run here (skip reason), or None."""
    ok, why = netns_check()
    if not ok:
        return f"network namespaces unavailable: {why}"
    if shutil.which("iptables") is None:
        return "iptables is not installed (Debian package iptables; .ci/run installs it)"
    return None


@contextlib.contextmanager
def nat_topology() -> Iterator[dict[str, Host]]:
    """Two public hosts and two home PCs behind separate NAT routers (see the module docstring)."""
    tag = f"dst{os.getpid() % 100000}"
    created: list[str] = []

    def ns(name: str) -> str:
        full = f"{tag}{name}"
        sh("ip", "netns", "add", full)
        created.append(full)
        sh("ip", "netns", "exec", full, "ip", "link", "set", "lo", "up")
        return full

    def run(netns: str, *args: str) -> None:
        sh("ip", "netns", "exec", netns, *args)

    try:
        hub = ns("hub")
        run(hub, "ip", "link", "add", "br0", "type", "bridge")
        run(hub, "ip", "link", "set", "br0", "up")
        wan_hosts = [(name, addr) for name, addr in PUBLIC.items()] + [(f"r{n[-1]}", w) for n, (w, _) in HOMES.items()]
        spaces: dict[str, str] = {}
        for i, (name, addr) in enumerate(wan_hosts):
            spaces[name] = ns(name)
            run(hub, "ip", "link", "add", f"vb{i}", "type", "veth", "peer", "name", "wan")
            run(hub, "ip", "link", "set", "wan", "netns", spaces[name])
            run(hub, "ip", "link", "set", f"vb{i}", "master", "br0")
            run(hub, "ip", "link", "set", f"vb{i}", "up")
            run(spaces[name], "ip", "addr", "add", f"{addr}/24", "dev", "wan")
            run(spaces[name], "ip", "link", "set", "wan", "up")
        for home, (_, lan) in HOMES.items():
            router, pc = spaces[f"r{home[-1]}"], ns(home)
            spaces[home] = pc
            run(router, "ip", "link", "add", "lan", "type", "veth", "peer", "name", "eth0")
            run(router, "ip", "link", "set", "eth0", "netns", pc)
            run(router, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan")
            run(router, "ip", "link", "set", "lan", "up")
            run(pc, "ip", "addr", "add", f"{lan}.2/24", "dev", "eth0")
            run(pc, "ip", "link", "set", "eth0", "up")
            run(pc, "ip", "route", "add", "default", "via", f"{lan}.1")
            run(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            run(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            run(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack",
                "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            run(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
        hosts = {name: Host(name, spaces[name], addr) for name, addr in PUBLIC.items()}
        hosts.update({home: Host(home, spaces[home], f"{lan}.2") for home, (_, lan) in HOMES.items()})
        yield hosts
    finally:
        for netns in reversed(created):
            sh("ip", "netns", "del", netns, check=False)


__all__ = ["Host", "NetnsUnavailable", "nat_topology", "unavailable_reason"]
