"""The whole loop on a small lab with the local executor: a nomination decision, a verifying notebook,
the budget kept, every step in the protocol's order, and the session survived a SIGKILL of its agent alone at
each of calibration's eval job, a training job and the bundle job (one resume with its graph
checkpoint deleted), its jobs attached again, none launched twice. Runs real jobs: marked slow."""

from __future__ import annotations

from collections import Counter

import pytest

from memory.notebook import Notebook

pytestmark = pytest.mark.slow


def test_session_ends_in_a_nomination_with_a_verifying_notebook(finished):
    with Notebook.open(finished.lab / "notebook.db", readonly=True) as nb:
        assert nb.session(finished.session).status == "done"
        kinds = [d.kind for d in nb.decisions(finished.session)]
        assert kinds[0] == "open" and kinds[-1] == "stop" and kinds.count("nominate") == 1
        assert nb.verify().ok
        nominee = nb.decisions(finished.session, kind="nominate")[0].payload.artifact_id
        assert nb.artifact(nominee).kind == "checkpoint"
        # The sealed suite was opened once, for the nominee, after the nomination.
        confirms = nb.decisions(finished.session, kind="confirm")
        assert [c.payload.artifact_id for c in confirms] == [nominee]
        assert kinds.index("nominate") < kinds.index("confirm")


def test_protocol_order_bars_before_scores_noise_before_deltas(finished):
    with Notebook.open(finished.lab / "notebook.db", readonly=True) as nb:
        kinds = [d.kind for d in nb.decisions(finished.session)]
        first_eval_launch = next(i for i, d in enumerate(nb.decisions(finished.session))
                                 if d.kind == "launch" and d.payload.kind == "eval")
        assert kinds.index("ingest") < kinds.index("register_bars") < first_eval_launch
        assert kinds.index("calibrate") < kinds.index("promote") if "promote" in kinds else kinds.index("reject")
        tools = [c.tool for c in nb.tool_calls(finished.session)]
        assert tools[:3] == ["ingest", "register_bars", "calibrate"] and "train" in tools and "merge" in tools
        assert "tune_serving" in tools and tools[-3:] == ["nominate", "sealed_open", "publish"]


def test_budget_never_exceeded_and_no_job_launched_twice(finished):
    with Notebook.open(finished.lab / "notebook.db", readonly=True) as nb:
        ledger = nb.ledger(finished.session)
        assert 0 < ledger.spent_gpuh <= ledger.budget_gpuh and ledger.reserved_gpuh == 0
        jobs = nb.jobs(session=finished.session)
        assert Counter((j.key, j.attempt) for j in jobs).most_common(1)[0][1] == 1
        launches = [(d.payload.key, d.payload.attempt) for d in nb.decisions(finished.session, kind="launch")]
        assert len(launches) == len(set(launches)) == len(jobs)
        assert all(j.state == "completed" for j in jobs)
        # Every tool call finished; each plan decision has at most one tool call.
        calls = nb.tool_calls(finished.session)
        assert all(c.status != "open" for c in calls)
        plans = [c.decision_seq for c in calls if c.decision_seq is not None]
        assert len(plans) == len(set(plans))


def test_the_kills_happened_mid_job_and_the_resumes_finished(finished):
    first, last = finished.logs[0], finished.logs[-1]
    assert "act: calibrate" in first and "done: parent" not in first.split("act: calibrate")[-1]
    assert any("act: train" in log for log in finished.logs[1:-1])
    assert "nominee" in last and "session s1: done" in last


@pytest.mark.parametrize("kind", ["eval", "sft", "bundle"])  # tests/conftest.py AGENT_KILLS
def test_a_job_whose_agent_alone_was_killed_ran_on_and_was_attached(finished, kind):
    """The agent alone SIGKILLed while a job of `kind` ran (its process group lived on): resume attached the running
    attempt instead of launching another, and it completed."""
    with Notebook.open(finished.lab / "notebook.db", readonly=True) as nb:
        attempts = nb.jobs(session=finished.session, key=finished.kills[kind])
        assert [(a.attempt, a.state, a.failure_class) for a in attempts] == [(1, "completed", None)]
        launches = [d.payload for d in nb.decisions(finished.session, kind="launch")
                    if d.payload.key == finished.kills[kind]]
        assert [p.attempt for p in launches] == [1]
