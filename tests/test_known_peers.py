"""The peers a node remembers in its state dir (diloco_swarm.node.known_peers): a cache, never trusted."""

from __future__ import annotations

import hashlib
import json
import socket

from hivemind.p2p import PeerID

from diloco_swarm.node.known_peers import (FORGET_AFTER_S, MAX_FILE_BYTES, MAX_MADDRS_PER_PEER, MAX_PEERS,
                                           PORT_FILE, known_peers_path, load_known_peers, previous_port,
                                           remember_peers, save_port)

A = "QmXrYYRZm9dFWsiVF8eeJst9kbbLM8ZwKnKbb1dS2U4Hkr"
B = "QmduEXfMqLgassRnJzsERT79N8AQxEd4koBY9HCfbr5WY9"
ME = "QmcaAm1dbxe3yDbWTLWVedDN8xTYf3NXS6TCfAyaMH5dcK"


def peer_id(i: int) -> str:
    """A well-formed peer id (a sha2-256 multihash)."""
    return PeerID(b"\x12\x20" + hashlib.sha256(str(i).encode()).digest()).to_base58()


def addr(peer: str, port: int = 4001, ip: str = "10.0.0.1") -> str:
    return f"/ip4/{ip}/tcp/{port}/p2p/{peer}"


def test_remember_then_load_newest_first(tmp_path):
    assert load_known_peers(tmp_path, "run") == []  # no file
    remember_peers(tmp_path, "run", {A: [addr(A)]}, me=ME, now=1000.0)
    remember_peers(tmp_path, "run", {B: [addr(B, 5), addr(B, 6)]}, me=ME, now=2000.0)
    assert load_known_peers(tmp_path, "run", now=2000.0) == [addr(B, 5), addr(B, 6), addr(A)]
    remember_peers(tmp_path, "run", {A: [addr(A, 7)]}, me=ME, now=3000.0)  # seen again, at a new port
    assert load_known_peers(tmp_path, "run", now=3000.0) == [addr(A, 7), addr(B, 5), addr(B, 6)]
    assert load_known_peers(tmp_path, "another-run") == []


def test_only_usable_addresses_of_the_peer_that_published_them(tmp_path):
    seen = {
        ME: [addr(ME)],  # ourselves
        A: [addr(B), "/ip4/10.0.0.1/tcp/1", "not a multiaddr", addr(A, ip="10.0.0.2") + "/p2p-circuit",
            7, "/ip4/10.0.0.1/udp/1/p2p/" + A, addr(A) + "x" * 300],  # nothing usable
        B: [addr(B, p) for p in range(10)] + [addr(B, 0)],  # capped, deduplicated
    }
    remember_peers(tmp_path, "run", seen, me=ME, now=1.0)
    assert load_known_peers(tmp_path, "run", now=1.0) == [addr(B, p) for p in range(MAX_MADDRS_PER_PEER)]


def test_keeps_the_most_recent_peers_and_forgets_old_ones(tmp_path):
    peers = {peer_id(i): i for i in range(MAX_PEERS + 5)}
    for peer, t in peers.items():
        remember_peers(tmp_path, "run", {peer: [addr(peer)]}, me=ME, now=float(t))
    doc = json.loads(known_peers_path(tmp_path).read_text())
    assert len(doc["peers"]) == MAX_PEERS and peer_id(0) not in doc["peers"]
    now = MAX_PEERS + 4 + FORGET_AFTER_S - 0.5  # only the newest is still young enough
    assert load_known_peers(tmp_path, "run", now=now) == [addr(peer_id(MAX_PEERS + 4))]


