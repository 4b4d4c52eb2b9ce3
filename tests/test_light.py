"""The py-libp2p light client (diloco_swarm/light): wire format and record checks against hivemind's own
code, then against a live swarm of real `diloco-node join` processes (one swarm for the whole module):
status and dashboard agree with the hivemind path, forged records are dropped, probe, no p2pd, and a
fresh virtualenv with only the base install.

The light client runs in subprocesses: hivemind and libp2p cannot be imported in one process
(both register ``crypto.pb.KeyType``); wire.py and verify.py import neither, so they are tested here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from diloco_swarm.light import wire
from diloco_swarm.light.verify import schema_ok, signature_ok, strip_signature, verified_dictionary
from swarmlib import process_tree

REPO = Path(__file__).resolve().parents[1]
NODE = [sys.executable, "-m", "diloco_swarm"]


# ------------------------------------------------------------------------------ unit: wire and checks
def test_wire_matches_hivemind():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.proto import dht_pb2
    from hivemind.utils import MSGPackSerializer, get_dht_time

    for key in ("run_peers", b"raw", ("a", 1)):
        assert wire.dht_id(key) == DHTID.generate(source=key).to_bytes()
    record = (b"k" * 20, b"\xc4\x03sub", b"value", 1.5e9)
    assert wire.dumps(record) == MSGPackSerializer.dumps(record)
    # a hivemind dictionary value decodes to (subkey, value bytes, expiration), in order
    d = DictionaryDHTValue()
    d.store(b"[owner:x]", b"v1", get_dht_time() + 60)
    d.store("s2", b"v2", get_dht_time() + 30)
    decoded = wire.loads(MSGPackSerializer.dumps(d))
    assert isinstance(decoded, wire.DictionaryValue)
    assert {s: v for s, v, _ in decoded} == {b"[owner:x]": b"v1", "s2": b"v2"}
    # our private protobuf messages are byte-compatible with hivemind's
    ours = wire.FindRequest(keys=[b"a" * 20, b"b" * 20], peer=wire.NodeInfo(node_id=b"n" * 20)).SerializeToString()
    theirs = dht_pb2.FindRequest(keys=[b"a" * 20, b"b" * 20], peer=dht_pb2.NodeInfo(node_id=b"n" * 20))
    assert ours == theirs.SerializeToString()
    answer = dht_pb2.FindResponse(results=[dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, value=b"x",
                                                              expiration_time=3.0, nearest_peer_ids=[b"p"])])
    parsed = wire.FindResponse.FromString(answer.SerializeToString())
    assert parsed.results[0].type == wire.FOUND_DICTIONARY and parsed.results[0].nearest_peer_ids == [b"p"]


def test_unary_framing():
    call_id, frame = wire.unary_request(b"peer", "DHTProtocol.rpc_ping", b"")
    body, rest = wire.split_frame(frame + b"tail")
    assert rest == b"tail" and wire.split_frame(frame[:-1]) is None
    msg = wire.PersistentConnectionRequest.FromString(body)
    assert msg.callId == call_id and msg.callUnary.proto == "DHTProtocol.rpc_ping" and msg.callUnary.HasField("data")
    ok = wire.PersistentConnectionRequest(callId=call_id)
    ok.unaryResponse.response = b"pong"
    assert wire.unary_response(call_id, ok.SerializeToString()) == b"pong"
    failed = wire.PersistentConnectionRequest(callId=call_id)
    failed.unaryResponse.error = b"boom"
    with pytest.raises(wire.WireError, match="boom"):
        wire.unary_response(call_id, failed.SerializeToString())
    with pytest.raises(wire.WireError):
        wire.unary_response(b"other-call-id-16", ok.SerializeToString())
    with pytest.raises(wire.WireError):
        wire.split_frame(wire.uvarint(wire.MAX_MESSAGE_BYTES + 1))


def test_signature_and_schema_rules_match_hivemind():
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from diloco_swarm.dht.records import OWNER_KEY_REGEX, normalize_snapshot, records_key
    from diloco_swarm.dht.signing import record_validators

    assert OWNER_KEY_REGEX == RSASignatureValidator.PUBLIC_KEY_REGEX
    validators = record_validators("r", None)
    signer = validators[0]
    key_id = wire.dht_id(records_key("r"))
    subkey = signer.local_public_key
    value = normalize_snapshot({"peer_id": "PeerA", "name": "a", "outer_step": 3})
    record = DHTRecord(key_id, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), get_dht_time() + 30)
    signed = signer.sign_value(record)
    good = dataclasses.replace(record, value=signed)
    assert signer.validate(good) and signature_ok(key_id, good.subkey, signed, good.expiration_time)
    assert wire.loads(strip_signature(signed)) == value and schema_ok(subkey, value)

    tampered = signed.replace(MSGPackSerializer.dumps(3), MSGPackSerializer.dumps(4), 1)
    assert tampered != signed
    later = dataclasses.replace(good, expiration_time=good.expiration_time + 1)
    other = RSASignatureValidator(RSAPrivateKey())
    wrong_key = dataclasses.replace(record, value=record.value + b"[signature:"
                                    + RSAPrivateKey().sign(MSGPackSerializer.dumps(dataclasses.astuple(record))) + b"]")
    for bad in (dataclasses.replace(good, value=tampered), later, wrong_key, dataclasses.replace(good, value=record.value)):
        assert not signer.validate(bad) and not other.validate(bad)
        assert not signature_ok(key_id, bad.subkey, bad.value, bad.expiration_time)

    # the schema: no conversions, no unknown fields, bounds, an owner in the subkey
    assert not schema_ok(subkey, {**value, "outer_step": 3.0})
    assert not schema_ok(subkey, {**value, "extra": 1})
    assert not schema_ok(subkey, {**value, "goodput": 2.0})
    assert not schema_ok(b"no owner here", value)
    assert schema_ok(subkey, None)  # a goodbye tombstone
    # one bad subkey drops the whole answer, as hivemind's DHTProtocol._validate_dictionary does
    items = [(subkey, signed, good.expiration_time)]
    assert verified_dictionary(key_id, items, schema=True) == [(subkey, value, good.expiration_time)]
    assert verified_dictionary(key_id, items + [(subkey, tampered, good.expiration_time)], schema=True) is None


LIGHT_PROCESS_CHECKS = """
import sys
import diloco_swarm.cli.app, diloco_swarm.light.reader, diloco_swarm.dashboard.app
from diloco_swarm.light.client import LightError, parse_peer_maddr
peer, addrs = parse_peer_maddr("/ip4/127.0.0.1/tcp/4001/p2p/QmcaAm1dbxe3yDbWTLWVedDN8xTYf3NXS6TCfAyaMH5dcK")
assert peer.to_base58().startswith("Qmca") and [str(a) for a in addrs] == ["/ip4/127.0.0.1/tcp/4001"]
for bad in ("/ip4/127.0.0.1/tcp/5", "not-a-multiaddr", "/ip4/1.2.3.4/tcp/1/p2p/notapeerid", "/p2p/" + str(peer)):
    try:
        parse_peer_maddr(bad)
    except LightError:
        continue
    raise AssertionError(bad)
