"""Dashboard and ``diloco-node status``: state aggregation, Prometheus, escaping, the CLI, and a
headless-Chromium test of the page against real DHT records (helper publishers) and real nodes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from diloco_swarm.dashboard.app import Poller, create_app
from diloco_swarm.dashboard.metrics import make_registry, render_metrics
from diloco_swarm.dashboard.charts import text
from diloco_swarm.dashboard.render import render_page
from diloco_swarm.dashboard.state import HISTORY_FILE, SwarmState, summarize
from diloco_swarm.dht.publisher import PeerRecordPublisher
from diloco_swarm.dht.records import PeerEntry, PeerRecord
from diloco_swarm.dht.signing import record_validators
from swarmlib import free_port

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
HOSTILE_NAME = '<img src=x onerror="alert(1)">&</td>[bold red]x'


def rec(peer_id: str = "PeerA", **over) -> PeerRecord:
    base = dict(
        peer_id=peer_id, name="alice", version="0.1.0", device="cpu", precision="fp32", reachability="public",
        outer_step=3, tokens_per_s=100.0, loss=2.5, eval_loss=2.6, tokens_total=1000, bytes_sent=10,
        bytes_received=20, last_round_group_size=2, last_round_s=0.5, last_round_ok=True, failed_rounds=1,
        goodput=0.9, uptime_s=12.0, updated=time.time(),
    )
    base.update(over)
    return PeerRecord.parse_obj(base)


def entry(owner: str, record: PeerRecord | None, expiration: float) -> PeerEntry:
    return PeerEntry(owner, record, expiration)


# ------------------------------------------------------------------------------------------ unit: state
def test_states_online_stale_gone_by_age():
    st = SwarmState("r", stale_after_s=20, gone_after_s=60, keep_gone_s=300, sample_s=1)
    t = 1000.0
    st.update([entry("a", rec("A"), t + 15), entry("b", rec("B", name="bob"), t + 15)], now=t)
    assert {r["owner"]: r["state"] for r in st.peer_rows(t)} == {"a": "online", "b": "online"}
    # a keeps refreshing (expiration moves on); b goes silent (same entry, or none at all)
    for dt in (5, 10, 15, 20, 25):
        st.update([entry("a", rec("A"), t + dt + 15)] + ([entry("b", rec("B", name="bob"), t + 15)] if dt < 15 else []),
                  now=t + dt)
    states = {r["owner"]: r["state"] for r in st.peer_rows(t + 25)}
    assert states == {"a": "online", "b": "stale"}
    assert {r["owner"]: r["state"] for r in st.peer_rows(t + 61)}["b"] == "gone"
    # a says goodbye: gone at once, then dropped after keep_gone_s
    st.update([entry("a", None, t + 45)], now=t + 30)
    rows = {r["owner"]: r for r in st.peer_rows(t + 30)}
    assert rows["a"]["state"] == "gone" and rows["a"]["left"] is True
    st.update([], now=t + 400)
    assert [r["owner"] for r in st.peer_rows(t + 400)] == []
    # a tombstone of a peer never seen adds nothing; a comeback after goodbye is online again
    st.update([entry("c", None, t + 500)], now=t + 401)
    assert st.peer_rows(t + 401) == []
    st.update([entry("a", rec("A"), t + 420)], now=t + 405)
    st.update([entry("a", None, t + 421)], now=t + 406)
    st.update([entry("a", rec("A"), t + 430)], now=t + 410)
    assert st.peer_rows(t + 410)[0]["state"] == "online"


def test_failed_poll_keeps_peers_and_is_reported():
    st = SwarmState("r", stale_after_s=20, gone_after_s=60)
    st.update([entry("a", rec("A"), 1015.0)], now=1000.0)
    st.update(None, now=1005.0)
    doc = st.snapshot(now=1005.0)
    assert doc["last_poll_ok"] is False and doc["peers"][0]["state"] == "online"


def test_totals():
    rows = [
        {**rec("A", loss=2.0, tokens_per_s=100.0, outer_step=4).dict(), "state": "online"},
        {**rec("B", loss=4.0, tokens_per_s=50.0, outer_step=5, reachability="client").dict(), "state": "online"},
        {**rec("C", loss=9.0, tokens_per_s=999.0, outer_step=7).dict(), "state": "stale"},
        {**rec("D", loss=9.0, tokens_per_s=999.0, outer_step=99).dict(), "state": "gone"},
    ]
    t = summarize(rows)
    assert (t["peers_online"], t["peers_stale"], t["peers_gone"]) == (2, 1, 1)
    assert t["tokens_per_s"] == 150.0 and t["mean_loss"] == 3.0 and t["newest_outer_step"] == 7
    assert t["tokens_total"] == 4000 and t["failed_rounds"] == 3 and t["direct_peers"] == 1
    empty = summarize([])
    assert empty["mean_loss"] is None and empty["newest_outer_step"] is None and empty["peers_online"] == 0


def test_history_is_bounded_and_survives_a_restart(tmp_path):
    path = tmp_path / HISTORY_FILE
    st = SwarmState("r", sample_s=1, max_samples=50, path=path, stale_after_s=1e9, gone_after_s=1e9)
    for i in range(200):
        st.update([entry("a", rec("A", outer_step=i, loss=5.0 - i / 100), 2000.0 + i)], now=1000.0 + i)
    doc = st.snapshot(now=1200.0)
    assert len(doc["history"]["swarm"]["t"]) == 50
    assert doc["history"]["swarm"]["outer_step"][-1] == 199
    assert doc["history"]["peers"]["a"]["loss"][-1] == pytest.approx(3.01)
    st.save()
    assert path.exists() and not list(tmp_path.glob(".*.tmp"))
    again = SwarmState("r", sample_s=1, max_samples=50, path=path, stale_after_s=1e9, gone_after_s=1e9)
    assert again.load()
    redoc = again.snapshot(now=1200.0)
    assert redoc["history"] == doc["history"] and redoc["peers"] == doc["peers"]
    # another run's history, or a corrupt file, is ignored (never a crash)
    assert not SwarmState("other", path=path).load()
    path.write_text('{"version": 1, "run_id": "r", "swarm": [[1, "x"]]')
    assert not SwarmState("r", path=path).load()
    path.write_text(json.dumps({"version": 1, "run_id": "r", "swarm": [], "peers": {"a": {"record": {"peer_id": 5}}}}))
    assert not SwarmState("r", path=path).load()


# ------------------------------------------------------------------------------------------ unit: metrics, page
def test_prometheus_output():
    st = SwarmState("run-1", stale_after_s=20, gone_after_s=60)
    now = time.time()
    st.update([entry("a", rec("A", tokens_per_s=100.0, outer_step=4, loss=2.0, failed_rounds=2), now + 15),
               entry("b", rec("B", name=HISTORY_FILE + '"\n\\', tokens_per_s=50.0, outer_step=6, loss=3.0), now + 15)],
              now=now)
    text_out = render_metrics(make_registry(st)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text_out)}
    value = lambda name, **labels: next(s.value for s in fams[name].samples
                                        if all(s.labels.get(k) == v for k, v in labels.items()))
    assert value("diloco_peers", state="online") == 2 and value("diloco_peers", state="gone") == 0
    assert value("diloco_swarm_tokens_per_second") == 150.0
    assert value("diloco_swarm_outer_step") == 6.0
    assert value("diloco_swarm_loss") == 2.5
    assert value("diloco_swarm_failed_rounds") == 3.0
    assert value("diloco_peer_failed_rounds", peer_id="A") == 2.0
    assert value("diloco_peer_outer_step", peer_id="B") == 6.0
    # a hostile name survives as a label value, escaped by prometheus_client
    assert {s.labels["name"] for s in fams["diloco_peer_online"].samples} == {"alice", HISTORY_FILE + '"\n\\'}


def test_hostile_names_and_ids_are_escaped():
    st = SwarmState("<b>run</b>", sample_s=1)
    now = time.time()
    evil_id = PeerRecord.construct(**{**rec("X").dict(), "peer_id": '"><script>alert(2)</script>',
                                      "name": HOSTILE_NAME, "device": "<svg onload=alert(3)>",
                                      "version": "\u202e1.0<i>"})
    st.update([entry('own"><script>alert(4)</script>', evil_id, now + 15),
               entry("b", rec("B", name=HOSTILE_NAME), now + 15)], now=now)
    page = render_page(st.snapshot(), refresh_s=5.0)
    assert page.count("<script") == 1  # ours only
    for raw in ("<img", "<svg onload", "alert(2)</script>", "<b>run</b>", "\u202e", "<i>", 'onerror="'):
        assert raw not in page
    assert text(HOSTILE_NAME) in page
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;&lt;/td&gt;" in page
    # and the status table never reads a name as rich markup
    from diloco_swarm.cli.status import render_table

    console = Console(width=200, record=True, force_terminal=False)
    console.print(render_table([{**rec("B", name="[bold red]x[/]").dict(), "owner": "b", "state": "online",
                                 "age_s": 1.0}], "r"))
    assert "[bold red]x[/]" in console.export_text()


def test_peers_avoided_by_others_are_summarized_with_who_says_so():
    """Each online peer's ``avoided_peers`` (its averager's word, conduct.py) adds up in ``totals.avoided``:
    who reports each peer, of how many that could, and why; the page, ``status`` and the API show it."""
    why = "its Δ was an outlier in 3 rounds in a row"
    evil = {"peer_id": "X", "why": HOSTILE_NAME}
    st = SwarmState("r", stale_after_s=20, gone_after_s=60)
    now = time.time()
    st.update([entry("a", rec("A", name="alice", avoided_peers=[{"peer_id": "X", "why": why}]), now + 15),
               entry("b", rec("B", name="bob", avoided_peers=[{"peer_id": "X", "why": why}, evil]), now + 15),
               entry("c", rec("C", name="carol"), now + 15),  # avoids nobody (or an older version)
               entry("x", rec("X", name="x0", avoided_peers=[{"peer_id": "A", "why": "slander"},
                                                             {"peer_id": "X", "why": "itself"}]), now + 15)],
              now=now)
    doc = st.snapshot(now=now)
    avoided = doc["totals"]["avoided"]
    assert [e["peer_id"] for e in avoided] == ["X", "A"]  # the most reported first; nobody reports itself
    x = avoided[0]
    assert x["name"] == "x0" and x["of"] == 3 and x["why"] == [why, HOSTILE_NAME]
    assert x["by"] == [{"peer_id": "A", "name": "alice"}, {"peer_id": "B", "name": "bob"}]
    assert avoided[1]["by"] == [{"peer_id": "X", "name": "x0"}] and avoided[1]["of"] == 3
    # stale reporters no longer count
    later = summarize([{**r, "state": "stale"} if r["peer_id"] == "B" else r for r in doc["peers"]])["avoided"]
    assert {e["peer_id"]: (e["by"], e["of"]) for e in later}["X"] == ([{"peer_id": "A", "name": "alice"}], 2)
    page = render_page(doc, refresh_s=5.0)
    assert 'id="avoided"' in page and "avoided by 2 of 3 peers (alice, bob): " + text(why) in page
    assert "avoided by 2 of 3</span>" in page and "<img" not in page
    from diloco_swarm.cli.status import avoided_lines

    lines = avoided_lines(doc["totals"])
    assert lines[0] == f"peer x0 X avoided by 2 of 3 peers (alice, bob): {why}; {HOSTILE_NAME}"
    assert lines[1] == "peer alice A avoided by 1 of 3 peers (x0): slander"
    assert summarize([])["avoided"] == []


def test_every_held_out_loss_shown_carries_the_outer_step_it_was_measured_at():
    """Issue 39: early in a run the held-out loss (θ_global at the last evaluation, outer step 0 at the
    start) sits beside a training loss of θ_local far ahead of it. The node's record carries the step
    (``eval_outer_step``), and the API, the page's card and peer table and ``status`` say it."""
    from diloco_swarm.cli.status import summary_line
    from diloco_swarm.dht.records import normalize_snapshot
    from diloco_swarm.node.stats import NodeStats

    stats = NodeStats()
    assert stats.peer_record()["eval_outer_step"] is None  # no evaluation yet: no step either
    stats.eval_loss, stats.eval_outer_step = 7.515, 0
    snap = {**stats.peer_record(), "peer_id": "A", "outer_step": 1}
    record = PeerRecord.parse_obj(normalize_snapshot(snap))  # what the DHT's schema validator accepts
    assert (record.eval_loss, record.eval_outer_step) == (7.515, 0)
    assert normalize_snapshot({**snap, "eval_loss": None})["eval_outer_step"] is None
    assert PeerRecord.parse_obj({k: v for k, v in rec("B").dict().items() if k != "eval_outer_step"})  # older versions

    st = SwarmState("r", stale_after_s=20, gone_after_s=60)
    now = time.time()
    st.update([entry("a", record, now + 15),
               entry("b", rec("B", loss=2.65, eval_loss=4.873, eval_outer_step=2), now + 15),
               entry("c", rec("C", eval_loss=None), now + 15)], now=now)
    doc = st.snapshot(now=now)
    assert {p["peer_id"]: p["eval_outer_step"] for p in doc["peers"]} == {"A": 0, "B": 2, "C": None}
    assert doc["totals"]["mean_eval_loss"] == pytest.approx(6.194) and doc["totals"]["eval_outer_steps"] == [0, 2]
    page = render_page(doc, refresh_s=5.0)
    assert "held-out 6.194 at outer steps 0–2" in page  # the card
    assert "held-out 7.515 at outer step 0" in page and "held-out 4.873 at outer step 2" in page  # the rows
    assert "held-out 6.194 at outer steps 0–2" in summary_line(doc["totals"])
    one = summarize([r for r in doc["peers"] if r["peer_id"] == "A"])
    assert one["eval_outer_steps"] == [0, 0] and "held-out 7.515 at outer step 0" in summary_line(one)
    assert "held-out" not in summary_line(summarize([]))


