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


def test_a_resumed_steps_forecast_is_sized_on_the_budget_its_first_run_saw(tmp_path):
    """Issue 44, item 2: calibration's reference job reserved its forecast (the run bound of a time limit sized to
    what was left, 1.9 of 30 minutes); the agent died. Re-gated with that reservation in the ledger, less than a
    minute was left, the time limit stayed the lab's 30 minutes and the forecast became 63.9 GPU-h: the step its
    first run admitted was refused. Sized without its own reservation, the forecast is the first run's."""
    from agent import toolbox
    from agent.runner import minute_cost
    from evals.decoding import Decoding
    from tools import calibrate
    from tools.context import LabSpec, LabSuite, ToolContext
    from tools.jobs.executor import ExecutorSection, ResourcesSection
    from tools.jobs.launcher import Launcher
    from tools.paths import LabPaths

    section = ExecutorSection(kind="local", time_limit_min=30, simulated_gpuh_per_device_s=0.0355)
    lab = LabSpec(parent=tmp_path / "parent", tokenizer=tmp_path / "parent", feedback=tmp_path / "feedback.jsonl",
                  dev_fraction=0.2, sealed_fraction=0.1, bars=None, served=Decoding(), time_limit_min=30,
                  suites=[LabSuite(name=n, scorer="synthetic", file=tmp_path / "x.jsonl") for n in "abcd"],
                  job_resources={k: section.kind_resources(k, 0) for k in ResourcesSection.model_fields})
    args = calibrate.Args(artifact=1)
    with Notebook.open(tmp_path / "notebook.db") as nb:
        nb.open_session("s1", lab=str(tmp_path), budget_gpuh=5.0, reserve_gpuh=0.75, planner="playbook",
                        executor="local", config={})
        launcher = Launcher.from_section(nb, "s1", section, tmp_path / "jobs")
        ctx = ToolContext(nb=nb, session="s1", paths=LabPaths(root=tmp_path), lab=lab, jobs=launcher,
                          minute_gpuh=minute_cost(launcher))
        first = toolbox.forecast_gpuh(ctx, launcher, "calibrate", args)
        assert first < 4.25  # what was left above the reserve, not the lab's 30 minutes (63.9 GPU-h)
        nb.record_tool_call("s1", "calibrate", args.model_dump(mode="json"))
        nb.start_job("r" * 64, session="s1", kind="reference", executor="local", resources={}, forecast_gpuh=first)
        own = own_reservation(nb, "s1", "calibrate", args.model_dump(mode="json"))
        assert own == first
        assert toolbox.forecast_gpuh(ctx, launcher, "calibrate", args) > 60  # the reservation counted against it
        again = toolbox.forecast_gpuh(ctx, launcher, "calibrate", args, own)
        assert again == first and ledger(nb, "s1").without(own).admission(again).admitted