bad = [m for m in ("hivemind", "torch", "bitsandbytes") if m in sys.modules]
assert not bad, bad
"""


def test_light_path_imports_neither_hivemind_nor_torch():
    """In a process of its own: libp2p and hivemind cannot share one (see the module docstring)."""
    subprocess.run([sys.executable, "-c", LIGHT_PROCESS_CHECKS], check=True, timeout=120, cwd=REPO)


# the base install, simulated in one process: torch and hivemind are not found (find_spec gives None)
# and importing them fails, as where they are not installed (the real one: test_base_install_...)
WITHOUT_NODE = ("import sys; sys.modules.update(torch=None, hivemind=None); sys.argv[0] = 'diloco-node'; "
                "from diloco_swarm.cli import main; main()")


@pytest.mark.timeout(180)
def test_every_command_that_needs_the_node_says_what_to_install(tmp_path):
    """Each command outside LIGHT_COMMANDS, run without torch and hivemind: one line naming the extra,
    exit 2, no traceback (export ended in a ModuleNotFoundError traceback). A new command must take
    its place in one list or the other."""
    from diloco_swarm.cli.app import app
    from diloco_swarm.cli.common import LIGHT_COMMANDS

    commands = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert set(LIGHT_COMMANDS) < commands, commands
    needs_node = sorted(commands - set(LIGHT_COMMANDS))
    assert {"join", "demo", "export"} <= set(needs_node), needs_node
    for command in needs_node:  # with no flags: each must refuse before it reads any
        r = subprocess.run([sys.executable, "-c", WITHOUT_NODE, command], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 2 and "Traceback" not in r.stderr, (command, r.stderr)
        assert r.stderr.strip().splitlines() == [r.stderr.strip()], (command, r.stderr)
        assert f"`diloco-node {command}` needs the node extra (torch is not installed)" in r.stderr, r.stderr
        assert "pip install 'diloco-swarm[node]'" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())  # nothing made (export's default --out, a state dir)


# ------------------------------------------------------------------------------ a live swarm
# Real `diloco-node join` processes; one swarm serves every test below (module scope).
STATIC = ("peer_id", "name", "version", "device", "precision", "reachability", "maddrs", "owner")
GROWING = ("outer_step", "updated", "tokens_total", "uptime_s")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, timeout: float = 120, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "diloco_swarm", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO if python == sys.executable else "/")


def watched(args: list[str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``diloco-node ARGS``; :returns: the result and the command lines of every descendant seen meanwhile."""
    proc = subprocess.Popen([*NODE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(_cmdlines(process_tree(proc.pid)[1:]))
        time.sleep(0.05)
    out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), sorted(seen)


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return out


def status_doc(swarm, *extra: str, peers: list[str] | None = None) -> dict:
    r = cli("status", "--initial-peers", " ".join(peers or [swarm.a.maddr()]), "--run-id", swarm.run_id, "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def by_owner(doc: dict) -> dict[str, dict]:
    return {p["owner"]: p for p in doc["peers"]}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    from swarmlib import Swarm

    root = tmp_path_factory.mktemp("light")
    with Swarm(root, f"light-{os.getpid()}") as s:
        s.a = s.start("a", "--name", "alpha")
        s.b = s.start("b", "--name", "beta", initial=s.a)
        s.root = root
        # both records readable before any comparison (the light read is the cheaper one)
        def both_owners():
            owners = set(by_owner(status_doc(s, "--light")))
            return owners if len(owners) == 2 else None

        s.owners = s.wait(both_owners, 120, "both peers' records in the DHT")
        yield s


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_light_status_matches_hivemind_and_starts_no_daemon(swarm):
    h1 = status_doc(swarm)
    light, light_children = watched(["status", "--initial-peers", swarm.a.maddr(), "--run-id", swarm.run_id,
                                     "--json", "--light"])
    # the light path starts no daemon; the hivemind path starts p2pd (so this check can fail). The only
    # children of the light path are the one-shot `/sbin/ldconfig -p` that trio's and ifaddr's imports run
    # (ctypes.util.find_library); one caught after it exited but before it was reaped reads as ''.
    heavy, heavy_children = watched(["status", "--initial-peers", swarm.a.maddr(), "--run-id", swarm.run_id, "--json"])
    assert heavy.returncode == 0 and any("p2pd" in c for c in heavy_children), heavy_children
    assert [c for c in light_children if c.strip() and not c.startswith("/sbin/ldconfig ")] == [], light_children
    h2 = json.loads(heavy.stdout)
    assert light.returncode == 0, light.stderr
    doc = json.loads(light.stdout)
    assert doc.keys() == h1.keys() and doc["summary"].keys() == h1["summary"].keys()
    first, mine, last = by_owner(h1), by_owner(doc), by_owner(h2)
    assert len(mine) == 2 and mine.keys() == first.keys() == last.keys()
    for owner, row in mine.items():
        assert row.keys() == first[owner].keys()
        assert {k: row[k] for k in STATIC} == {k: first[owner][k] for k in STATIC}
        # records are republished every 5 s while the nodes train: the light read sits between two hivemind reads
        for k in GROWING:
            assert first[owner][k] <= row[k] <= last[owner][k], (k, first[owner][k], row[k], last[owner][k])
        for same in (first[owner], last[owner]):  # the same publication: every field equal (digests included)
            if same["updated"] == row["updated"]:
                assert {k: v for k, v in row.items() if k not in ("age_s", "state")} == \
                       {k: v for k, v in same.items() if k not in ("age_s", "state")}


def _dashboard(swarm, name: str, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(swarm.root / f"{name}.log", "w")
    proc = subprocess.Popen([*NODE, "dashboard", "--initial-peers", swarm.a.maddr(), "--run-id", swarm.run_id,
                             "--port", str(port), "--state-dir", str(swarm.root / name), "--poll-s", "1", *extra],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    return proc, port


def _state(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/api/v1/state?history=0", timeout=5).json()


def _metric_series(port: int) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {f"{s.name}{sorted(s.labels.items())}" for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_light_dashboard_matches_hivemind(swarm):
    light, light_port = _dashboard(swarm, "dash-light", "--light")
    heavy, heavy_port = _dashboard(swarm, "dash-hivemind")
    try:
        def both_online():
            try:
                docs = _state(light_port), _state(heavy_port)
            except httpx.HTTPError:
                return None
            return docs if all(d["totals"]["peers_online"] == 2 for d in docs) else None

        mine, theirs = swarm.wait(both_online, 120, "both dashboards show 2 online peers")
        assert mine.keys() == theirs.keys() and mine["config"] == theirs["config"]
        assert mine["totals"].keys() == theirs["totals"].keys()
        assert mine["peers"] and {p["owner"]: {k: p[k] for k in STATIC} for p in mine["peers"]} == \
               {p["owner"]: {k: p[k] for k in STATIC} for p in theirs["peers"]}
        assert _metric_series(light_port) == _metric_series(heavy_port)
        assert process_tree(light.pid)[1:] == []  # no p2pd, no helper process
    finally:
        for proc in (light, heavy):
            proc.terminate()
        for proc in (light, heavy):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
    assert light.returncode == 0


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_forged_and_tampered_records_are_dropped(swarm):
    forger = subprocess.Popen([sys.executable, str(REPO / "tests" / "light_forger.py"), swarm.run_id, swarm.a.maddr()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, start_new_session=True)
    try:
        line = _first_line(forger, 120)
        assert "/p2p/" in line, forger.stderr.read() if forger.poll() is not None else line
        # the forger first: the light client reads its forged dictionary, and must drop it
        doc = status_doc(swarm, "--light", peers=[line, swarm.a.maddr()])
        names = {p["name"] for p in doc["peers"]}
        assert "TAMPERED" not in names and "FORGED" not in names, names
        assert set(by_owner(doc)) == swarm.owners
        assert all(p["outer_step"] < 999_999 and p["peer_id"] != "FORGEDPEER" for p in doc["peers"])
        # through the forger alone: honest peers are still found (their addresses come from p2pd's Kademlia)
        alone = status_doc(swarm, "--light", peers=[line])
        assert set(by_owner(alone)) <= swarm.owners and not {p["name"] for p in alone["peers"]} & {"TAMPERED", "FORGED"}
    finally:
        forger.stdin.close()
        try:
            forger.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(forger.pid, 9)


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError(f"no output within {timeout} s")
    return proc.stdout.readline().strip()


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_probe(swarm):
    live = cli("probe", swarm.a.maddr())
    assert live.returncode == 0, live.stderr
    assert "reachable" in live.stdout and "DHTProtocol.rpc_find" in live.stdout and "/ipfs/id/1.0.0" in live.stdout
    assert f"run {swarm.run_id}" in live.stdout and "outer step" in live.stdout and "alpha" in live.stdout, live.stdout

    closed = swarm.a.maddr().replace(swarm.a.maddr().split("/")[4], str(free_port()), 1)
    start = time.monotonic()
    r = cli("probe", closed, "--timeout", "2")
    assert r.returncode == 1 and "unreachable" in r.stdout, (r.stdout, r.stderr)
    assert time.monotonic() - start < 2 + 30  # the timeout, plus interpreter start on a busy 2-core machine

    r = cli("status", "--light", "--initial-peers", closed, "--run-id", swarm.run_id)
    assert r.returncode == 2 and "none of the --initial-peers answered" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr

    for bad in ("/ip4/127.0.0.1/tcp/5",):  # no /p2p/ part (parse_peer_maddr's other refusals: unit-tested)
        r = cli("probe", bad, "--json")
        assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ------------------------------------------------------------------------------ the base install
@pytest.mark.swarm
@pytest.mark.base_install
@pytest.mark.timeout(900)
def test_base_install_without_torch_or_hivemind(swarm, tmp_path):
    """`pip install diloco-swarm` (no extras) into a fresh virtualenv, from PyPI: status works, join, demo
    and export say what to install.

    The one test that uses the network beyond 127.0.0.1 (pip, about 2 minutes with a warm cache);
    deselect it with `-m "not base_install"`.
    """
    venv = tmp_path / "base"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", str(REPO)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    python = str(venv / "bin" / "python")
    for module in ("torch", "hivemind", "bitsandbytes"):
        r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=60, cwd="/")
        assert r.returncode != 0 and "No module named" in r.stderr, (module, r.stderr)

    r = cli("status", "--initial-peers", swarm.a.maddr(), "--run-id", swarm.run_id, "--json", python=python)
    assert r.returncode == 0, r.stderr
    assert {p["name"] for p in json.loads(r.stdout)["peers"]} == {"alpha", "beta"}
    for command in (["join", "--run-id", "x"], ["demo"], ["export"]):  # every node command: see the unit test above
        r = cli(*command, python=python)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "pip install 'diloco-swarm[node]'" in r.stderr, r.stderr


def test_a_dns_address_is_resolved_and_a_bad_name_is_one_clear_error():
    """/dns4 multiaddrs (which hivemind's daemon dials) resolve to /ip4 ones; a name that does not
    resolve is named in the error (localhost resolves from /etc/hosts: no network is used)."""
    # (py-libp2p is not imported here: its protobufs clash with hivemind's in one process)
    import multiaddr

    from diloco_swarm.light.client import LightError, _resolved

    def resolved(text: str) -> list[str]:
        return [str(a) for a in _resolved(multiaddr.Multiaddr(text), text)]

    assert resolved("/dns4/localhost/tcp/4000") == ["/ip4/127.0.0.1/tcp/4000"]
    assert resolved("/ip4/127.0.0.1/tcp/4000") == ["/ip4/127.0.0.1/tcp/4000"]
    with pytest.raises(LightError, match="cannot resolve no-such-host.invalid"):
        _resolved(multiaddr.Multiaddr("/dns4/no-such-host.invalid/tcp/4000"), "x")
