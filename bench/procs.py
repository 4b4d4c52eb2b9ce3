"""Process trees of running nodes (the churn bench and the churn tests kill whole peers).

A node is several processes: the main one, forked hivemind DHT and averager processes, and a
p2pd daemon. A crash of the whole peer (machine down, container killed) kills all of them.
"""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants, parents first (read from /proc; Linux only).
    ``[pid]`` alone if it has no children or has already exited."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name in (...) may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    tree, i = [pid], 0
    while i < len(tree):
        tree.extend(children.get(tree[i], []))
        i += 1
    return tree


def pids_mentioning(text: str) -> list[int]:
    """Live processes (other than this one) whose command line contains ``text``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            out.append(int(entry.name))
    return out


def cpu_seconds(pids: list[int]) -> dict[int, tuple[str, float]]:
    """{pid: (comm, user + system CPU seconds so far)} for the live ones of ``pids`` (/proc/PID/stat)."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[pid] = (Path(f"/proc/{pid}/comm").read_text().strip(), (int(fields[11]) + int(fields[12])) / TICK)
        except OSError:
            continue
    return out


def pss_bytes(pids: list[int]) -> dict[int, tuple[str, int]]:
    """{pid: (comm, proportional set size in bytes)} for the live ones of ``pids``
    (/proc/PID/smaps_rollup: pages shared by N processes count 1/N in each, so a tree's sum
    is what it holds of the machine's memory)."""
    out = {}
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        kb = next((int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")), None)
        if kb is not None:
            out[pid] = (comm, kb * 1024)
    return out