@pytest.mark.filterwarnings("ignore:Using .httpx. with")
def test_http_routes_and_headers():
    from starlette.testclient import TestClient

    st = SwarmState("r")
    st.update([entry("a", rec("A"), time.time() + 15)])
    with TestClient(create_app(st, refresh_s=2.0)) as client:
        page = client.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "unsafe-inline" not in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        assert 'id="peers"' in page.text and "<svg" in page.text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|<link|@import|url\(""", page.text)  # offline
        frag = client.get("/fragment")
        assert frag.status_code == 200 and frag.text.startswith('<p class="status"')
        doc = client.get("/api/v1/state").json()
        assert doc["schema"] == 1 and doc["run_id"] == "r" and doc["totals"]["peers_online"] == 1
        assert set(doc["history"]) == {"swarm", "peers"}
        assert "history" not in client.get("/api/v1/state?history=0").json()
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "diloco_peers" in metrics.text
        assert metrics.headers["content-type"].startswith("text/plain")


def test_leaderboard_and_a_volunteer_page_of_its_own():
    """``/api/v1/state`` holds the leaderboard; ``/peer/{id}`` and ``/api/v1/peer/{id}`` show one peer (its
    witnesses, its θ marks and who holds them, what is self-reported, names escaped); an unknown peer is a 404."""
    from starlette.testclient import TestClient

    marks = [{"step": 3, "digest": "ab" * 8}]
    with_ = lambda *peers: [{"peer_id": p, "rounds": 3, "tokens": 1000} for p in peers]  # noqa: E731
    st = SwarmState("r")
    st.update([entry("a", rec("PeerA", verified_rounds=3, rounds_with=with_("PeerB"), theta_marks=marks), time.time() + 15),
               entry("b", rec("PeerB", name=HOSTILE_NAME, verified_rounds=3, rounds_with=with_("PeerA"), theta_marks=marks),
                     time.time() + 15),
               entry("c", rec("PeerC", name="boaster", tokens_total=10**12, verified_rounds=90), time.time() + 15)])
    with TestClient(create_app(st, refresh_s=2.0)) as client:
        board = {e["peer_id"]: e for e in client.get("/api/v1/state").json()["leaderboard"]}
        assert board["PeerA"]["confirmed_rounds"] == 3 and not board["PeerA"]["self_reported"]
        assert board["PeerC"]["self_reported"] and board["PeerC"]["confirmed_rounds"] == 0
        page = client.get("/")
        assert 'id="leaderboard"' in page.text and 'href="peer/PeerA"' in page.text and "self-reported" in page.text
        doc = client.get("/api/v1/peer/PeerA").json()
        assert doc["peer"]["peer_id"] == "PeerA" and doc["ledger"]["confirmed_tokens"] == 1000
        assert [w["peer_id"] for w in doc["witnessed_by"]] == ["PeerB"] and doc["theta_marks"][0]["held_by"] == ["PeerB"]
        assert "tokens_total" in doc["self_reported"] and set(doc["history"]) == {"t", "loss", "tokens_per_s", "outer_step"}
        html = client.get("/peer/PeerA")
        assert html.status_code == 200 and 'id="witnesses"' in html.text and 'id="theta-marks"' in html.text
        assert "<img" not in html.text and "unsafe-inline" not in html.headers["content-security-policy"]
        assert "self-reported" in client.get("/peer/PeerC").text
        for path in ("/api/v1/peer/Nobody", "/peer/Nobody", "/api/v1/peer/" + "x" * 300, "/peer/%3Cscript%3E"):
            missing = client.get(path)
            assert missing.status_code == 404 and "<script" not in missing.text, path
        assert "error" in client.get("/api/v1/peer/Nobody").json()


def test_poller_survives_a_raising_reader(tmp_path):
    st = SwarmState("r", path=tmp_path / HISTORY_FILE)
    calls = []

    def reader():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return [entry("a", rec("A"), time.time() + 15)]

    poller = Poller(st, reader, poll_s=0.05, save_s=0.1)
    poller.start()
    try:
        deadline = time.monotonic() + 5
        while len(st.peer_rows()) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        poller.stop()
    assert len(calls) >= 2 and st.peer_rows()[0]["peer_id"] == "A"
    assert (tmp_path / HISTORY_FILE).exists()


def test_status_cli_errors_are_one_line_exit_2():
    from typer.testing import CliRunner

    from diloco_swarm.cli.app import app

    r = CliRunner().invoke(app, ["status", "--initial-peers", "not-an-address"])
    assert r.exit_code == 2
    r = CliRunner().invoke(app, ["dashboard", "--initial-peers", "/ip4/127.0.0.1/tcp/1"])
    assert r.exit_code == 2
    good_peer = "/ip4/127.0.0.1/tcp/1/p2p/QmcaAm1dbxe3yDbWTLWVedDN8xTYf3NXS6TCfAyaMH5dcK"
    for command in ("status", "dashboard"):  # refused before dialing anyone
        r = CliRunner().invoke(app, [command, "--run-id", "my run", "--initial-peers", good_peer])
        assert r.exit_code == 2 and "'my run' is not a valid run id" in r.output, r.output


# ------------------------------------------------------------------------------------------ processes
def stop_process(proc: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL; then SIGKILL whatever is left of its session (DHT processes, p2pd)."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # spawn() gave it its own session: only its own children


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HIVEMIND_LOGLEVEL": "WARNING"}
    return subprocess.Popen([sys.executable, "-m", "diloco_swarm", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def wait_until(cond, timeout: float, every: float = 0.3, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            last = cond()
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {str(last)[:300]})")


def get_state(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/api/v1/state", timeout=5).json()


def start_dashboard(tmp_path: Path, maddrs: list[str], run_id: str, name: str = "dash"):
    port = free_port()
    proc = spawn(["dashboard", "--initial-peers", *maddrs, "--run-id", run_id, "--host", "127.0.0.1",
                  "--port", str(port), "--state-dir", str(tmp_path / name), "--poll-s", "1", "--sample-s", "1",
                  "--refresh-s", "1", "--stale-after", "8", "--gone-after", "20"], tmp_path / f"{name}.log")
    return proc, port


@pytest.fixture(scope="module")
def helper_swarm():
    """Two helper DHTs on 127.0.0.1, each publishing one peer's signed record (no training)."""
    from hivemind import DHT

    run_id = f"dash-{os.getpid()}"
    dhts, pubs = [], []
    try:
        peers = []
        for i, name in enumerate(("alice", HOSTILE_NAME)):
            validators = record_validators(run_id, None)
            initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dht = DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                      record_validators=validators, use_relay=False, use_auto_relay=False)
            dhts.append(dht)
            snap = {**rec(dht.peer_id.to_base58(), name=name, outer_step=1, loss=3.0 - i * 0.2,
                          tokens_per_s=1000.0 + 200 * i, reachability="client" if i else "public", eval_outer_step=1,
                          theta_marks=[{"step": 1, "digest": f"{i:016x}"}]).dict()}  # two lineages
            snap["updated"] = None  # the publisher fills in "now"
            # records live 3 intervals: 6 s leaves room for a store delayed on a busy machine
            pub = PeerRecordPublisher(dht, run_id, validators, lambda s=snap: dict(s), interval_s=2.0)
            pub.start()
            pubs.append(pub)
            peers.append(SimpleNamespace(dht=dht, snap=snap, pub=pub, peer_id=snap["peer_id"]))
        yield SimpleNamespace(run_id=run_id, peers=peers, maddrs=[str(a) for a in dhts[0].get_visible_maddrs()])
    finally:
        for pub in pubs:
            with contextlib.suppress(Exception):
                pub.stop(remove=False)
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(240)  # two `status` runs, each starting a DHT (tens of seconds on a busy 2-core machine)
def test_status_command_reads_the_swarm(helper_swarm, tmp_path):
    args = [sys.executable, "-m", "diloco_swarm", "status", "--initial-peers", *helper_swarm.maddrs,
            "--run-id", helper_swarm.run_id]
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=90, cwd=REPO)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {p["peer_id"] for p in doc["peers"]} == {p.peer_id for p in helper_swarm.peers}
    assert doc["summary"]["peers_online"] == 2 and doc["summary"]["tokens_per_s"] == 2200.0
    assert doc["summary"]["lineages"] == 2 and doc["summary"]["lineage"]["compared_step"] == 1
    table = subprocess.run(args, capture_output=True, text=True, timeout=90, cwd=REPO,
                           env={**os.environ, "COLUMNS": "200"})
    assert table.returncode == 0, table.stderr
    assert "alice" in table.stdout and "[bold red]x" in table.stdout
    assert ("2 peers online · 2.2k tok/s · newest outer step 1 · mean loss 2.900 · held-out 2.600 at outer step 1 "
            "· 2 θ lineages") in table.stdout
    assert "warning" not in table.stdout  # 2 lineages at one step is not (yet) a split
    bad = subprocess.run([sys.executable, "-m", "diloco_swarm", "status", "--initial-peers",
                          "/ip4/127.0.0.1/tcp/9/p2p/" + helper_swarm.peers[0].peer_id],
                         capture_output=True, text=True, timeout=90, cwd=REPO)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "none of the --initial-peers answered" in bad.stderr


