"""A real session on the small-holdout world, whose lab holds a reserve (issue 41, rules version 7): a comparison the
dev holdout leaves unresolved draws the reserve's prompts for its last registered look, recorded as a look that says
so, and the session replays exactly.

The lab is the test suite's shared world (seed 0) built as the small-holdout variant (its 19 dev battles and its
reserve of 13), run with the `test` protocol (one SFT arm and one serving alternative) under bars that register the
world's sequential rule with a p bar no candidate can clear and a look that always continues: every comparison goes
through all its looks, so the reserve look is reached deterministically. About 30 s of jobs and 10 s of replay on an
idle 2-core machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evals.job import reserve_suite
from memory.notebook import Notebook
from memory.state import fold
from tests.world.test_variants import check_looks_and_audit
from tools.world import build as world
from tools.world.testing import session_world

REPO = Path(__file__).resolve().parents[2]
BARS = """# The world's sequential rule (3 looks, spending t**0.5, an audit margin), a p bar no candidate clears and looks
# that always continue: every comparison is read at all three looks.
p_family = 10
looks = 3
look_spending = 0.5
continue_p = 1.0
audit_margin = 3.0

[[bar]]
suite = "holdout"
metric = "win_score"
rule = "p <= 1e-9"
test = "paired_t"
"""


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> tuple[Path, str]:
    lab = tmp_path_factory.mktemp("reserve") / "world-0"
    world.build(lab, seed=0, size="test", variant="small-holdout", reuse=session_world(tmp_path_factory))
    (lab / "bars-reserve.toml").write_text(BARS)
    toml = lab / "lab.toml"
    toml.write_text(toml.read_text().replace('bars = "world/bars.toml"', 'bars = "bars-reserve.toml"'))
    run = subprocess.run([sys.executable, "run_agent.py", "--lab", str(lab), "--budget", "5000gpuh", "--protocol",
                          "test", "--session", "s1", "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return lab, "s1"


def test_an_unresolved_comparison_draws_the_reserve_for_its_last_look_recorded_as_a_look(session):
    lab, name = session
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        state = fold(nb, name)
        assert state.opened.policy.version == 7
        reserve = state.split.reserve
        assert reserve > 0 and state.split.reserve_suites == ("holdout",)
        (ingest,) = nb.decisions(name, kind="ingest")
        assert ingest.rationale.endswith(f", reserve {reserve}")  # the split's counts, the reserve's included
        counts = check_looks_and_audit(nb, name)  # every p* recomputed here from the eval rows
        assert counts["comparisons"] >= 1 and counts["reserve_looks"] == counts["comparisons"]
        assert state.p_family.spent == counts["comparisons"]  # one p-value each, whatever the looks read
        comparisons = {c.id: c for c in nb.comparisons(name)}
        for v in state.verdicts:
            look = [x.payload for x in state.looks if x.payload.candidate == v.candidate][-1]
            assert (look.look, look.looks, look.outcome, look.reserve) == (3, 3, "decided", reserve)
            assert f"{reserve} reserve prompt(s) drawn for it" in look.reason
            assert comparisons[v.comparison_id].adjustment.reserve == reserve
        # the reserve was read by the reserve looks' evals alone: the incumbent's first, then each candidate's
        calls = [c for c in nb.tool_calls(name) if c.tool == "evaluate" and c.args.get("reserve")]
        assert [c.args["artifact"] for c in calls][0] == state.parent and len(calls) == 1 + counts["comparisons"]
        assert all(c.status == "done" and "on the reserve split (prompts: holdout@reserve " in c.outcome.summary
                   for c in calls)
        read = [e for e in nb.evals(session=name) if e.suite == reserve_suite("holdout")]
        assert {e.artifact_id for e in read} == {c.args["artifact"] for c in calls}
        assert all(len(e.items) == reserve for e in read)  # the judge suite reads every reserve battle's prompt
        # every reserve draw was a job the budget admitted and settled, like every eval
        assert all(nb.get_job(e.job_key).state == "completed" for e in read)


def test_the_session_with_its_reserve_looks_replays_exactly(session):
    lab, name = session
    out = subprocess.run([sys.executable, "run_agent.py", "replay", name, "--lab", str(lab)], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reproduced exactly" in out.stdout
    report = subprocess.run([sys.executable, "run_agent.py", "report", "--lab", str(lab), "--session", name],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    html = (lab / "report.html").read_text()
    looks = html[html.index('id="looks"'):html.index("</article>", html.index('id="looks"'))]
    assert "of the reserve)" in looks
