"""Private runs (issue 37, item 3): invitations and admission passes (diloco_swarm/invites.py), the
organiser's and the volunteer's state dir (cli/private.py), `diloco-node invite`, `join --private` and
`join --invite` refusing bad input in one line, and the refusal of a private run's spec to a stranger.

The admission checks of the averager and the readers are tested with real nodes in the swarm tests.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest

from test_cli_errors import error_line

from diloco_swarm import invites
from diloco_swarm.cli import private
from diloco_swarm.cli.private import AccessError, resolve_access
from diloco_swarm.invites import InvitationError, make_invitation, parse_invitation, pass_problem

NOW = 1_800_000_000.0
DAY = 86400.0
PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
OTHER_PEER = "QmcaAm1dbxe3yDbWTLWVedDN8xTYf3NXS6TCfAyaMH5dcK"
OWNER = "0f" * 32  # records.owner_digest of the record's subkey the pass is bound to
OTHER_OWNER = "e1" * 32
CLI = [sys.executable, "-m", "diloco_swarm"]


@pytest.fixture
def key(tmp_path):
    return invites.organiser_key(tmp_path / "org", create=True)


def invitation(key, run_id="priv", days=7.0):
    return make_invitation(key, run_id, expires_at=NOW + days * DAY)


def check(admission, *, run_id="priv", organiser, peer_id=PEER, owner=OWNER, now=NOW):
    return pass_problem(admission, run_id=run_id, organiser=organiser, peer_id=peer_id, owner=owner, now=now)


# --- the crypto ---------------------------------------------------------------------------------


def test_organiser_key_is_created_once_owner_only_and_loaded_again(tmp_path):
    state = tmp_path / "org"
    with pytest.raises(InvitationError, match="does not exist"):
        invites.organiser_key(state, create=False)
    key = invites.organiser_key(state, create=True)
    path = state / invites.ORGANISER_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert invites.public_key_text(invites.organiser_key(state, create=False)) == invites.public_key_text(key)
    assert invites.public_key_text(invites.organiser_key(state, create=True)) == invites.public_key_text(key)
    path.write_bytes(b"short")
    with pytest.raises(InvitationError, match="not an organiser key"):
        invites.organiser_key(state, create=True)


def test_an_invitation_round_trips_and_admits_the_peer_that_holds_it(key):
    inv = invitation(key)
    parsed = parse_invitation("  " + inv.text() + "\n", now=NOW)
    assert parsed == inv and parsed.organiser == invites.public_key_text(key)
    assert invites.organiser_problem(parsed.organiser) is None
    admission = parsed.admission_pass(PEER, OWNER)
    assert check(admission, organiser=parsed.organiser) is None
    # the record's schema takes it as is
    from diloco_swarm.dht.records import AdmissionPass

    AdmissionPass.parse_obj(admission)


def test_a_changed_or_cut_invitation_is_refused_in_one_line(key):
    text = invitation(key).text()
    body = text[len(invites.INVITATION_PREFIX):]
    variants = [text[:-5], text[:len(invites.INVITATION_PREFIX) + 10], "", "garbage", "diloco-invite-1.",
                "diloco-invite-1.!!!!", text + "x" * 2000, text.replace("diloco-invite-1.", "diloco-invite-2.")]
    for i in range(0, len(body), 7):  # every 7th character changed
        changed = body[:i] + ("A" if body[i] != "A" else "B") + body[i + 1:]
        variants.append(invites.INVITATION_PREFIX + changed)
    for variant in variants:
        try:
            parse_invitation(variant, now=NOW)
        except InvitationError as e:
            assert "\n" not in str(e) and str(e)
        # (a change in base64's padding bits can leave the decoded bytes as they were: then it parses)


@pytest.mark.parametrize("body", [
    {"run": "priv", "org": "ed25519:" + "A" * 43, "exp": "1e999", "key": "A" * 43, "grant": "A" * 86},
    {"run": "priv", "org": "ed25519:" + "A" * 43, "exp": "NaN", "key": "A" * 43, "grant": "A" * 86},
    {"run": "priv", "org": "ed25519:" + "A" * 43, "exp": 1, "key": ["A"], "grant": "A" * 86},
    {"run": "priv", "org": None, "exp": 1, "key": "A" * 43, "grant": "A" * 86},
    {"run": "priv"}, [1, 2], "text", 12,
])
def test_a_crafted_invitation_is_refused_in_one_line(body):
    raw = json.dumps(body).replace('"1e999"', "1e999").replace('"NaN"', "NaN").encode()
    text = invites.INVITATION_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")
    with pytest.raises(InvitationError, match="damaged"):
        parse_invitation(text, now=NOW)


def test_an_invitation_signed_by_another_key_is_refused(key, tmp_path):
    other = invites.organiser_key(tmp_path / "other", create=True)
    inv = invitation(key)
    forged = invites.Invitation(run_id=inv.run_id, organiser=invites.public_key_text(other),
                                expires_at=inv.expires_at, invite_key=inv.invite_key, grant=inv.grant)
    with pytest.raises(InvitationError, match="signature is wrong"):
        parse_invitation(forged.text(), now=NOW)
    # a later expiry than the organiser signed
    longer = invites.Invitation(run_id=inv.run_id, organiser=inv.organiser, expires_at=inv.expires_at + 10 * 365 * 86400,
                                invite_key=inv.invite_key, grant=inv.grant)
    with pytest.raises(InvitationError, match="signature is wrong"):
        parse_invitation(longer.text(), now=NOW)


def test_an_expired_invitation_and_pass_are_refused(key):
    inv = invitation(key, days=1)
    with pytest.raises(InvitationError, match="has expired: ask the run's organiser for a new one"):
        parse_invitation(inv.text(), now=NOW + 2 * DAY)
    admission = inv.admission_pass(PEER, OWNER)
    assert check(admission, organiser=inv.organiser, now=NOW + DAY - 1) is None
    assert check(admission, organiser=inv.organiser, now=NOW + 2 * DAY) == "its invitation has expired"


def test_a_pass_is_refused_for_another_run_another_organiser_or_another_peer(key, tmp_path):
    inv = invitation(key)
    admission = inv.admission_pass(PEER, OWNER)
    other = invites.public_key_text(invites.organiser_key(tmp_path / "other", create=True))
    assert check(admission, organiser=inv.organiser, run_id="another-run") is not None
    assert check(admission, organiser=other) is not None
    # a stranger who copies this pass out of the DHT cannot use it under its own peer id, nor in a record of
    # its own that claims our peer id (the pass is bound to our record's owner key)
    assert check(admission, organiser=inv.organiser, peer_id=OTHER_PEER) is not None
    assert check(admission, organiser=inv.organiser, owner=OTHER_OWNER) is not None
    # nor sign its own peer id without the invitation's private key
    stranger = make_invitation(invites.organiser_key(tmp_path / "other", create=False), "priv", NOW + DAY)
    mixed = {**admission, "proof": stranger.admission_pass(OTHER_PEER, OWNER)["proof"]}
    assert check(mixed, organiser=inv.organiser, peer_id=OTHER_PEER) is not None
    # a pass for an invitation of another run of the same organiser
    assert check(invitation(key, run_id="other").admission_pass(PEER, OWNER), organiser=inv.organiser) is not None


def _malformed_passes(good: dict) -> list:
    values = [None, True, 0, -1, 2**80, 1.5, float("nan"), "", "=", "A" * 43, "A" * 86, "!" * 43, "é" * 43,
              "A" * 10_000, [], {}, [good["key"]], {"k": 1}, b"bytes"]
    out: list = [None, [], "pass", 7, {}]  # (extra fields: the record's schema, AdmissionPass, refuses them)
    for field in good:
        out.append({k: v for k, v in good.items() if k != field})  # missing
        out += [{**good, field: v} for v in values]
    out.append({**good, "key": good["key"] + "A"})
    out.append({**good, "grant": good["proof"], "proof": good["grant"]})
    return out


def test_malformed_passes_of_every_kind_are_refused_and_never_raise(key):
    inv = invitation(key)
    good = inv.admission_pass(PEER, OWNER)
    for bad in _malformed_passes(good):
        problem = check(bad, organiser=inv.organiser)
        assert isinstance(problem, str) and problem, bad
    # a malformed organiser key (our own spec's; never raises either) and peer id
    for organiser in ["", "ed25519:", "ed25519:!!", None, 5]:
        assert check(good, organiser=organiser) is not None
    for peer_id in ["", None, 5, "x" * 10_000]:
        assert check(good, organiser=inv.organiser, peer_id=peer_id) is not None


def test_the_node_publishes_the_pass_of_its_libp2p_peer_id_and_says_when_its_invitation_ends(key, monkeypatch):
    from diloco_swarm.dht.records import normalize_snapshot
    from diloco_swarm.node import invitation as invitation_module
    from diloco_swarm.node.invitation import OurPass

    inv = invitation(key)
    said: list[str] = []
    ours = OurPass(inv, said.append)
    ours.owner = OWNER  # our record key's (node/startup.py)
    admission = ours(PEER)
    assert check(admission, organiser=inv.organiser) is None
    assert ours.shown(PEER) == {**admission, "owner": OWNER}  # what a dial-back request shows
    assert ours(PEER) is admission and not said  # signed once; days from its end: nothing to say
    assert OurPass(None, said.append)(PEER) is None
    record = normalize_snapshot({"peer_id": PEER, "outer_step": 3, "admission": admission}, now=NOW)
    assert record["admission"] == admission
    # a day before its end, one line; once ended, one more (the others refuse us from then on)
    monkeypatch.setattr(invitation_module.clock, "now", lambda: inv.expires_at - 3600)
    ours(PEER), ours(PEER)
    assert len(said) == 1 and "expires at" in said[0] and "--invite NEW_FILE" in said[0]
    monkeypatch.setattr(invitation_module.clock, "now", lambda: inv.expires_at + 1)
    ours(PEER), ours(PEER)
    assert len(said) == 2 and "expired at" in said[1]


# --- the state dir: cli/private.py ----------------------------------------------------------------


def access(tmp_path, name, *, run_id=None, private=False, invite=None, given=True, now=NOW):
    """``resolve_access``, and its files saved as the node saves them once it holds the state dir."""
    from diloco_swarm.node.invitation import save_private_files

    found = resolve_access(run_id=run_id, state_dir=tmp_path / name, state_dir_given=given, private=private,
                           invite=invite, now=now)
    save_private_files(found.saves)
    return found


def test_a_public_run_needs_nothing(tmp_path):
    assert access(tmp_path, "a", run_id="pub") == private.Access("pub")
    assert access(tmp_path, "a", given=False).run_id == "diloco-demo"
    assert not (tmp_path / "a").exists()


def test_the_organiser_starts_restarts_and_admits_itself(tmp_path):
    with pytest.raises(AccessError, match="--private starts a new run: name it with --run-id"):
        access(tmp_path, "unnamed", private=True)
    first = access(tmp_path, "org", run_id="priv", private=True)
    assert first.is_organiser and first.run_id == "priv"
    assert first.organiser == first.invitation.organiser
    assert first.invitation.expires_at >= NOW + 364 * DAY
    assert check(first.invitation.admission_pass(PEER, OWNER), organiser=first.organiser) is None
    run = json.loads((tmp_path / "org" / private.PRIVATE_RUN_FILE).read_text())
    assert run == {"run_id": "priv", "organiser": first.organiser}
    # a restart needs neither --private nor --run-id; the same key, a fresh invitation
    again = access(tmp_path, "org", now=NOW + 400 * DAY)
    assert (again.run_id, again.organiser, again.is_organiser) == ("priv", first.organiser, True)
    assert again.invitation.expires_at > NOW + 400 * DAY
    assert access(tmp_path, "org", run_id="priv", private=True).organiser == first.organiser
    with pytest.raises(AccessError, match="organiser's of private run 'priv': restart it with --run-id priv"):
        access(tmp_path, "org", run_id="other")
    with pytest.raises(AccessError, match="holds the organiser key of a private run"):
        access(tmp_path, "org", invite=first.invitation.text())
    (tmp_path / "org" / invites.ORGANISER_KEY_FILE).unlink()
    with pytest.raises(AccessError, match="organiser.key is missing: restore"):
        access(tmp_path, "org", private=True)
    assert not (tmp_path / "org" / invites.ORGANISER_KEY_FILE).exists()  # no new key under the old run


def test_an_organiser_whose_first_start_failed_may_take_another_run_id(tmp_path):
    """(e.g. the run id was a public run's already): until a checkpoint is written, --private rebinds."""
    first = access(tmp_path, "org", run_id="taken", private=True)
    again = access(tmp_path, "org", run_id="mine", private=True)
    assert (again.run_id, again.organiser) == ("mine", first.organiser)
    assert private.read_private_run(tmp_path / "org")["run_id"] == "mine"
    (tmp_path / "org" / private.CHECKPOINT_NAME).write_bytes(b"trained")
    with pytest.raises(AccessError, match="organiser's of private run 'mine'"):
        access(tmp_path, "org", run_id="third", private=True)


def test_private_needs_its_own_state_dir(tmp_path):
    with pytest.raises(AccessError, match="--private needs --state-dir"):
        access(tmp_path, "org", private=True, given=False)
    with pytest.raises(AccessError, match="give one of them"):
        access(tmp_path, "org", private=True, invite="x")
    public = tmp_path / "pub"
    public.mkdir()
    (public / private.CHECKPOINT_NAME).write_bytes(b"a public run's checkpoint")
    with pytest.raises(AccessError, match="checkpoint of a public run"):
        access(tmp_path, "pub", private=True)
    assert not (public / invites.ORGANISER_KEY_FILE).exists()


def test_the_checkpoint_name_is_the_nodes():
    from diloco_swarm.node.checkpoint import CHECKPOINT_NAME

    assert private.CHECKPOINT_NAME == CHECKPOINT_NAME


def test_a_volunteer_joins_with_a_file_or_the_text_and_restarts_without_it(tmp_path):
    org = access(tmp_path, "org", run_id="priv", private=True)
    key = invites.organiser_key(tmp_path / "org", create=False)
    text = invitation(key).text()
    (tmp_path / "invite.txt").write_text(text + "\n")
    # nothing is written before the node holds the state dir and has checked its checkpoint
    resolve_access(run_id=None, state_dir=tmp_path / "v1", state_dir_given=True, private=False, invite=text, now=NOW)
    assert not (tmp_path / "v1").exists()
    for source, name in ((str(tmp_path / "invite.txt"), "v1"), (text, "v2")):
        joined = access(tmp_path, name, invite=source)
        assert (joined.run_id, joined.organiser, joined.is_organiser) == ("priv", org.organiser, False)
        saved = tmp_path / name / invites.INVITATION_FILE
        assert saved.read_text().strip() == text and stat.S_IMODE(saved.stat().st_mode) == 0o600
        restarted = dataclasses.replace(joined, saves=())  # a restart reads it, and has nothing to save
        assert access(tmp_path, name) == restarted
        assert access(tmp_path, name, run_id="priv") == restarted
    with pytest.raises(AccessError, match="is for run 'priv', not 'other'"):
        access(tmp_path, "v3", invite=text, run_id="other")
    assert not (tmp_path / "v3").exists()
    with pytest.raises(AccessError, match="invitation.txt, the invitation this node joined with, cannot be used: "
                                          ".*expired.*pass a new one with --invite"):
        access(tmp_path, "v1", now=NOW + 8 * DAY)
    renewed = make_invitation(key, "priv", NOW + 30 * DAY).text()
    assert access(tmp_path, "v1", invite=renewed, now=NOW + 8 * DAY).invitation.text() == renewed
    with pytest.raises(AccessError, match="a volunteer's"):
        access(tmp_path, "v1", private=True)
    with pytest.raises(AccessError, match="neither a file nor an invitation"):
        access(tmp_path, "v4", invite="garbage")
    (tmp_path / "garbage.txt").write_text("garbage")
    with pytest.raises(AccessError, match="not a diloco-swarm invitation"):
        access(tmp_path, "v4", invite=str(tmp_path / "garbage.txt"))
    with pytest.raises(AccessError, match="has expired"):
        access(tmp_path, "v4", invite=text, now=NOW + 8 * DAY)
    assert not (tmp_path / "v4").exists()


# --- the spec in the DHT: a stranger's join ----------------------------------------------------------


def test_joining_a_private_run_without_its_invitation_is_one_line(monkeypatch):
    from diloco_swarm.dht import swarm
    from diloco_swarm.spec import RunSpec, SpecMismatch

    base = dict(run_id="priv", model="tiny", dataset="python-stdlib", seq_len=64, inner_steps=10, inner_lr=1e-3,
                outer_lr=0.7, outer_momentum=0.9, seed=0)
    org_a, org_b = "ed25519:" + "A" * 43, "ed25519:" + "B" * 43
    published: dict = {}
    monkeypatch.setattr(swarm, "dht_get", lambda dht, key, latest=True: SimpleNamespace(value=published["spec"]))
    monkeypatch.setattr(swarm, "dht_store", lambda *a, **k: True)

    def join(ours, theirs):
        published["spec"] = RunSpec(**{**base, **theirs}).model_dump()
        return swarm.ensure_run_spec(None, RunSpec(**{**base, **ours}), joining=True, attempts=1)

    with pytest.raises(swarm.PrivateRunMismatch) as info:
        join({"seq_len": 32}, {"organiser": org_a})  # the other field is not what matters
    assert str(info.value) == ("run 'priv' is private: ask its organiser for an invitation (they run "
                               "`diloco-node invite --state-dir DIR`) and join with --invite")
    assert isinstance(info.value, SpecMismatch)  # cli/app.py: one line, exit 2
    with pytest.raises(swarm.PrivateRunMismatch, match="this invitation is for another organiser of run 'priv'"):
        join({"organiser": org_b}, {"organiser": org_a})
    with pytest.raises(swarm.PrivateRunMismatch, match="run 'priv' is a public run: join it without --invite"):
        join({"organiser": org_a}, {})
    with pytest.raises(SpecMismatch, match="seq_len"):
        join({"organiser": org_a, "seq_len": 32}, {"organiser": org_a})
    assert join({"organiser": org_a}, {"organiser": org_a}) is True


def test_a_checkpoint_of_the_other_kind_of_run_is_one_line(tmp_path):
    from diloco_swarm.node.startup import _organiser_mismatch

    key = "ed25519:" + "A" * 43
    assert "checkpoint of the public run 'r': a private run needs a state dir of its own" in \
        _organiser_mismatch(tmp_path, "r", None, key)
    assert "checkpoint of the private run 'r': join it with --invite" in _organiser_mismatch(tmp_path, "r", key, None)
    assert "another organiser" in _organiser_mismatch(tmp_path, "r", key, "ed25519:" + "B" * 43)


# --- the commands ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def poisoned_env(tmp_path_factory):
    """torch and hivemind fail on import: `invite` needs neither, and `join` refuses bad private-run input
    before it loads them."""
    root = tmp_path_factory.mktemp("poison")
    for name in ("torch", "hivemind"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(f"raise ImportError('{name} imported before the input was checked')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def run(env, cwd, *args):
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_invite_prints_exactly_one_invitation(poisoned_env, tmp_path):
    first = access(tmp_path, "org", run_id="priv", private=True)
    out = run(poisoned_env, tmp_path, "invite", "--state-dir", str(tmp_path / "org"), "--expires", "2.5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1 and out.stdout.startswith(invites.INVITATION_PREFIX)
    from diloco_swarm.utils import clock

    inv = parse_invitation(out.stdout, now=clock.now())
    assert (inv.run_id, inv.organiser) == ("priv", first.organiser)
    assert abs(inv.expires_at - (clock.now() + 2.5 * DAY)) < 120
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "private run 'priv', valid until" in lines[0] and "UTC" in lines[0]
    assert "--invite FILE" in lines[0]
    default = run(poisoned_env, tmp_path, "invite", "--state-dir", str(tmp_path / "org"))
    assert abs(parse_invitation(default.stdout, now=clock.now()).expires_at - (clock.now() + 7 * DAY)) < 120


@pytest.mark.parametrize("name, args, fragments", [
    ("no-key", ["invite", "--state-dir", "{tmp}/nothing"], ["organiser.key does not exist"]),
    ("no-state-dir", ["invite"], ["--state-dir"]),
    ("expires-0", ["invite", "--state-dir", "{tmp}/org", "--expires", "0"], ["--expires must be more than 0"]),
    ("expires-negative", ["invite", "--state-dir", "{tmp}/org", "--expires", "-1"], ["--expires must be more than 0"]),
    ("expires-huge", ["invite", "--state-dir", "{tmp}/org", "--expires", "3651"], ["at most 3650 days"]),
    ("expires-nan", ["invite", "--state-dir", "{tmp}/org", "--expires", "nan"], ["--expires", "nan"]),
    ("expires-word", ["invite", "--state-dir", "{tmp}/org", "--expires", "week"], ["--expires", "valid number"]),
    ("join-invite-garbage", ["join", "--state-dir", "{tmp}/v", "--invite", "garbage"],
     ["--invite 'garbage' is neither a file nor an invitation"]),
    ("join-invite-missing-file", ["join", "--state-dir", "{tmp}/v", "--invite", "{tmp}/no-such.txt"],
     ["no-such.txt' is neither a file nor an invitation"]),
    ("join-invite-cut", ["join", "--state-dir", "{tmp}/v", "--invite", "diloco-invite-1.eyJydW4iOiJw"],
     ["this invitation is damaged"]),
    ("join-invite-empty-file", ["join", "--state-dir", "{tmp}/v", "--invite", "{tmp}/empty.txt"],
     ["not a diloco-swarm invitation"]),
    ("join-invite-other-run", ["join", "--state-dir", "{tmp}/v", "--run-id", "other", "--invite", "{tmp}/invite.txt"],
     ["is for run 'priv', not 'other'"]),
    ("join-private-no-state-dir", ["join", "--private"], ["--private needs --state-dir"]),
    ("join-private-and-invite", ["join", "--state-dir", "{tmp}/v", "--private", "--invite", "{tmp}/invite.txt"],
     ["--private starts a private run and --invite joins one"]),
    ("join-organiser-with-invite", ["join", "--state-dir", "{tmp}/org", "--invite", "{tmp}/invite.txt"],
     ["holds the organiser key", "drop --invite"]),
    ("join-organiser-other-run", ["join", "--state-dir", "{tmp}/org", "--run-id", "other"],
     ["organiser's of private run 'priv'"]),
])
def test_bad_private_run_input_is_one_line_before_the_heavy_imports(poisoned_env, tmp_path, name, args, fragments):
    access(tmp_path, "org", run_id="priv", private=True)
    key = invites.organiser_key(tmp_path / "org", create=False)
    from diloco_swarm.utils import clock

    (tmp_path / "invite.txt").write_text(make_invitation(key, "priv", clock.now() + DAY).text())
    (tmp_path / "empty.txt").write_text("")
    out = run(poisoned_env, tmp_path, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    line = error_line(out.stderr, out.returncode, out.stdout)
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} missing from: {line}"
    assert not (tmp_path / "v").exists()  # nothing saved
