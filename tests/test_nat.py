"""Home PCs behind NAT (issue: client mode, reachability detection, round integrity).

Real ``diloco-node join`` processes, each in its own network namespace (tests/natlib.py: two
public hosts, two home PCs behind separate MASQUERADE routers). Every node saves what it
contributed and what it applied in each round (``python -m tests.faults join ... --fault dump-rounds``, in STATE_DIR/rounds), so the tests
compare each peer's applied pseudo-gradient with the true token-weighted mean of its group's
contributions, each part as the reducers' robust rule combines it: an ok round must apply exactly that
mean (int8 on the wire), and so must a round that failed only for want of confirmations (the average
the others keep); any other failed round must apply the peer's own Δ or nothing (a late round: its Δ
is carried into the next round), and nothing else is allowed.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import product
from pathlib import Path

import pytest
import torch

from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

from diloco_swarm.averaging.codec import Int8BlockwiseCodec, roundtrip
from diloco_swarm.averaging.robust import capped_weights, skipped_mean
from natlib import nat_topology, unavailable_reason
from swarmlib import Swarm

pytestmark = [pytest.mark.swarm]
_why = unavailable_reason()
if _why:
    pytestmark.append(pytest.mark.skip(reason=_why))

# An ok round's error against the true mean may exceed that of the same Δs quantized the way the
# round does (each member's Δ once, then the average once: `_int8_error` below) by this
# factor. Measured: 0.95-0.99x. A fixed share of the mean's norm was not a bound: int8 error scales with
# the blocks' absmax, and the mean shrinks when members' Δs point apart (CI saw 0.035 where 0.008 is usual).
INT8_SLACK = 2.0
# Blocking sync mode: these tests stage who enters matchmaking first (test (b)); the rounds they check
# are the same in both modes, and overlapped rounds are tested on 127.0.0.1 (tests/test_overlap.py).
BASE_ARGS = ["--host", "0.0.0.0", "--wait-for-peers", "4", "--sync-mode", "blocking"]
NODE_ARGS = [*BASE_ARGS, "--max-outer-steps", "3"]
FORCED_STEPS = 3  # test (b)


def _rounds(dump_dir: Path) -> list[dict]:
    """The round dumps of every node of a swarm whose state dirs are under ``dump_dir``."""
    return [torch.load(p, weights_only=True) for p in sorted(dump_dir.glob("*/rounds/*.pt"))]


def _kept_senders(applied: torch.Tensor, raw: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(which senders a reducer's skipped mean kept for one part, the value it made of them), ``raw``
    ``[n_senders, numel]`` the senders' Δs of that part and ``applied`` ``[numel]`` what the round applied.

    The reducer combines the others' decoded parts with its own as it holds it, unquantized
    (``allreduce.ConsensusAllReduceRunner._communicate_with_peer``), so a decision right at τ may depend on
    which member reduced the part, which the dumps do not say: every member is tried as the reducer, and the
    outcome closest to ``applied`` is the one checked.
    """
    decoded = torch.stack([roundtrip(x) for x in raw])
    outcomes = []
    for reducer in range(raw.shape[0]):
        as_held = decoded.clone()
        as_held[reducer] = raw[reducer]
        outcomes.append(skipped_mean(as_held, weights))
    best = min(outcomes, key=lambda o: float((o.value - applied).norm()))
    return ~torch.tensor(best.outliers), best.value


