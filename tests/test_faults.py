"""The faulty node's entry point (tests/faults.py) and the product's lack of one.

``diloco-node join`` has no fault flag; ``python -m tests.faults join ... --fault NAME[=VALUE]`` starts
the product's node with faulty subclasses mixed in. Its misuse is said in one line with exit code 2.
The swarm tests that use the faults (test_churn, test_stop_paths, test_hostile_state, test_swarm,
test_overlap) show that they take effect.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import faults
from diloco_swarm.averaging.averager import PseudoGradientAverager
from diloco_swarm.node.runner import Node
from test_cli_errors import error_line

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)


def test_the_product_has_no_fault_flags():
    for flag in (["--fault", "nan"], ["--slowdown", "3"]):
        out = run("-m", "diloco_swarm", "join", *flag)
        assert out.returncode == 2 and "No such option" in out.stderr and flag[0] in out.stderr, out.stderr
    shown = run("-m", "diloco_swarm", "join", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "--fault" not in shown.stdout and "slowdown" not in shown.stdout.lower(), shown.stdout


@pytest.mark.parametrize("entry", [["-m", "tests.faults"], [str(REPO / "tests" / "faults.py")]], ids=["module", "path"])
def test_an_unknown_fault_is_one_error_line(entry, tmp_path):
    """Both ways to run it (``-m`` from the repository root, the path from anywhere) refuse a bad name
    before starting anything, naming every fault."""
    out = run(*entry, "join", "--state-dir", str(tmp_path / "state"), "--fault", "bogus",
              cwd=REPO if entry[0] == "-m" else tmp_path)
    line = error_line(out.stderr, out.returncode, out.stdout)
    assert "--fault must be one of" in line and "'bogus'" in line, line
    assert all(name in line for name in faults.FAULTS), line
    assert not (tmp_path / "state").exists()


def test_help_lists_every_fault():
    out = run("-m", "tests.faults", "--help")
    assert out.returncode == 0, out.stderr
    assert "python -m tests.faults join" in out.stdout
    for name in faults.FAULTS:
        assert f"\n  {name}" in out.stdout, name


@pytest.mark.parametrize("args, said", [
    (["join", "--fault", "slowdown=0.5"], "needs a finite number F ≥ 1; got 'slowdown=0.5'"),
    (["join", "--fault", "slowdown=inf"], "needs a finite number"),
    (["join", "--fault", "slowdown"], "needs a finite number"),
    (["join", "--fault", "nan=3"], "--fault nan takes no value"),
    (["join", "--fault=NAN"], "--fault must be one of"),
    (["join", "--max-outer-steps", "3", "--fault"], "--fault needs a fault"),
    (["join", "--fault", "late-end", "--fault", "late-before-end"], "exclude each other"),
    (["join", "--fault", "direction=0"], "needs a finite number F > 0; got 'direction=0'"),
    (["join", "--fault", "scale=nan"], "needs a finite number F"),
    (["join", "--fault", "scale=-8", "--fault", "direction=5"], "exclude each other"),
    (["status", "--fault", "nan"], "the only command is join"),
])
def test_misuse_is_one_error_line_and_exit_2(args, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        faults.main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and said in err, err


def test_no_command_prints_the_faults_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        faults.main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert all(f"\n  {name}" in err for name in faults.FAULTS), err


def test_the_faults_come_out_and_the_join_flags_stay_in_order():
    got = faults.split_faults(["--max-outer-steps", "4", "--fault", "nan", "--name", "x", "--fault=slowdown=2.5",
                               "--state-dir", "d", "--fault", "scale=-8"])
    assert got == ({"nan": None, "slowdown": 2.5, "scale": -8.0},
                   ["--max-outer-steps", "4", "--name", "x", "--state-dir", "d"])
    assert faults.split_faults(["--threads", "1"]) == ({}, ["--threads", "1"])


def test_a_hostile_contribution_is_f_times_delta_or_a_fresh_random_direction_at_f_times_its_norm():
    import torch

    delta = [torch.randn(4, 8), torch.randn(8)]
    norm = float(torch.sqrt(sum((d ** 2).sum() for d in delta)))
    scaled = faults.node_class({"scale": -8.0}).averager_faults
    assert scaled == (faults.ScaledContributionAverager,) and faults.HostileContributionAverager.factor == -8.0
    sent = faults.ScaledContributionAverager.hostile_delta(faults.ScaledContributionAverager, delta)
    assert all(torch.equal(s, -8.0 * d) for s, d in zip(sent, delta))
    faults.node_class({"direction": 5.0})
    first, second = (faults.RandomDirectionAverager.hostile_delta(faults.RandomDirectionAverager, delta)
                     for _ in range(2))
    for sent in (first, second):
        assert [s.shape for s in sent] == [d.shape for d in delta]
        assert abs(float(torch.sqrt(sum((s ** 2).sum() for s in sent))) - 5.0 * norm) < 1e-3 * norm
    assert not torch.equal(first[0], second[0])  # a fresh direction each round


def test_every_fault_has_a_class_and_a_line_of_help():
    assert set(faults.FAULTS) == set(faults.NODE_FAULTS) | set(faults.AVERAGER_FAULTS)
    assert not set(faults.NODE_FAULTS) & set(faults.AVERAGER_FAULTS)
    readme = (REPO / "README.md").read_text()
    for name in faults.FAULTS:
        assert f"\n  {name}" in faults.__doc__, name
        assert f"`{name}" in readme, f"README.md's list of faults misses {name}"


def test_a_faulty_node_is_the_products_with_its_faults_mixed_in():
    cls = faults.node_class({"disk-full": None, "slowdown": 3.0, "nan": None, "lonely": None})
    assert issubclass(cls, faults.DiskFullNode) and issubclass(cls, faults.SlowInnerSteps) and issubclass(cls, Node)
    assert cls.slowdown == 3.0
    assert cls.averager_faults == (faults.NonFiniteScalesAverager, faults.LonelyAverager)
    honest = faults.node_class({})
    assert honest.averager_faults == () and honest.slowdown == 1.0
    assert honest.__bases__ == (faults.FaultyNode,)  # no fault: the product's node as it is


def test_faulty_averagers_speak_the_honest_protocol():
    """hivemind names RPC protocols after the servicer class: a faulty averager must keep the name,
    or honest peers would not even hear it (and the fault tests would test nothing)."""
    honest = PseudoGradientAverager._get_handle_name("run", "rpc_join_group")
    every = tuple(faults.AVERAGER_FAULTS.values())
    for mixed_in in [(cls,) for cls in every] + [every]:
        cls = faults.faulty_averager(mixed_in, Path("/nonexistent"))
        assert issubclass(cls, PseudoGradientAverager) and cls is not PseudoGradientAverager
        assert cls._get_handle_name("run", "rpc_join_group") == honest
        assert cls.state_dir == Path("/nonexistent")
