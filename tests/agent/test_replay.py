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
from evals import bars as bars_file

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


def test_replay_registers_the_bars_the_session_recorded_not_the_files_reading_today(finished):
    """A session recorded under one floor unit replays under it whatever its lab's bars file says now: replay
    registers the typed spec its session state holds, never a file written out and read back. Here the file is made
    to read `replicates` while the session registered `resolvable`; an old session is the mirror case (its record has
    no floor_unit key, so `replicates`, and its unchanged file now reads `resolvable`)."""
    from memory.notebook import Notebook
    from memory.records import BarsSpec

    with Notebook.open(finished.lab / "notebook.db", readonly=True) as nb:
        first = nb.decisions(finished.session, kind="register_bars")[0]
        recorded = nb.bars(first.payload.bars_id).spec
    path = finished.lab / "bars.toml"
    text = path.read_text()
    assert bars_file.load(path).spec() == recorded  # the file as the session read it
    try:
        path.write_text('floor_unit = "replicates"\n' + text)
        assert bars_file.load(path).spec() != recorded
        result = replay(finished.lab, finished.session)
    finally:
        path.write_text(text)
    assert result.same and result.bars_spec == recorded
    # The record of a session from before the key (no floor_unit) reads back typed as exactly that: the replicates'
    # floor, its stored form (and so its hash) unchanged.
    old = {k: v for k, v in recorded.canonical().items() if k != "floor_unit"}
    assert BarsSpec.model_validate(old).floor_unit == "replicates" and BarsSpec.model_validate(old).canonical() == old