def _int8_error(applied: list[torch.Tensor], members: list[dict], robust: bool) -> tuple[float, float]:
    """(||applied − true mean||, the same for the members' Δs quantized as a round does), both over
    ||true mean||. ``members``: their round dumps.

    ``robust``: the reducers combine each part with the skipped mean (``averaging/robust.py``): the weighted
    mean of the senders' parts less any it leaves out as outliers. An honest part is left out now and then:
    a 128-value LayerNorm gain, where few senders' distances vary widely (docs/decisions.md, *Robust
    aggregation*). The true mean of a part is then the weighted mean of the kept senders' Δs, and the
    quantized one ``roundtrip(skipped_mean(roundtrip(Δᵢ)))``. A part is a whole tensor here: hivemind never
    splits a part across tensors, and every tensor of ``tiny`` is below a part's size (checked). Otherwise
    (``--fault plain-mean``) every sender is kept: ``roundtrip(Σ w·roundtrip(Δᵢ) / Σ w)``.
    """
    weights = torch.tensor([float(m["weight"]) for m in members], dtype=torch.float64)
    if robust:
        weights = capped_weights(weights)
    part_values = int(DEFAULT_PART_SIZE_BYTES / (4 * Int8BlockwiseCodec().estimate_compression_ratio(None)))
    true_parts, quantized_parts = [], []
    for mine, *tensors in zip(applied, *(m["local"] for m in members)):
        raw = torch.stack([t.flatten().float() for t in tensors])
        assert raw.shape[1] <= part_values, f"a tensor of {raw.shape[1]} values spans several parts"
        if robust:
            kept, value = _kept_senders(mine.flatten().float(), raw, weights)
        else:
            kept = torch.ones(len(members), dtype=torch.bool)
            value = (weights / weights.sum()).float() @ torch.stack([roundtrip(x) for x in raw])
        true_parts.append((weights[kept] / weights[kept].sum()).float() @ raw[kept])
        quantized_parts.append(value)
    mean, quantized = torch.cat(true_parts), roundtrip(torch.cat(quantized_parts))
    flat_applied = torch.cat([t.flatten().float() for t in applied])
    scale = max(float(mean.norm()), 1e-30)
    return float((flat_applied - mean).norm()) / scale, float((quantized - mean).norm()) / scale


def check_rounds(dump_dir: Path, robust: bool = True) -> tuple[list[dict], list[dict]]:
    """Every ok round applied the true weighted mean of its whole group's contributions, each part as the
    reducers combine it (``robust``: the skipped mean; else ``--fault plain-mean``'s weighted mean), the same
    bytes on every member that kept it; every other round applied the peer's own Δ, or nothing
    when it was late (θ_global kept, Δ carried into the next round).

    A member that missed a confirmation while no member contradicted its digest (``maybe_kept``)
    applied the round's average, the one the members that heard every confirmation keep: it is held
    to the same check. Such a round may have a member whose node never saw it: its averager process
    joined with a Δ its node had already given up on (CI saw one 15 s later); that member's
    contribution is then one of its dumped Δs. :returns: (ok rounds, failed rounds with a group).
    """
    rounds = _rounds(dump_dir)
    assert rounds, f"no round was dumped in {dump_dir}"
    by_round = defaultdict(dict)  # hivemind group id -> {peer: its dump of that round}
    for r in rounds:
        if r["group_id"]:
            by_round[r["group_id"]][r["peer_id"]] = r
        if not r["ok"] and not r.get("maybe_kept"):
            assert r["late"] or len(r["applied"]) == len(r["local"]), r
            assert not (r["late"] and r["applied"]), f"late round of {r['peer_id']} applied something"
            for applied, local in zip(r["applied"], r["local"]):
                assert torch.equal(applied, local), f"failed round of {r['peer_id']} applied something else"
    for group_id, dumps in by_round.items():
        kept = [d for d in dumps.values() if d["ok"] or d.get("maybe_kept")]
        if not kept:
            continue
        group = kept[0]["group"]
        missing = set(group) - set(dumps)
        assert not (missing and any(d["ok"] for d in kept)), f"round {group_id}: no dump of members {missing}"
        for other in kept[1:]:
            assert all(torch.equal(x, y) for x, y in zip(kept[0]["applied"], other["applied"])), f"{group_id}: differ"
        candidates = [[dumps[p]] if p in dumps else [r for r in rounds if r["peer_id"] == p] for p in group]
        assert all(candidates), f"round {group_id}: no dump at all of a member of {group}"
        error, expected = min((_int8_error(kept[0]["applied"], list(members), robust) for members in product(*candidates)),
                              key=lambda e: e[0] / e[1])
        members = [dumps.get(p, {"weight": "?", "outer_step": "?"}) for p in group]
        assert error <= INT8_SLACK * expected, (
            f"round {group_id}: the average is not the true mean: error {error:.4f} of its norm, int8 alone "
            f"{expected:.4f}; weights {[m['weight'] for m in members]}, outer steps {[m['outer_step'] for m in members]}")
    failed = [r for r in rounds if not r["ok"] and len(r["group"]) >= 2]
    return [r for r in rounds if r["ok"]], failed


def _reachability(node) -> dict:
    events = node.events("reachability")
    assert events, f"{node.name} did not check its reachability\n{node.output()[-2000:]}"
    return events[-1]


@pytest.fixture
def net():
    with nat_topology() as hosts:
        yield hosts


