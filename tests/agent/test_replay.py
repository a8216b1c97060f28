"""Replay of the finished session: unchanged, it reproduces every decision (exit 0); with stricter
bars it diverges at the first promotion and says which steps would have needed new jobs (exit 1).
Either way nothing in the lab changes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from agent.replay import replay

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _tree(lab: Path) -> dict[str, str]:
    return {str(p.relative_to(lab)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(lab.rglob("*")) if p.is_file() and not p.name.endswith(("-shm", "-wal"))}


def test_replay_reproduces_the_session_and_writes_nothing(finished):
    before = _tree(finished.lab)
    out = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "replay", finished.session, "--lab",
                          str(finished.lab)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reproduced exactly" in out.stdout
    assert _tree(finished.lab) == before


def test_stricter_bars_diverge_at_the_first_promotion(finished, tmp_path):
    strict = tmp_path / "strict.toml"
    strict.write_text('[[bar]]\nsuite = "digits"\nmetric = "correct"\nrule = "delta >= 0.5"\n')
    before = _tree(finished.lab)
    result = replay(finished.lab, finished.session, bars=strict)
    assert not result.same
    body = result.lines[2]  # after the header and the rule
    recorded, replayed = (side.split()[1] for side in body.split(" | "))
    assert (recorded, replayed) == ("promote", "reject")
    assert result.would_launch and all(w.startswith("would launch: ") for w in result.would_launch)
    assert _tree(finished.lab) == before
    cli = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "replay", finished.session, "--lab",
                          str(finished.lab), "--bars", str(strict)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert cli.returncode == 1 and "would launch: " in cli.stdout
