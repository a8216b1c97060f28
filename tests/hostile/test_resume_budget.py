"""Resume from the notebook does not count a step twice (issue 34, section 5): a step interrupted mid-job is
gated again on resume, and its own pending reservation (the job it launched before the crash) must not count
against it. A budget that fits the step once, with its job already reserved, must admit it again."""

from __future__ import annotations

from memory.notebook import Notebook
from tools.session import ledger, own_reservation

ARGS = {"arm": "sft", "parent": 1, "dataset": 2}


def _interrupted(tmp_path, forecast: float) -> Notebook:
    """A session whose train call was open, with its job launched (reserved, unsettled), when the agent died."""
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook", executor="local",
                    config={})
    nb.record_tool_call("s1", "train", ARGS)
    nb.start_job("k" * 64, session="s1", kind="sft", executor="local", resources={}, forecast_gpuh=forecast)
    return nb


def test_a_resumed_step_is_not_charged_its_own_pending_reservation(tmp_path):
    forecast = 0.6  # fits once above the reserve (0.6 <= 1.0 - 0.1), never twice
    with _interrupted(tmp_path, forecast) as nb:
        raw = ledger(nb, "s1")
        assert not raw.admission(forecast).admitted  # counted twice, the same step is refused
        own = own_reservation(nb, "s1", "train", ARGS)
        assert own == forecast
        assert raw.without(own).admission(forecast).admitted


def test_another_steps_reservation_still_counts(tmp_path):
    with _interrupted(tmp_path, 0.6) as nb:
        other = {**ARGS, "arm": "dpo"}
        assert own_reservation(nb, "s1", "train", other) == 0.0
        assert not ledger(nb, "s1").without(own_reservation(nb, "s1", "train", other)).admission(0.6).admitted


def test_a_settled_jobs_cost_is_never_forgiven(tmp_path):
    with _interrupted(tmp_path, 0.6) as nb:
        nb.update_job("k" * 64, 1, state="completed", gpu_hours=0.6, result={})
        assert own_reservation(nb, "s1", "train", ARGS) == 0.0
        assert not ledger(nb, "s1").admission(0.6).admitted
