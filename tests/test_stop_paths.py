"""Every stop path ends in seconds with the checkpoint intact (issue 14), on real nodes.

One long-lived partner and one target node, each in its own session (as a shell or systemd
starts it). The target is stopped once per cell of the signal matrix and restarted with the same
state dir; the restart is the proof that the checkpoint loads (its ``start`` event resumes from
the checkpoint's outer step). Phases are recognised from the target's metrics events and from the
markers of the faulty nodes (tests/faults.py): ``--fault stall-allreduce`` (the target hangs inside
an all-reduce) and ``--fault withhold-digest`` on the partner (it confirms the average 10 s late, so
the target waits in the digest cross-check).

The matrix is {SIGINT, SIGTERM} x {main process, process group} x {inner steps, matchmaking,
all-reduce, cross-check}, covered pairwise (8 cells: every phase gets both signals and both
targets, every signal/target pair two phases), plus SIGHUP to the group and a quick double SIGTERM.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from diloco_swarm.utils.hivemind_fixes import SOCKET_DIR_PREFIX
from swarmlib import NodeProc, checkpoint_step
from test_churn import NO_START_BARRIER, ROUND_S, START_S, ChurnSwarm, last_maddr

pytestmark = [pytest.mark.swarm]

STOP_S = 20.0  # issue 14: every stop path
INNER, MATCHMAKING, ALLREDUCE, CROSSCHECK = "inner steps", "matchmaking", "all-reduce", "cross-check"
CELLS = [  # (phase, signal, to the whole process group?)
    (INNER, signal.SIGTERM, True),
    (INNER, signal.SIGINT, False),
    (MATCHMAKING, signal.SIGINT, True),
    (MATCHMAKING, signal.SIGTERM, False),
    (ALLREDUCE, signal.SIGTERM, True),
    (ALLREDUCE, signal.SIGINT, False),
    (CROSSCHECK, signal.SIGINT, False),
    (CROSSCHECK, signal.SIGTERM, True),
    (MATCHMAKING, signal.SIGHUP, True),  # a closed terminal or ssh session
]


def events_since(node: NodeProc, n: int) -> list[dict]:
    return node.events()[n:]


def send(node: NodeProc, sig: int, group: bool) -> None:
    if group:
        os.killpg(node.proc.pid, sig)  # the node leads its own process group (Swarm.start(session=True))
    else:
        node.proc.send_signal(sig)


def reach_phase(swarm: ChurnSwarm, target: NodeProc, partner: NodeProc, phase: str, n0: int) -> None:
    """Wait until the target (restarted: its events from index ``n0`` on) is in ``phase``."""
    new = lambda kind: [e for e in events_since(target, n0) if e.get("event") == kind]  # noqa: E731
    if phase == INNER:
        swarm.wait_alive(lambda: new("eval"), START_S, "the target evaluates, then trains", (target, partner),
                         poll=0.05)
    elif phase == MATCHMAKING:
        swarm.wait_alive(lambda: new("averaging_start"), 2 * ROUND_S, "the target enters matchmaking",
                         (target, partner), poll=0.05)
        time.sleep(0.3)  # the matchmaking cells run --fault lonely: no group ever forms
    elif phase == ALLREDUCE:
        marker = target.state_dir / "allreduce-stalled"
        swarm.wait_alive(marker.exists, 2 * ROUND_S, "the target hangs inside an all-reduce", (target, partner))
    else:
        marker = partner.state_dir / "digest-withheld"
        swarm.wait_alive(marker.exists, 2 * ROUND_S, "the partner withholds its digest", (target, partner))
        time.sleep(1.0)  # the target has published its own digest and waits for the partner's


@pytest.mark.timeout(1500)
def test_every_signal_in_every_phase_stops_within_20s_with_the_checkpoint_intact(tmp_path):
    # Blocking sync mode: the phases follow each other there. Overlapped, a node trains while its round
    # runs; its stops are those of the inner phase and of the round together (tests/test_overlap.py).
    with ChurnSwarm(tmp_path, "stops", extra=["--sync-mode", "blocking"]) as swarm:
        # The partner trains on bigger batches. In the matchmaking cells the target looks for its group
        # under a key nobody else uses (--fault lonely): a group that starts as soon as both are in
        # would otherwise leave no moment in which it still looks.
        partner = swarm.start("partner", "--batch-size", "16", timeout=START_S)
        target = None
        timings = []
        for phase, sig, group in CELLS:
            if phase == CROSSCHECK and "withhold-digest" not in partner.args:
                code, _ = swarm.leave(partner)
                assert code == 0, partner.output()[-3000:]
                (partner.state_dir / "digest-withheld").unlink(missing_ok=True)
                swarm.start("partner", "--batch-size", "16", "--fault", "withhold-digest", *NO_START_BARRIER,
                            timeout=START_S)
            args = {INNER: ["--batch-size", "96"], MATCHMAKING: ["--fault", "lonely"],
                    ALLREDUCE: ["--fault", "stall-allreduce"]}.get(phase, [])
            (tmp_path / "target" / "allreduce-stalled").unlink(missing_ok=True)
            (partner.state_dir / "digest-withheld").unlink(missing_ok=True)
            resumed = checkpoint_step(target, missing=0) if target is not None else 0
            n0 = len(swarm.nodes["target"].events()) if "target" in swarm.nodes else 0
            log0 = len(swarm.nodes["target"].output()) if "target" in swarm.nodes else 0
            target = swarm.start("target", "--initial-peers", last_maddr(partner), *NO_START_BARRIER, *args,
                                 timeout=START_S, session=True)
            start = next(e for e in events_since(target, n0) if e["event"] == "start")
            assert start["outer_step"] >= resumed, (start, resumed)  # the checkpoint loaded
            reach_phase(swarm, target, partner, phase, n0)
            socket_dir = next(Path(tempfile.gettempdir()).glob(f"{SOCKET_DIR_PREFIX}{target.proc.pid}-*"))
            assert any(socket_dir.glob("hivemind-p2pd-*.sock")), f"no daemon socket in {socket_dir}"
            t0 = time.monotonic()
            send(target, sig, group)
            code = swarm.wait_exit(target, STOP_S + 10)
            seconds = time.monotonic() - t0
            name = f"{signal.Signals(sig).name} to the {'process group' if group else 'main process'} in {phase}"
            timings.append(f"{name}: exit {code} in {seconds:.1f}s")
            print(timings[-1])
            tail = target.output()[log0:][-3000:]  # this run's output
            assert code == 0, (name, tail)
            assert seconds <= STOP_S, (name, seconds, tail)
            after = events_since(target, n0)
            stop = [e for e in after if e.get("event") == "stop"]
            assert stop and stop[-1]["graceful"] is True, (name, after[-4:])
            assert checkpoint_step(target, missing=0) == stop[-1]["outer_step"], name
            kinds = [e["event"] for e in after]
            if phase == INNER:  # stopped before it reached matchmaking
                assert "averaging_start" not in kinds[kinds.index("eval"):], (name, kinds)
            else:  # the round in flight was abandoned (its record says so), then saved
                abandoned = [e for e in after if e.get("event") == "outer_step"][-1]
                assert abandoned["reason"] == "stopping" and not abandoned["round_ok"], (name, abandoned)
                if phase == CROSSCHECK:  # the group had formed and averaged: only the cross-check was left
                    assert abandoned["group_size"] == 2, (name, abandoned)
            assert "Traceback" not in tail, (name, tail)
            assert not socket_dir.exists(), (name, sorted(socket_dir.iterdir()))  # with every socket in it

        # A second signal in quick succession quits at once (exit 130, or killed by it while exiting).
        n0 = len(target.events())
        target = swarm.start("target", "--initial-peers", last_maddr(partner), *NO_START_BARRIER, "--fault", "lonely",
                             timeout=START_S, session=True)
        reach_phase(swarm, target, partner, MATCHMAKING, n0)
        t0 = time.monotonic()
        send(target, signal.SIGTERM, True)
        time.sleep(0.3)
        send(target, signal.SIGTERM, True)
        code = swarm.wait_exit(target, STOP_S)
        seconds = time.monotonic() - t0
        print(f"double SIGTERM to the process group: exit {code} in {seconds:.1f}s")
        assert code in (0, 130, -signal.SIGTERM) and seconds <= 5.0, (code, seconds, target.output()[-2000:])
        checkpoint_step(target, missing=0)
        print("\n".join(timings))
