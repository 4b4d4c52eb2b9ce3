"""Bandwidth caps on a real link (issue 39): a capped peer's averaging traffic stays within its cap, and its
rounds verify.

Three real ``diloco-node join`` processes, each in its own network namespace on a bridge (tests/natlib.py
``star_topology``, no ``tc`` limit: the only limit is the node's own ``--max-upload-mbps`` /
``--max-download-mbps``). A sampler inside the capped node's namespace reads its link's byte counters every
0.1 s, so the rate is what left and entered that machine, the libp2p daemon's buffering included.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from natlib import netns_check, star_topology
from swarmlib import Swarm, verified_digests

pytestmark = [pytest.mark.swarm]
_ok, _why = netns_check()
if not _ok:
    pytestmark.append(pytest.mark.skip(reason=f"network namespaces unavailable: {_why}"))

CAP_MBPS = 4.0
WINDOW_S = 4.0  # a round's transfers at the cap last ~7 s each way; a part of 2^17 int8 values (131 kB) is 0.26 s
OUTER_STEPS = 4
# llama-tiny with the byte tokenizer: a 3.3 MB int8 Δ, so the capped peer's share of a round is seconds at its cap
ARGS = ["--host", "0.0.0.0", "--public", "--model", "llama-tiny", "--tokenizer", "byte", "--inner-steps", "6",
        "--batch-size", "2", "--seq-len", "32", "--wait-for-peers", "3", "--max-outer-steps", str(OUTER_STEPS),
        "--averaging-window", "60", "--allreduce-timeout", "20"]
CAPS = ["--max-upload-mbps", str(CAP_MBPS), "--max-download-mbps", str(CAP_MBPS)]

SAMPLER = """
import sys, time
dev = sys.argv[1]
def read(kind):
    with open(f"/sys/class/net/{dev}/statistics/{kind}_bytes") as f:
        return int(f.read())
while True:
    print(f"{time.monotonic():.3f} {read('tx')} {read('rx')}", flush=True)
    time.sleep(0.1)
"""


def _peak_rates(samples: list[tuple[float, int, int]], window_s: float) -> tuple[float, float]:
    """The highest (upload, download) rate in Mbit/s over any ``window_s`` of the samples (t, tx, rx)."""
    best_tx = best_rx = 0.0
    j = 0
    for i, (t, tx, rx) in enumerate(samples):
        while samples[j][0] < t - window_s:
            j += 1
        t0, tx0, rx0 = samples[j]
        if t - t0 >= 0.9 * window_s:
            best_tx = max(best_tx, (tx - tx0) * 8 / 1e6 / (t - t0))
            best_rx = max(best_rx, (rx - rx0) * 8 / 1e6 / (t - t0))
    return best_tx, best_rx


@pytest.mark.timeout(420)
def test_a_capped_peers_traffic_stays_within_its_cap_and_its_rounds_verify(tmp_path):
    with star_topology(3, None, subnet="10.125.0") as peers:
        (ns0, addr0), (ns1, _), (ns2, _) = peers
        sampler = subprocess.Popen(["ip", "netns", "exec", ns2, sys.executable, "-c", SAMPLER, "vp2"],
                                   stdout=subprocess.PIPE, text=True)
        try:
            with Swarm(tmp_path, "caps", ARGS) as swarm:
                first = swarm.start("open-0", wrap=["ip", "netns", "exec", ns0], timeout=240)
                swarm.start("open-1", wrap=["ip", "netns", "exec", ns1], initial=first, initial_host=addr0)
                capped = swarm.start("capped", *CAPS, wrap=["ip", "netns", "exec", ns2], initial=first,
                                     initial_host=addr0)
                nodes = list(swarm.nodes.values())
                codes = {n.name: swarm.wait_exit(n, 300) for n in nodes}
        finally:
            sampler.terminate()
            out, _ = sampler.communicate(timeout=10)
    assert codes == {n.name: 0 for n in nodes}, {n.name: n.output()[-1500:] for n in nodes}
    samples = [(float(t), int(tx), int(rx)) for t, tx, rx in (line.split() for line in out.splitlines())]
    (tmp_path / "link.txt").write_text(out)
    peak_up, peak_down = _peak_rates(samples, WINDOW_S)
    print(f"capped peer: peak {peak_up:.2f} Mbit/s up, {peak_down:.2f} down over {WINDOW_S:g} s (cap {CAP_MBPS:g})")
    sent = sum(r.get("bytes_sent") or 0 for r in capped.outer_steps())
    print(f"link bytes per payload byte sent: {(samples[-1][1] - samples[0][1]) / max(sent, 1):.3f}")
    assert peak_up <= 1.1 * CAP_MBPS, f"the capped peer sent {peak_up:.2f} Mbit/s over {WINDOW_S:g} s (cap {CAP_MBPS:g})"
    assert peak_down <= 1.1 * CAP_MBPS, f"it received {peak_down:.2f} Mbit/s over {WINDOW_S:g} s (cap {CAP_MBPS:g})"
    # and the cap is what limits it: its rounds move their bytes at close to the cap, not at a trickle
    assert peak_up >= 0.6 * CAP_MBPS, f"the capped peer's rounds moved at most {peak_up:.2f} Mbit/s (cap {CAP_MBPS:g})"

    # its rounds verify, as the others' do: none failed for the cap, and all members hold one θ_global
    for node in nodes:
        rounds = [r for r in node.outer_steps() if (r.get("group_size") or 0) >= 2]
        assert rounds and all(r["round_ok"] for r in rounds), (
            node.name, [(r["outer_step"], r.get("round_ok"), r.get("reason")) for r in node.outer_steps()])
    common = {step: held for step, held in verified_digests(nodes).items() if len(held) == len(nodes)}
    assert common, "no outer step that every peer verified"
    assert all(len(set(held.values())) == 1 for held in common.values()), common
    up_share = [sum(r.get("bytes_sent") or 0 for r in n.outer_steps()) for n in nodes]
    assert up_share[2] < min(up_share[:2]), f"the capped peer reduced as large a slice as the others: {up_share}"
