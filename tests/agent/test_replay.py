"""Replay of the finished session: unchanged, it reproduces every decision (exit 0); with stricter
bars it diverges at the first promotion and says which steps would have needed new jobs (exit 1).
Either way nothing in the lab changes. A session that registered bars more than once replays each registration with
its own recorded bars (the register_bars tool on a small notebook, no session)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from agent.replay import replay
from evals import bars as bars_file
from evals.decoding import Decoding
from memory.notebook import Notebook
from memory.state import fold
from tools import register_bars
from tools.context import LabSpec, LabSuite, ToolContext
from tools.paths import LabPaths

REPO = Path(__file__).resolve().parents[2]


def _tree(lab: Path) -> dict[str, str]:
    return {str(p.relative_to(lab)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(lab.rglob("*")) if p.is_file() and not p.name.endswith(("-shm", "-wal"))}


@pytest.mark.slow
def test_replay_reproduces_the_session_and_writes_nothing(finished):
    before = _tree(finished.lab)
    out = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "replay", finished.session, "--lab",
                          str(finished.lab)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reproduced exactly" in out.stdout
    assert _tree(finished.lab) == before


@pytest.mark.slow
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


@pytest.mark.slow
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


FIRST = 'floor_unit = "replicates"\n[[bar]]\nsuite = "digits"\nmetric = "correct"\nrule = "delta >= -1.0 * noise_floor"\n'
SECOND = '[[bar]]\nsuite = "digits"\nmetric = "correct"\nrule = "delta >= 0.05"\n'


def _spec(text: str):
    return bars_file.Bars.model_validate(__import__("tomllib").loads(text)).spec()


def test_each_registration_replays_with_the_bars_recorded_at_it(tmp_path: Path):
    """A session that registered bars twice, first a file its planner named, then the lab's bars (a default step):
    replay registers, at each default register_bars step, the typed bars of the registration made there, in order;
    never the first registration's again, and never the lab's bars file (there is none here: reading it would fail).
    A step naming a file reads it, as the session did (a step of the same arguments runs once per session)."""
    first, second = _spec(FIRST), _spec(SECOND)
    assert first != second
    lab = LabSpec(parent=tmp_path / "parent", tokenizer=tmp_path / "parent", feedback=tmp_path / "feedback.jsonl",
                  dev_fraction=0.2, sealed_fraction=0.1, suites=[LabSuite(name="digits", scorer="math")], bars=None,
                  served=Decoding(), time_limit_min=5, recorded_bars=(first, second))
    # The choice: the i-th registration at a step after i of them; past the last, the bars the session ended under.
    assert [lab.replayed_bars(i) for i in range(3)] == [first, second, second]
    assert lab.model_copy(update={"recorded_bars": None}).replayed_bars(0) is None  # a live session reads the file
    (tmp_path / "named.toml").write_text(FIRST)
    with Notebook.open(tmp_path / "notebook.db") as nb:
        nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=0, planner="playbook", executor="local",
                        config={})
        ctx = ToolContext(nb=nb, session="s", paths=LabPaths(root=tmp_path, session="s"), lab=lab,
                          jobs=None)  # type: ignore[arg-type]  # no job runs
        outcomes = [register_bars.run(ctx, register_bars.Args(file="named.toml")),
                    register_bars.run(ctx, register_bars.Args())]
        assert [o.status for o in outcomes] == ["done", "done"], [o.summary for o in outcomes]
        state = fold(nb, "s")
        assert [r.spec for r in state.registrations] == [first, second]
        assert state.bars is not None and state.bars.spec == second