def test_a_corrupt_or_hostile_file_is_ignored_with_one_line_and_rewritten(tmp_path):
    path = known_peers_path(tmp_path)
    cases = {
        "{": "not valid JSON",
        "\x00" * 10: "not valid JSON",
        "[]": "not a peers file",
        '{"run_id": "run", "peers": 5}': "not a peers file",
        json.dumps({"run_id": "run", "peers": {A: {"maddrs": "x", "seen": 1}, B: {"maddrs": [addr(B)]}}}):
            "none of its 2 entries has a usable address",
        "x" * (MAX_FILE_BYTES + 1): "larger than",
    }
    for text, why in cases.items():
        path.write_text(text)
        lines = []
        assert load_known_peers(tmp_path, "run", warn=lines.append) == []
        assert len(lines) == 1 and lines[0].startswith(f"warning: ignoring {path}: ") and why in lines[0], lines
    for quiet in ['{"run_id": "other-run", "peers": {}}', '{"run_id": "run", "peers": {}}']:
        path.write_text(quiet)  # another run's file, or nobody seen yet: nothing to say
        lines = []
        assert load_known_peers(tmp_path, "run", warn=lines.append) == [] and lines == []
    path.write_text(json.dumps({"run_id": "run", "peers": {A: {"maddrs": [addr(A), addr(B)], "seen": 5.0}}}))
    assert load_known_peers(tmp_path, "run", now=5.0) == [addr(A)]  # B's address under A's name is dropped
    path.write_text("garbage")
    remember_peers(tmp_path, "run", {B: [addr(B)]}, me=ME, now=9.0)
    assert load_known_peers(tmp_path, "run", now=9.0) == [addr(B)]
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]  # no temp file left


def test_an_unwritable_state_dir_is_not_an_error(tmp_path):
    missing = tmp_path / "gone"  # the directory does not exist: the write fails, nothing raises
    assert remember_peers(missing, "run", {A: [addr(A)]}, me=ME) == 1
    assert load_known_peers(missing, "run") == []


def test_a_fifo_or_directory_never_blocks_and_is_replaced(tmp_path):
    import os

    path = known_peers_path(tmp_path)
    os.mkfifo(path)  # reading a FIFO would block the node's start forever
    lines = []
    assert load_known_peers(tmp_path, "run", warn=lines.append) == []
    assert lines and "not a regular file" in lines[0]
    remember_peers(tmp_path, "run", {A: [addr(A)]}, me=ME, now=1.0)  # replaced by a regular file
    assert load_known_peers(tmp_path, "run", now=1.0) == [addr(A)]
    path.unlink()
    path.mkdir()
    lines = []
    assert load_known_peers(tmp_path, "run", warn=lines.append) == [] and "not a regular file" in lines[0]
    remember_peers(tmp_path, "run", {A: [addr(A)]}, me=ME)  # cannot replace a directory: logged, no raise


def test_public_addresses_are_kept_first(tmp_path):
    maddrs = [addr(A, ip="127.0.0.1"), addr(A, ip="172.17.0.1"), addr(A, ip="10.0.0.5"), addr(A, ip="192.168.1.9"),
              addr(A, ip="93.184.216.34")]  # a node on 0.0.0.0 with a docker bridge, its public address last
    remember_peers(tmp_path, "run", {A: maddrs}, me=ME, now=1.0)
    kept = load_known_peers(tmp_path, "run", now=1.0)
    assert kept[0] == addr(A, ip="93.184.216.34") and addr(A, ip="127.0.0.1") not in kept
    assert len(kept) == MAX_MADDRS_PER_PEER


def test_a_restart_listens_on_its_last_port_when_it_is_free(tmp_path):
    assert previous_port(tmp_path, "127.0.0.1") == 0  # first run: any port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        save_port(tmp_path, ["not an address", addr(ME, port, "127.0.0.1")])
        s.listen()
        assert previous_port(tmp_path, "127.0.0.1") == 0  # taken by someone else now: any port
    assert previous_port(tmp_path, "127.0.0.1") == port
    for junk in ("", "http", "-5", "70000"):
        (tmp_path / PORT_FILE).write_text(junk)
        assert previous_port(tmp_path, "127.0.0.1") == 0