@pytest.mark.timeout(420)
def test_nat_peers_detect_they_are_clients_and_average_exactly(tmp_path, net):
    """(a) plain `join` behind NAT detects it, runs as a client and averages exactly with the
    public peers; (d) a public host is detected as reachable and serves as a full peer."""
    dumps = tmp_path  # the nodes' state dirs
    with Swarm(tmp_path, "nat-a", extra=[*NODE_ARGS, "--fault", "dump-rounds"]) as swarm:
        pub1 = swarm.start("pub1", wrap=net["pub1"].wrap(), timeout=150)
        seed = dict(initial=pub1, initial_host=net["pub1"].address, wait_start=False)
        pub2 = swarm.start("pub2", wrap=net["pub2"].wrap(), **seed)
        nat1 = swarm.start("nat1", wrap=net["nat1"].wrap(), **seed)
        nat2 = swarm.start("nat2", wrap=net["nat2"].wrap(), **seed)
        for node in (pub1, pub2, nat1, nat2):
            assert swarm.wait_exit(node, 360) == 0, node.output()[-3000:]

        assert _reachability(pub2)["reachable"] is True  # (d)
        assert all(r["reachability"] == "public" for r in pub2.outer_steps())
        for node in (nat1, nat2):  # (a)
            verdict = _reachability(node)
            assert verdict["reachable"] is False, verdict
            assert node.output().count("unreachable:") == 1, node.output()[-3000:]
            assert all(r["reachability"] == "client" for r in node.outer_steps())

        ok, failed = check_rounds(dumps)
        # A kept round is exact and a failed one applied the peer's own Δ or held it (check_rounds). One group
        # may still fail on a loaded machine: CI once saw a reducer's half of a 2-peer round arrive
        # late ("partial round"); both peers then held their Δ (late), as they must.
        failed_groups = {r["group_id"] for r in failed}
        assert len(failed_groups) <= 1, [(r["peer_id"], r["reason"]) for r in failed] + [
            r["rejected_peers"] for n in (pub1, pub2, nat1, nat2) for r in n.outer_steps() if not r["round_ok"]]
        for node in (nat1, nat2):  # (3 outer steps; one group may fail, and a loaded client may miss another)
            mine = [r for r in node.outer_steps() if r["round_ok"]]
            assert len(mine) >= 1, node.outer_steps()
            assert all(set(r["group"]) & {pub1.events("start")[0]["peer_id"], pub2.events("start")[0]["peer_id"]}
                       for r in mine)
        assert nat1.outer_steps()[-1]["eval_loss"] < nat1.events("eval")[0]["eval_loss"]


def _forced_public_swarm(tmp_path, net, attempt: int):
    """Run test (b)'s swarm once; :returns: (the four nodes, the rounds dump dir, the NATed peer ids)."""
    # The hazard needs both NATed peers in one group with a public leader. hivemind's matchmaking
    # makes the peer that entered it first the leader; when a NATed peer was first, the others
    # lost time dialing it and one NATed peer always missed the group (seen in CI, every round).
    # So the NATed peers train 4x larger batches (a local flag): they enter matchmaking seconds
    # after the public ones, and join a public leader that waits up to 10 s for all 4.
    # Their reducers take the plain weighted mean (`--fault plain-mean`, tests/faults.py): check_rounds(robust=False)
    # holds every byte to that exact mean, which the product's skipped mean (averaging/robust.py) departs from where
    # it leaves an unusual honest Δ out (a NATed peer's 4x batch a step behind: CI saw it); that rule and its
    # bit-identical result are tests/test_robust.py's. (Only here: these nodes are --public, and a node whose
    # averager is a fault's class cannot hand it to the DHT process for the reachability check.)
    extra = [*BASE_ARGS, "--max-outer-steps", str(FORCED_STEPS), "--matchmaking-time", "10",
             "--fault", "dump-rounds", "--fault", "plain-mean"]
    slow = ["--public", "--batch-size", "16"]
    root = dumps = tmp_path / f"attempt{attempt}"  # (the nodes' state dirs: their round dumps)
    root.mkdir()
    with Swarm(root, f"nat-b{attempt}", extra=extra) as swarm:
        pub1 = swarm.start("pub1", wrap=net["pub1"].wrap(), timeout=150)
        seed = dict(initial=pub1, initial_host=net["pub1"].address, wait_start=False)
        pub2 = swarm.start("pub2", wrap=net["pub2"].wrap(), **seed)
        nat1 = swarm.start("nat1", *slow, wrap=net["nat1"].wrap(), **seed)
        nat2 = swarm.start("nat2", *slow, wrap=net["nat2"].wrap(), **seed)
        for node in (pub1, pub2, nat1, nat2):
            assert swarm.wait_exit(node, 420) == 0, node.output()[-3000:]
    return (pub1, pub2, nat1, nat2), dumps, {nat1.events("start")[0]["peer_id"], nat2.events("start")[0]["peer_id"]}