@pytest.mark.timeout(120)  # two light `status` runs: no DHT daemon to start
def test_status_exits_1_when_it_finds_no_peer_of_the_run(helper_swarm):
    """A swarm that answers but holds no record of the run: exit 1 (not 0), the table's line or the JSON
    document still printed, so a script can tell an empty run from a live one (and from bad input, 2)."""
    from diloco_swarm.cli.status import NO_PEERS

    assert NO_PEERS not in (0, 2)
    args = [sys.executable, "-m", "diloco_swarm", "status", "--light", "--initial-peers", *helper_swarm.maddrs,
            "--run-id", f"{helper_swarm.run_id}-nobody"]
    table = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert table.returncode == NO_PEERS and "Traceback" not in table.stderr, table.stderr
    assert f"no peer records found for run '{helper_swarm.run_id}-nobody'" in table.stdout, table.stdout
    out = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == NO_PEERS and "Traceback" not in out.stderr, out.stderr
    doc = json.loads(out.stdout)
    assert doc["peers"] == [] and doc["summary"]["peers_online"] == 0


def _launch_browser(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def _screenshots(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    laptop = ARTIFACTS / f"{name}-laptop.png"
    page.set_viewport_size({"width": 1366, "height": 900})
    page.screenshot(path=str(laptop), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    page.screenshot(path=str(ARTIFACTS / f"{name}-phone.png"), full_page=True)
    page.set_viewport_size({"width": 1366, "height": 900})
    return laptop


def _page_outer_step(page) -> int:
    v = page.locator("#total-outer-step .v").inner_text().strip()
    return int(v) if v.isdigit() else -1


@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)")
def test_dashboard_in_a_browser_with_helper_records(helper_swarm, tmp_path):
    from playwright.sync_api import sync_playwright

    dash, port = start_dashboard(tmp_path, helper_swarm.maddrs, helper_swarm.run_id)
    try:
        wait_until(lambda: get_state(port)["totals"]["peers_online"] == 2, 120, what="2 peers online in the API")
        with sync_playwright() as p:
            browser = _launch_browser(p)
            try:
                page = browser.new_page(viewport={"width": 1366, "height": 900})
                errors = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
                page.goto(f"http://127.0.0.1:{port}/")
                rows = page.locator("#peers tr.peer")
                assert rows.count() == 2
                assert page.locator("#total-peers-online .v").inner_text() == "2"
                assert page.locator("#peers").get_by_text(HOSTILE_NAME).count() == 1  # shown as text
                assert page.locator("#chart-loss svg.chart .series path").count() >= 2
                assert page.locator("#chart-tps svg.chart .series path").count() >= 2
                # an outer step: the page follows without a reload
                for peer in helper_swarm.peers:
                    peer.snap.update(outer_step=2, loss=peer.snap["loss"] - 0.5)
                    peer.pub.publish_now()
                # each publisher's record lands on its own; the page may show one before the other
                wait_until(lambda: _page_outer_step(page) == 2
                           and "2.400" in page.locator("#total-mean-loss").inner_text(), 30,
                           what="the page to show outer step 2 and both peers' new losses")
                assert rows.count() == 2
                _screenshots(page, "dashboard-helper")
                # goodbye: the row stays, marked gone, once the page refreshes
                bob = helper_swarm.peers[1]
                bob.pub.stop(remove=True)
                wait_until(lambda: page.locator("#peers tr.peer.gone").count() == 1, 30, what="a gone row")
                assert page.locator("#total-peers-online .v").inner_text() == "1"
                assert not errors, errors
            finally:
                browser.close()
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'diloco_peers{run_id="%s",state="gone"} 1.0' % helper_swarm.run_id in metrics
    finally:
        stop_process(dash)
    assert dash.returncode == 0, (tmp_path / "dash.log").read_text()[-2000:]
    saved = json.loads((tmp_path / "dash" / HISTORY_FILE).read_text())
    assert saved["run_id"] == helper_swarm.run_id and len(saved["peers"]) == 2 and saved["swarm"]


def _first_event(path: Path) -> dict | None:
    if not path.exists():
        return None
    line = path.read_text().split("\n", 1)[0]
    return json.loads(line) if line.strip() else None


@pytest.mark.timeout(240)
def test_dashboard_redials_its_bootstrap_peer_after_a_restart(tmp_path):
    """The only node the dashboard reached dies and comes back at the same address (same identity,
    same port): the dashboard reports failed polls while it is down, then dials it again."""
    from hivemind import DHT

    run_id, port = f"dash-redial-{os.getpid()}", free_port()
    (tmp_path / "node").mkdir()  # the record key lives here: the restarted peer owns the same row
    validators = record_validators(run_id, tmp_path / "node")

    def start_peer(outer_step: int):
        dht = DHT(start=True, initial_peers=[], host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"],
                  identity_path=str(tmp_path / "identity.key"), record_validators=validators,
                  use_relay=False, use_auto_relay=False)
        snap = {**rec(dht.peer_id.to_base58(), name="boot", outer_step=outer_step).dict(), "updated": None}
        pub = PeerRecordPublisher(dht, run_id, validators, lambda: dict(snap), interval_s=2.0)
        pub.start()
        return dht, pub

    dht, pub = start_peer(outer_step=1)
    dash = None
    try:
        maddr = [str(a) for a in dht.get_visible_maddrs()]
        dash, dash_port = start_dashboard(tmp_path, maddr, run_id)
        wait_until(lambda: get_state(dash_port)["totals"]["peers_online"] == 1, 120, what="the record")
        pub.stop(remove=False)  # a crash: no goodbye; the record expires within 6 s
        dht.shutdown()
        wait_until(lambda: get_state(dash_port)["last_poll_ok"] is False, 60, what="a failed poll while it is down")
        dht, pub = start_peer(outer_step=2)
        wait_until(lambda: [p["outer_step"] for p in get_state(dash_port)["peers"] if p["state"] == "online"] == [2],
                   60, what="the restarted peer's record")
        assert get_state(dash_port)["last_poll_ok"] is True
    finally:
        stop_process(dash)
        with contextlib.suppress(Exception):
            pub.stop(remove=False)
        dht.shutdown()


@pytest.mark.swarm
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)")
def test_dashboard_in_a_browser_with_a_real_two_peer_swarm(tmp_path):
    from playwright.sync_api import sync_playwright

    run_id = f"dash-swarm-{os.getpid()}"
    common = ["join", "--run-id", run_id, "--host", "127.0.0.1", "--port", "0", "--inner-steps", "10",
              "--seq-len", "32", "--batch-size", "2", "--max-dataset-bytes", "100000", "--threads", "1",
              "--matchmaking-time", "2", "--averaging-window", "15", "--device", "cpu"]
    procs: list[subprocess.Popen] = []
    dash = None
    try:
        m1 = tmp_path / "n1.jsonl"
        procs.append(spawn([*common, "--name", "node-one", "--state-dir", str(tmp_path / "n1"),
                            "--metrics-file", str(m1)], tmp_path / "n1.log"))
        start = wait_until(lambda: _first_event(m1), 180, what="the first node's start event")
        maddrs = start["maddrs"]
        procs.append(spawn([*common, "--name", "node-two", "--initial-peers", *maddrs, "--state-dir",
                            str(tmp_path / "n2"), "--metrics-file", str(tmp_path / "n2.jsonl")], tmp_path / "n2.log"))
        dash, port = start_dashboard(tmp_path, maddrs, run_id)
        wait_until(lambda: get_state(port)["totals"]["peers_online"] == 2, 120, what="both nodes' records")
        with sync_playwright() as p:
            browser = _launch_browser(p)
            try:
                page = browser.new_page(viewport={"width": 1366, "height": 900})
                page.goto(f"http://127.0.0.1:{port}/")
                wait_until(lambda: page.locator("#peers tr.peer.online").count() == 2, 30, what="2 online rows")
                names = page.locator("#peers tr.peer .name").all_inner_texts()
                assert sorted(names) == ["node-one", "node-two"]
                assert page.locator("#total-peers-online .v").inner_text() == "2"
                step0 = _page_outer_step(page)
                wait_until(lambda: _page_outer_step(page) > max(step0, 0), 120, what="an outer step on the page")
                wait_until(lambda: page.locator("#chart-loss svg.chart .series path").count() >= 2, 60,
                           what="loss lines in the chart")
                assert page.locator("#chart-tps svg.chart .series path").count() >= 2
                assert page.locator("#total-mean-loss .v").inner_text() != "–"
                laptop = _screenshots(page, "dashboard-swarm")
                if os.environ.get("DILOCO_UPDATE_DOCS_SCREENSHOT"):
                    shutil.copy(laptop, REPO / "docs" / "dashboard.png")
                # node two leaves gracefully: its goodbye turns its row "gone" well before any expiry
                procs[1].send_signal(signal.SIGINT)
                wait_until(lambda: page.locator("#peers tr.peer.gone").count() == 1, 25, what="node two gone")
                assert page.locator("#peers tr.peer.gone .name").inner_text() == "node-two"
                assert procs[1].wait(timeout=30) == 0
            finally:
                browser.close()
    finally:
        stop_process(dash)
        for proc in procs:
            stop_process(proc, timeout=20)


def test_many_peers_keep_the_charts_readable():
    from diloco_swarm.dashboard.render import MAX_CHART_PEERS

    st = SwarmState("r", sample_s=1)
    now = time.time()
    for k in range(3):
        st.update([entry(f"o{i}", rec(f"P{i}", name=f"peer{i}"), now + 15 + k) for i in range(30)], now=now + k)
    page = render_page(st.snapshot(now=now + 2))
    loss_chart = page.split('id="chart-loss"')[1].split("</figure>")[0]
    assert loss_chart.count('<g class="series') == MAX_CHART_PEERS + 1  # + the swarm line
    assert page.count('<tr class="peer online"') == 30


# ------------------------------------------------------------------ charts: ticks and gaps
def _tick_texts(svg: str) -> list[str]:
    return re.findall(r'<text class="tick" x="\d+(?:\.\d+)?" y="[\d.]+" text-anchor="end">([^<]*)</text>', svg)


def test_narrow_loss_range_gets_distinct_tick_labels():
    from diloco_swarm.dashboard.charts import line_chart, tick_labels

    now = 10_000.0
    points = [(now - 600 + 10 * i, 5.2800 + 0.0001 * (i % 7)) for i in range(60)]  # loss 5.2800 .. 5.2806
    svg = line_chart([{"label": "a", "color": 0, "points": points}], title="loss", now=now,
                     unit_fmt=lambda v: f"{v:.3g}")
    ticks = [t for t in _tick_texts(svg) if t != "now"]  # the time axis's last label is end-anchored too
    assert len(ticks) >= 3 and len(set(ticks)) == len(ticks), ticks  # was "5.28" five times
    assert all(t.startswith("5.28") for t in ticks), ticks
    assert tick_labels([1.0, 2.0, 3.0], lambda v: f"{v:.3g}") == ["1", "2", "3"]  # distinct already: unchanged
    assert tick_labels([0.1, 0.15, 0.2], lambda v: f"{v:.1f}") == ["0.10", "0.15", "0.20"]


def test_a_gap_in_history_breaks_the_line():
    from diloco_swarm.dashboard.charts import line_chart

    now = 20_000.0
    before = [(now - 6000 + 15 * i, 5.0 - 0.01 * i) for i in range(20)]  # 90 minutes before the second run
    after = [(now - 300 + 15 * i, 4.0 - 0.01 * i) for i in range(20)]
    svg = line_chart([{"label": "a", "color": 0, "points": before + after}], title="loss", now=now)
    path = re.search(r'<path d="([^"]*)"', svg).group(1)
    assert path.count("M") == 2, path  # two runs of the line, nothing drawn across the 90 minutes
    steady = line_chart([{"label": "a", "color": 0, "points": before}], title="loss", now=now)
    assert re.search(r'<path d="([^"]*)"', steady).group(1).count("M") == 1
