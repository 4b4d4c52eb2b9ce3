"""Imports point one way: the import-linter contracts of pyproject.toml ([tool.importlinter]) hold.

The contracts: the layers (cli > dashboard | light | node > averaging | models > dht | data > spec >
utils), no import circles at any depth, and a light client and dashboard that need no training node
(docs/architecture.md). import-linter reads the source, function-local imports included; it runs in
a process of its own, as ``lint-imports`` does.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_TIMEOUT_S = 120
# what the lint-imports console script runs, with this test's interpreter
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``lint-imports --no-cache --no-logo`` in ``cwd`` (its pyproject.toml and its diloco_swarm), bounded in time."""
    if importlib.util.find_spec("importlinter") is None:
        pytest.fail("import-linter is not installed, and tests/test_layers.py needs it: "
                    "pip install -e '.[test]'  (or: pip install 'import-linter>=2.16')")
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=LINT_TIMEOUT_S)


def test_import_contracts_are_kept():
    result = lint_imports(REPO)
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"import-linter found imports that break pyproject.toml's contracts:\n{report}"
    assert "0 broken" in report, report


# (file, code added at its end, the contract it must break)
BAD_IMPORTS = [
    pytest.param("diloco_swarm/averaging/grouping.py", "import diloco_swarm.node\n", "layers", id="averaging-imports-node"),
    pytest.param("diloco_swarm/utils/net.py", "def f():\n    from diloco_swarm.node import signals\n", "layers",
                 id="utils-imports-node-in-a-function"),
    pytest.param("diloco_swarm/node/report.py", "import diloco_swarm.dashboard\n", "layers", id="node-imports-dashboard"),
    pytest.param("diloco_swarm/cli/common.py", "def f():\n    from diloco_swarm.cli import app\n", "acyclic",
                 id="circle-in-cli"),
    pytest.param("diloco_swarm/light/wire.py", "def f():\n    import hivemind\n", "light-path-direct",
                 id="light-imports-hivemind"),
    pytest.param("diloco_swarm/dashboard/render.py", "def f():\n    from diloco_swarm.models import registry\n",
                 "light-path", id="dashboard-imports-models"),
]


@pytest.mark.parametrize("path, code, contract", BAD_IMPORTS)
def test_a_bad_import_breaks_a_contract(tmp_path, path, code, contract):
    """The contracts have teeth: one bad import, added to a copy of the package, breaks its contract."""
    shutil.copytree(REPO / "diloco_swarm", tmp_path / "diloco_swarm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    assert lint_imports(tmp_path, "--contract", contract).returncode == 0  # the copy, as it is
    with open(tmp_path / path, "a") as f:
        f.write("\n\n" + code)
    result = lint_imports(tmp_path, "--contract", contract)
    report = result.stdout + result.stderr
    assert result.returncode == 1 and "1 broken" in report, report