@pytest.mark.timeout(900)
def test_nat_peers_forced_public_never_keep_a_wrong_average(tmp_path, net):
    """(b) two NATed hosts forced to --public: affected rounds are reported as failed, and no
    peer continues with anything but the true group mean or its own Δ."""
    for attempt in (1, 2, 3):
        nodes, dumps, nat_ids = _forced_public_swarm(tmp_path, net, attempt)
        ok, failed = check_rounds(dumps, robust=False)  # (--fault plain-mean) every attempt's rounds must hold, whether or not the NATed pair met
        together = [r for r in _rounds(dumps) if nat_ids <= set(r["group"])]
        # The meeting is staged, not guaranteed: a peer that cannot be reached is found gone once it is late
        # for its group (node/redial.py: ProbePeers), so the pair meets only when both are on time. CI once saw
        # the first round begin without one of them, and the pair never met again. A second swarm then
        # stages it again: only the staging is retried, never the checks. Under a full CI run's load the pair
        # missed each other twice in a row once (each NATed peer averaged with the two public ones, in groups
        # of 3), and met in the first attempt alone: a third staging.
        if together:
            break
    assert together, "the two NATed full peers never met in a group, three times: " + str(
        [(r["peer_id"][-6:], [g[-6:] for g in r["group"]], r["ok"]) for r in _rounds(dumps)])
    assert not [r for r in together if r["ok"]], "a group of two unreachable full peers was kept"
    assert failed
    for node in nodes:
        records = node.outer_steps()
        assert records and (records[-1]["synced_to"] or records[-1]["outer_step"]) == FORCED_STEPS, (node.name, records)
        reported = [r for r in records if not r["round_ok"] and r["group_size"] >= 2]
        assert records[-1]["failed_rounds"] == len(reported)
    assert sum(n.outer_steps()[-1]["failed_rounds"] for n in nodes) == len(failed)


@pytest.mark.timeout(300)
def test_only_clients_go_solo_with_one_warning(tmp_path, net):
    """(c) a swarm of client peers (its only public member is a plain DHT node, no trainer):
    each goes solo at once, warns once, and keeps training."""
    import os
    import signal
    import subprocess
    import sys
    import time

    boot_log = tmp_path / "boot.log"
    with open(boot_log, "w") as log:
        # a plain DHT node, no trainer (hivemind.DHT through our start_dht, relays off)
        script = ("import time; from diloco_swarm.dht.swarm import start_dht; "
                  "dht = start_dht(initial_peers=[], host='0.0.0.0', port=31400); "
                  "print(*dht.get_visible_maddrs(latest=True), flush=True); time.sleep(3600)")
        boot = subprocess.Popen([*net["pub1"].wrap(), sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while "/p2p/" not in boot_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        peer_id = boot_log.read_text().split("/p2p/")[1].split()[0]
        boot_addr = f"/ip4/{net['pub1'].address}/tcp/31400/p2p/{peer_id}"
        window = 20.0
        with Swarm(tmp_path, "nat-c", extra=["--host", "0.0.0.0", "--max-outer-steps", "3", "--client-mode",
                                             "--averaging-window", str(window), "--initial-peers", boot_addr]) as swarm:
            nat1 = swarm.start("nat1", wrap=net["nat1"].wrap(), wait_start=False)
            nat2 = swarm.start("nat2", wrap=net["nat2"].wrap(), wait_start=False)
            for node in (nat1, nat2):
                assert swarm.wait_exit(node, 240) == 0, node.output()[-3000:]
                records = node.outer_steps()
                assert [r["outer_step"] for r in records] == [1, 2, 3]
                for r in records:
                    assert r["group_size"] == 1 and not r["round_ok"] and "no public peer" in r["reason"], r
                    assert r["averaging_s"] < window
                assert node.output().count("no public peer in the swarm") == 1, node.output()[-3000:]
                assert records[-1]["solo_rounds"] == 3 and records[-1]["failed_rounds"] == 0
    finally:
        os.killpg(boot.pid, signal.SIGKILL)  # with its DHT process and p2pd daemon
        boot.wait(timeout=30)
