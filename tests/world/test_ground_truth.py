"""The nominee's ground truth on the test world: declared by the world's own lab.toml, run as a `truth` job
through the launcher on the nomination reserve, recorded once as a `truth` decision that the card cites,
and left out of the planner's view. The base model's license the world declares is recorded on the parent.

One job on the shared test world (its 40-prompt sample answered by the parent twice); the rendering and
the planner's request are tested without jobs in tests/tools/test_ground_truth.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from agent import toolbox
from agent.config import load_lab_config
from agent.planners.playbook import PlaybookSettings
from agent.runner import _runtime, snapshot
from agent.summary import summarize
from memory.notebook import Notebook
from memory.state import fold
from tools import ground_truth
from tools.nomination import card
from tools.promote import start_incumbent
from tools.world.truth import TruthResult

SESSION = "w1"


def test_the_nominees_ground_truth_is_one_job_and_one_record_the_planner_never_sees(toy_world, tmp_path: Path):
    lab = tmp_path / "lab"
    shutil.copytree(toy_world, lab)
    config = load_lab_config(lab)
    assert (config.truth.kind, config.truth.n, config.model.license) == ("world", 40, "apache-2.0")
    settings = PlaybookSettings.test()
    nb = Notebook.open(lab / "notebook.db")
    nb.open_session(SESSION, lab=str(lab), budget_gpuh=1000.0, reserve_gpuh=150.0, planner="playbook",
                    executor="local", config=snapshot(config, "test", settings))
    rt = _runtime(nb, SESSION, lab, config, config.executor, settings, "playbook", True)
    parent = start_incumbent(rt.ctx)
    recipe = nb.artifact(parent).recipe
    assert (recipe["license"], recipe["license_source"]) == ("apache-2.0", "lab.toml [model] license")

    nb.record_decision(SESSION, "nominate", "the parent as the nominee", {"artifact_id": parent})
    before = summarize(nb, SESSION)
    args = toolbox.args_model("ground_truth")(artifact=parent)
    outcome = toolbox.run(rt.ctx, "ground_truth", args, None)
    assert outcome.status == "done", outcome.summary
    [job] = nb.jobs(session=SESSION, kind=ground_truth.JOB_KIND)
    assert job.state == "completed" and job.forecast_gpuh == 0.0 and job.resources["nomination"] is True
    [record] = nb.decisions(SESSION, kind="truth")
    t = record.payload
    assert t == ground_truth.payload(TruthResult.model_validate(job.result), parent, parent, "world", job.key)
    assert t.n == 40 == sum(t.outcomes.values()) == sum(f.n for f in t.per_family.values()) and t.audit_passed
    assert 0.0 <= t.ci_low <= t.win_rate <= t.ci_high <= 1.0 and set(t.audit_references) >= {"feedback", "data:stage1"}
    assert nb.verify().ok

    # The planner's view: nothing of it but the GPU-hours its job spent, settled like every job's.
    after = summarize(nb, SESSION)
    # Nothing of it but its cost: the view's ledger moved by the job's GPU-hours, and nothing else did.
    unspent = {"view": {"ledger"}}
    assert after.model_dump(exclude=unspent) == before.model_dump(exclude=unspent)
    assert abs(after.budget.spent_gpuh - before.budget.spent_gpuh - job.gpu_hours) < 1e-9
    assert f"{t.win_rate:.3f}" not in after.model_dump_json()

    # Once: a second run is the recorded outcome (no second job, no second record).
    assert toolbox.run(rt.ctx, "ground_truth", args, None) == outcome
    assert len(nb.jobs(session=SESSION, kind=ground_truth.JOB_KIND)) == 1 and len(nb.decisions(SESSION, kind="truth")) == 1

    state = fold(nb, SESSION)
    section = "\n".join(card._truth_section(nb, state, nb.artifact(parent)))
    assert "The nominee is the parent itself" in section  # and no limitation is drawn from a self-comparison
    assert card._truth_limitation(state, nb.artifact(parent)) == []
    for expr, value in (("payload.win_rate", t.win_rate), ("payload.ci_low", t.ci_low), ("payload.n", t.n)):
        assert card.num(value, card.ref("decision", record.seq, expr)) in section
    nb.close()
