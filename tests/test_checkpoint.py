"""Tests for diloco_swarm.node.checkpoint: atomic saves, one file, format 1 still read, corrupt files."""

import os
import subprocess
import sys
import textwrap

import threading

import pytest
import torch

from diloco_swarm.node.checkpoint import (
    CHECKPOINT_NAME,
    PREVIOUS_NAME,
    CheckpointError,
    checkpoint_path,
    load_checkpoint,
    remove_stale_temp_files,
    save_checkpoint,
)


def state(step, n=1000):
    g = torch.Generator().manual_seed(step)
    return {
        "spec": {"run_id": "r1", "inner_lr": 1e-3, "seq_len": 32},
        "outer_step": step,
        "tokens_total": 1000 * step,
        "outer": {"theta": [torch.randn(n, generator=g), torch.randn(4, 5, generator=g)], "optimizer": {"state": {}}},
        "note": None,
        "pair": (1, 2.5),
    }


def format_1_file(path, step):
    """A checkpoint as format 1 wrote it (before the memory work): the inner AdamW state too."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    torch.save({"format_version": 1, **state(step), "inner_optimizer": opt.state_dict()}, path)


def assert_same(a, b):
    assert type(a) is type(b) or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)))
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def listing(state_dir):
    return sorted(os.listdir(state_dir))


def test_save_load_roundtrip(tmp_path):
    s = state(1)
    path = save_checkpoint(tmp_path / "st", s)
    assert path == checkpoint_path(tmp_path / "st") == tmp_path / "st" / CHECKPOINT_NAME
    loaded = load_checkpoint(path)
    assert loaded.pop("format_version") == 2
    assert_same(loaded, s)
    assert listing(tmp_path / "st") == [CHECKPOINT_NAME]


def test_missing_checkpoint_loads_as_none(tmp_path):
    assert load_checkpoint(tmp_path / CHECKPOINT_NAME) is None


def test_a_second_save_replaces_the_first_and_keeps_no_copy(tmp_path):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    assert load_checkpoint(tmp_path / CHECKPOINT_NAME)["outer_step"] == 2
    assert listing(tmp_path) == [CHECKPOINT_NAME]  # at most 8 B/param of outer state on disk: no second copy


def test_a_format_1_checkpoint_loads_and_its_copy_goes_at_the_next_save(tmp_path):
    format_1_file(tmp_path / CHECKPOINT_NAME, 4)
    format_1_file(tmp_path / PREVIOUS_NAME, 3)
    loaded = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert loaded["format_version"] == 1 and loaded["outer_step"] == 4
    assert_same(loaded["outer"], state(4)["outer"])
    save_checkpoint(tmp_path, state(5))
    assert listing(tmp_path) == [CHECKPOINT_NAME]


def test_a_saved_file_maps_the_tensors_instead_of_reading_them(tmp_path):
    """The loader memory-maps the file: a resumed llama-1b does not hold a second copy of its state."""
    save_checkpoint(tmp_path, state(1, n=1 << 20))
    loaded = load_checkpoint(tmp_path / CHECKPOINT_NAME)
    address = loaded["outer"]["theta"][0].data_ptr()
    mapped = []
    for line in open("/proc/self/maps"):  # "start-end perms offset dev inode path"
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            mapped = fields[5:]
    assert mapped == [str(tmp_path / CHECKPOINT_NAME)]


def _corrupt_cases(good_bytes):
    return {
        "truncated": good_bytes[: len(good_bytes) // 2],
        "truncated_tiny": good_bytes[:20],
        "truncated_5000": good_bytes[:5000],  # torch.load fails with OSError(EINVAL) here, not a format error
        "empty": b"",
        "garbage": b"this is not a checkpoint\n" * 40,
        "zeros": bytes(4096),
    }


@pytest.mark.parametrize("case", ["truncated", "truncated_tiny", "truncated_5000", "empty", "garbage", "zeros"])
def test_corrupt_checkpoint_raises_a_clear_error_and_is_left_untouched(tmp_path, case):
    save_checkpoint(tmp_path, state(1))
    bad = _corrupt_cases((tmp_path / CHECKPOINT_NAME).read_bytes())[case]
    path = tmp_path / CHECKPOINT_NAME
    path.write_bytes(bad)
    mtime = path.stat().st_mtime_ns
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message
    assert "is corrupt or truncated" in message  # the wording docs/operations.md promises
    assert "start fresh" in message and f"mv {path}" in message
    assert "\n" not in message and len(message) < 400
    assert "weights_only" not in message  # torch's long advice about trusting files is no use here
    assert path.read_bytes() == bad and path.stat().st_mtime_ns == mtime
    assert listing(tmp_path) == [CHECKPOINT_NAME]


def test_flipped_bits_in_a_tensor_are_refused_not_loaded_as_values(tmp_path):
    """torch.load does not check the stored bytes: a flipped byte in θ_global would load as a huge value."""
    good = state(1)
    save_checkpoint(tmp_path, good)
    path = tmp_path / CHECKPOINT_NAME
    data = bytearray(path.read_bytes())
    at = bytes(data).find(good["outer"]["theta"][0].numpy().tobytes())
    assert at > 0
    data[at + 100 : at + 140] = bytes(b ^ 0xFF for b in data[at + 100 : at + 140])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"is corrupt or truncated \(.* fails its CRC-32 check\)"):
        load_checkpoint(path)
    assert path.read_bytes() == bytes(data)


def test_corrupt_checkpoint_message_offers_format_1s_previous_one(tmp_path):
    format_1_file(tmp_path / PREVIOUS_NAME, 1)
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="restore the previous one") as info:
        load_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert str(tmp_path / PREVIOUS_NAME) in str(info.value)


def test_an_unreadable_checkpoint_says_so_not_corrupt(tmp_path):
    (tmp_path / CHECKPOINT_NAME).mkdir()  # a folder in its place: open() fails, whatever the permissions
    with pytest.raises(CheckpointError, match=r"cannot be read \(Is a directory\)"):
        load_checkpoint(tmp_path / CHECKPOINT_NAME)


def test_a_torch_file_of_something_else_is_refused(tmp_path):
    path = tmp_path / CHECKPOINT_NAME
    torch.save([torch.zeros(3)], path)  # a valid torch file, not our dict
    with pytest.raises(CheckpointError, match="not a diloco-swarm checkpoint"):
        load_checkpoint(path)
    torch.save({"format_version": 0}, path)
    with pytest.raises(CheckpointError, match="not a diloco-swarm checkpoint of format 2"):
        load_checkpoint(path)
    torch.save({"format_version": 99}, path)  # a newer node's file: say so, do not call it foreign
    with pytest.raises(CheckpointError, match="format 99, newer than this version reads"):
        load_checkpoint(path)


def test_a_checkpoint_holding_arbitrary_objects_is_refused_not_executed(tmp_path):
    path = tmp_path / CHECKPOINT_NAME
    torch.save({"format_version": 1, "evil": os.system}, path)
    with pytest.raises(CheckpointError, match=r"corrupt .*posix\.system|corrupt .*os\.system") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)


def test_unpicklable_state_fails_and_keeps_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, state(1))
    before = (tmp_path / CHECKPOINT_NAME).read_bytes()
    with pytest.raises(Exception, match="pickle"):
        save_checkpoint(tmp_path, {**state(2), "callback": lambda: 0})
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == before
    assert listing(tmp_path) == [CHECKPOINT_NAME]  # no temp file, no prev made from a failed save
    assert load_checkpoint(tmp_path / CHECKPOINT_NAME)["outer_step"] == 1


def test_state_that_would_not_load_back_is_refused_at_save_time(tmp_path):
    """Picklable but refused by torch.load(weights_only=True): it must fail now, not at the next start."""
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    cur = (tmp_path / CHECKPOINT_NAME).read_bytes()
    with pytest.raises(TypeError, match="PosixPath"):
        save_checkpoint(tmp_path, {**state(3), "where": tmp_path})
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == cur
    assert listing(tmp_path) == [CHECKPOINT_NAME]


@pytest.mark.timeout(60)
def test_disk_write_failure_keeps_the_checkpoint_and_leaves_no_temp_files(tmp_path):
    """A real failing write: the child process may not grow files past 64 KiB (as on a full disk)."""
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    cur = (tmp_path / CHECKPOINT_NAME).read_bytes()
    assert len(cur) < 64 * 1024
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        from pathlib import Path
        import torch
        from diloco_swarm.node.checkpoint import save_checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            save_checkpoint(Path({str(tmp_path)!r}), {{"outer_step": 3, "big": torch.zeros(1_000_000)}})
        except BaseException as e:
            print("FAILED", type(e).__name__, e)
            sys.exit(0)
        print("SAVED")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    # torch alone would report "unexpected pos ..."; the caller (diloco-node) needs an OSError to say so clearly
    assert proc.stdout.startswith("FAILED OSError"), proc.stdout + proc.stderr
    assert "File too large while writing the checkpoint" in proc.stdout
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == cur
    assert listing(tmp_path) == [CHECKPOINT_NAME]
    assert load_checkpoint(tmp_path / CHECKPOINT_NAME)["outer_step"] == 2


def test_a_write_killed_midway_leaves_a_temp_file_that_the_next_start_removes(tmp_path):
    """A real crash inside save_checkpoint (SIGXFSZ's default action kills the writer mid-write)."""
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    cur = (tmp_path / CHECKPOINT_NAME).read_bytes()
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pathlib import Path
        import torch
        from diloco_swarm.node.checkpoint import save_checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; its default action kills
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        save_checkpoint(Path({str(tmp_path)!r}), {{"outer_step": 3, "big": torch.zeros(1_000_000)}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert proc.returncode < 0, proc.stdout + proc.stderr  # killed by the signal, no cleanup ran
    stale = [name for name in listing(tmp_path) if name.endswith(".tmp")]
    assert stale and all(name.startswith(".checkpoint.") for name in stale)
    unrelated = {"identity.key": b"key", "notes.tmp": b"mine", "checkpoint.pt.tmp": b"not ours"}
    for name, data in unrelated.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".checkpoint.abc.tmp").write_bytes(b"another dir")
    (tmp_path / ".checkpoint.dir.tmp").mkdir()

    removed = remove_stale_temp_files(tmp_path)

    assert sorted(p.name for p in removed) == sorted(stale)
    assert listing(tmp_path) == sorted([CHECKPOINT_NAME, ".checkpoint.dir.tmp", "sub", *unrelated])
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == cur
    assert (tmp_path / "sub" / ".checkpoint.abc.tmp").exists()
    assert all((tmp_path / name).read_bytes() == data for name, data in unrelated.items())
    assert remove_stale_temp_files(tmp_path) == []
    assert remove_stale_temp_files(tmp_path / "no-such-dir") == []


def test_resume_refuses_non_finite_state_and_negative_counters(tmp_path, checkpoint_copy):
    """A checkpoint whose bytes were flipped can still load; NaN in the outer momentum must be
    refused at resume (one clear error), not trained on until "diverged"."""
    from diloco_swarm.models import build_model
    from diloco_swarm.node.checkpoint import CheckpointError
    from diloco_swarm.node.config import NodeConfig
    from diloco_swarm.node.global_state import GlobalState, ThetaHistory
    from diloco_swarm.node.outer import OuterOptimizer
    from diloco_swarm.node.runner import Node
    from diloco_swarm.spec import RunSpec

    def fresh_node():
        spec = RunSpec(run_id="resume-nan", model="tiny", dataset="python-stdlib", seq_len=32, inner_steps=2,
                       inner_lr=1e-3, outer_lr=0.7, outer_momentum=0.9, compression="int8", seed=0)
        node = Node(NodeConfig(spec=spec, state_dir=tmp_path))
        node.params = list(build_model("tiny", seed=0).parameters())
        node.state = GlobalState(OuterOptimizer(node.params, lr=0.7, momentum=0.9), lock=threading.Lock(),
                                 history=ThetaHistory(), marks=node.stats.theta_marks)
        return node

    node = fresh_node()
    node.state.outer.step([torch.full_like(t, 1e-3) for t in node.state.theta])
    ckpt = {"outer": checkpoint_copy(node.state.outer.state_dict()), "outer_step": 3, "inner_steps_total": 6,
            "tokens_total": 100}
    fresh_node()._restore(ckpt)  # a healthy checkpoint resumes
    resumed = fresh_node()
    resumed._restore({**ckpt, "restarted_below": 2})  # a restarted lineage's debt resumes with it
    assert (resumed.state.step, resumed.state.standing) == (3, 2)  # (half its steps, rounded up: mixing.standing)
    with pytest.raises(CheckpointError, match="restarted_below = -1"):
        fresh_node()._restore({**ckpt, "restarted_below": -1})
    ckpt["outer"]["optimizer"]["state"][0]["momentum_buffer"][0] = float("nan")
    with pytest.raises(CheckpointError, match="non-finite"):
        fresh_node()._restore(ckpt)
    ckpt["outer"]["optimizer"]["state"][0]["momentum_buffer"][0] = 0.0
    ckpt["outer_step"] = -5  # a hand-edited counter: a node would resume "at outer step -5"
    with pytest.raises(CheckpointError, match="outer_step = -5"):
        fresh_node()._restore(ckpt)
