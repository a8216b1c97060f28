"""A whole session on the test world ends in a nomination whose bundle passes check-bundle.

The test world's parent used to fail check-bundle (its answers ran past the served cap and could decode to
U+FFFD), so a world session ended `failed`. The budget is generous on purpose: the world charges measured
seconds, and on a loaded machine the same jobs measure several times longer; this test is about the
parent's bundle, not about the budget (tests/tools/test_launcher.py holds the budget)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memory.notebook import Notebook

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_test_world_session_nominates_a_bundle_that_passes_check_bundle(toy_world, tmp_path):
    lab = tmp_path / "lab"
    shutil.copytree(toy_world, lab)
    run = subprocess.run([sys.executable, "run_agent.py", "--lab", str(lab), "--budget", "1000gpuh", "--protocol",
                          "test", "--session", "w1", "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    nb = Notebook.open(lab / "notebook.db", readonly=True)
    assert nb.session("w1").status == "done"
    assert nb.decisions("w1", kind="nominate")
    bundles = sorted((lab / "bundles").iterdir())
    assert bundles, "the nomination wrote no bundle"
    check = subprocess.run([sys.executable, "run_agent.py", "check-bundle", str(bundles[-1]), "--lab", str(lab)],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "U+FFFD" not in check.stdout
