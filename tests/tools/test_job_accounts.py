"""Where a job's wall goes and what it was forecast (issue 39, items 3-5): each job's result splits its wall into
start-up, work and write-out (the job's own laps completed by the job wrapper); each attempt's row records its
forecast device-seconds beside the actual; a later job of a kind is forecast from the earlier runs' start-up and
work apart; a session's jobs are accounted by kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.wall import Laps, Wall, completed, wall_of
from memory.notebook import Notebook
from tools.jobs.accounts import session_accounts
from tools.jobs.executor import ExecutorSection
from tools.jobs.forecast import MeasuredRun, RunSize, run_seconds
from tools.jobs.launcher import Launcher, Resources
from tools.jobs.probe import StagedConfig, staged

SESSION = "s1"


def test_the_wrapper_completes_a_jobs_own_split() -> None:
    own = Wall(startup_s=2.0, work_s=5.0, write_s=1.0, parts={"load": 2.0}, began_at=101.0)
    # process started at 97, the function was entered at 100, its laps began at 101 and it returned at 110
    whole = completed(own, process_started=97.0, entered=100.0, returned=110.0)
    assert whole.parts == {"process": 3.0, "setup": 1.0, "load": 2.0}
    assert (whole.startup_s, whole.work_s, whole.write_s) == (6.0, 5.0, 2.0)  # 1 s after the last lap: write-out
    assert whole.total_s == 13.0 and whole.began_at is None
    plain = completed(None, process_started=97.0, entered=100.0, returned=110.0)
    assert (plain.startup_s, plain.work_s, plain.write_s) == (3.0, 10.0, 0.0)


def test_laps_book_each_stretch() -> None:
    laps = Laps()
    laps.startup("load")
    laps.work()
    laps.write()
    wall = laps.wall()
    assert set(wall.parts) == {"load"} and wall.total_s >= 0 and wall.began_at is not None
    assert wall_of({"train": {"wall": wall.model_dump()}}) == wall and wall_of({"x": 1}) is None


def test_fixed_cost_counts_once_and_work_scales_with_units() -> None:
    runs = [MeasuredRun(kind="eval", model_job=True, fixed_s=10.0, work_s=4.0, units=2.0),
            MeasuredRun(kind="eval", model_job=True, fixed_s=12.0, work_s=8.0, units=4.0),
            MeasuredRun(kind="ingest", model_job=False, fixed_s=3.0, work_s=1.0),
            MeasuredRun(kind="sft", model_job=True, fixed_s=40.0, work_s=20.0, units=10.0)]
    # 11 s of start-up and write-out, then 6 units at 2 s each: a K = 3 eval of two suites is not three start-ups
    assert run_seconds(RunSize(kind="eval", model_job=True, units=6.0), runs) == pytest.approx(11.0 + 12.0)
    # a kind never run before: the fixed part of its group (jobs that serve a model, not training's), no work known
    assert run_seconds(RunSize(kind="bundle", model_job=True), runs) == pytest.approx(11.0)
    assert run_seconds(RunSize(kind="dpo", model_job=True), runs) == pytest.approx(40.0)
    # no training measured: not an eval's start-up (the launcher's declared training start-up, compiled blocks)
    assert run_seconds(RunSize(kind="dpo", model_job=True), runs[:3]) is None
    assert run_seconds(RunSize(kind="merge", model_job=True), runs) == pytest.approx((10 + 12 + 40) / 3)
    assert run_seconds(RunSize(kind="build", model_job=False), runs) == pytest.approx(3.0)
    assert run_seconds(RunSize(kind="eval", model_job=True), []) is None
    by_tokens = [MeasuredRun(kind="eval", model_job=True, fixed_s=5.0, work_s=10.0, tokens=1000.0,
                             active_params=100)]
    # twice the tokens on a model of twice the active parameters: four times the work
    size = RunSize(kind="truth", model_job=True, tokens=2000.0, active_params=200, job_class="eval")
    assert run_seconds(size, by_tokens) == pytest.approx(5.0 + 40.0)


def test_jobs_record_their_wall_and_forecast_and_the_session_sums_them(tmp_path: Path) -> None:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session(SESSION, lab=str(tmp_path), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook",
                    executor="local", config={})
    launcher = Launcher.from_section(nb, SESSION, ExecutorSection(kind="local"), tmp_path / "jobs", poll_s=0.1)
    r = Resources(time_limit_min=2, device="cpu", signal_delay_s=10)
    first = launcher.submit("probe", staged, StagedConfig(load_s=0.5, units=1, unit_s=0.3, write_s=0.2),
                            r.model_copy(update={"work_units": 1.0}))
    one = first.result(timeout_s=120)
    assert one.wall is not None and one.wall.began_at is None  # completed by the wrapper
    assert {"process", "load"} <= set(one.wall.parts) and one.wall.parts["load"] >= 0.5
    assert one.wall.work_s >= 0.3 and one.wall.write_s >= 0.2
    row = first.record
    # nothing measured yet: the first forecast is the run's bound, in device-seconds on the row
    assert row.resources["forecast"] == {"gpuh": pytest.approx(120 / 3600), "source": "time_limit",
                                         "device_s": pytest.approx(120.0)}
    # the split covers the run the executor charged (process start to the function's return)
    assert one.wall.total_s == pytest.approx(row.device_seconds, abs=1.0)
    expected = run_seconds(RunSize(kind="probe", model_job=True, units=3.0), launcher.measured_runs())
    second = launcher.submit("probe", staged, StagedConfig(load_s=0.5, units=3, unit_s=0.3, write_s=0.2),
                             r.model_copy(update={"work_units": 3.0}))
    second.result(timeout_s=120)
    forecast = second.record.resources["forecast"]
    assert forecast["source"] == "throughput" and forecast["device_s"] == pytest.approx(expected)
    assert expected == pytest.approx(one.wall.startup_s + one.wall.write_s + 3 * one.wall.work_s)
    accounts = session_accounts(nb, SESSION)
    probe = accounts.kinds["probe"]
    assert probe.jobs == 2 and probe.forecast_device_s == pytest.approx(120.0 + expected, abs=1e-3)
    assert probe.actual_device_s == pytest.approx(sum(j.device_seconds for j in nb.jobs(session=SESSION)), abs=1e-3)
    walls = [wall_of(j.result) for j in nb.jobs(session=SESSION)]
    assert accounts.wall.startup_s == pytest.approx(sum(w.startup_s for w in walls), abs=1e-2)
    assert accounts.ratios() == {"probe": round(probe.actual_device_s / probe.forecast_device_s, 3)}
    nb.close()
