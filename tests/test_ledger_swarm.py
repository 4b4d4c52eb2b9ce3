"""The contribution ledger on 3 real nodes: the leaderboard of the dashboard (``/api/v1/state``) and of
``status --json`` matches the verified rounds in the peers' metrics files, a peer whose record boasts
(``--fault boast``, tests/faults.py: 10x its tokens, 20 rounds more) is shown self-reported, and the
export of an honest node names the contributors in its model card."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from swarmlib import Swarm, free_port

pytestmark = [pytest.mark.swarm]

START_S = 180.0
ROUNDS = 3  # verified rounds every node must have before the ledger is read
REPO = Path(__file__).resolve().parent.parent


def verified(node) -> int:
    """Verified rounds in a node's metrics file: its ``round_ok`` outer steps."""
    return sum(1 for r in node.outer_steps() if r["round_ok"])


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco_swarm", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env={**os.environ, "HIVEMIND_LOGLEVEL": "WARNING"})


def check_board(board: list[dict], counts: dict[str, tuple[int, int]], ids: dict[str, str], boaster: str) -> None:
    """``counts``: name -> verified rounds in its metrics file (before, after the board was read)."""
    rows = {r["peer_id"]: r for r in board}
    assert set(rows) == set(ids.values()), board
    for name, pid in ids.items():
        row, (before, after) = rows[pid], counts[name]
        if name == boaster:
            assert row["self_reported"] and "tokens" in row["why"] and "verified rounds" in row["why"], row
            assert row["verified_rounds"] >= before + 20 and row["confirmed_rounds"] <= after, (row, counts)
        else:
            assert before <= row["verified_rounds"] <= after, (name, row, counts)
            assert not row["self_reported"], row
            # its two partners' records back its rounds (each re-signed every 5 s: a round or two behind)
            assert before - 2 <= row["confirmed_rounds"] <= row["verified_rounds"] and row["witnesses"] == 2, row
            assert row["confirmed_tokens"] > 0 and row["tokens"] >= row["confirmed_tokens"], row


@pytest.mark.timeout(600)
def test_the_leaderboard_matches_the_metrics_and_names_a_boaster(tmp_path):
    dash = None
    with Swarm(tmp_path, "ledger", extra=["--wait-for-peers", "3"]) as swarm:
        try:
            a = swarm.start("a", "--name", "ana", timeout=START_S)
            b = swarm.start("b", "--name", "ben", initial=a, wait_start=False)
            h = swarm.start("h", "--name", "hal", "--fault", "boast", initial=a, wait_start=False)
            port = free_port()
            dash = subprocess.Popen(
                [sys.executable, "-m", "diloco_swarm", "dashboard", "--initial-peers", a.maddr(), "--run-id", "ledger",
                 "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(tmp_path / "dash"), "--poll-s", "1"],
                stdout=open(tmp_path / "dash.log", "w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            nodes = {"ana": a, "ben": b, "hal": h}
            swarm.wait(lambda: all(verified(n) >= ROUNDS for n in nodes.values()), 240,
                       f"every node has {ROUNDS} verified rounds", list(nodes.values()))
            ids = {name: n.events("start")[-1]["peer_id"] for name, n in nodes.items()}

            def board_now(read):
                before = {name: verified(n) for name, n in nodes.items()}
                board = read()
                return board, {name: (before[name], verified(n)) for name, n in nodes.items()}

            def dashboard_board():
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/api/v1/state?history=0", timeout=5).json()["leaderboard"]
                except (httpx.HTTPError, ValueError):
                    return []

            def settled(read):  # the records of the newest rounds may be a re-signing (5 s) behind
                board, counts = board_now(read)
                try:
                    check_board(board, counts, ids, "hal")
                except AssertionError:
                    return None
                return board, counts

            board, counts = swarm.wait(lambda: settled(dashboard_board), 60, "the dashboard's leaderboard settles", a)
            check_board(board, counts, ids, "hal")

            def status_board():
                done = cli("status", "--initial-peers", a.maddr(), "--run-id", "ledger", "--json")
                return json.loads(done.stdout)["leaderboard"] if done.returncode == 0 else []

            board, counts = swarm.wait(lambda: settled(status_board), 90, "status --json's leaderboard settles", a)
            check_board(board, counts, ids, "hal")
            page = httpx.get(f"http://127.0.0.1:{port}/api/v1/peer/{ids['hal']}", timeout=5).json()
            assert page["ledger"]["self_reported"] and {w["name"] for w in page["witnessed_by"]} == {"ana", "ben"}
            assert httpx.get(f"http://127.0.0.1:{port}/api/v1/peer/NoSuchPeer", timeout=5).status_code == 404
        finally:
            if dash is not None:
                dash.send_signal(signal.SIGTERM)
                try:
                    dash.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(dash.pid, signal.SIGKILL)
        # a waits for an upkeep after its last round: its checkpoint then holds the leaderboard
        time.sleep(6)
        swarm.leave()
    done = cli("export", "--state-dir", str(a.state_dir), "--out", str(tmp_path / "export"), "--metrics-file", str(a.metrics))
    assert done.returncode == 0, done.stderr
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "export" / "README.md")
    assert card.data.to_dict()["diloco_swarm"]["run_id"] == "ledger"
    rows = {line.split("|")[1].strip(): line for line in card.text.splitlines() if line.startswith("| ")}
    assert "this peer" in rows["ana"] and "first-hand" in rows["ben"], card.text
    assert "self-reported" in rows["hal"], card.text
    assert "| outer step | held-out loss |" in card.text
