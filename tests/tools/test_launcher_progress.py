"""The live progress table: drawn on a terminal with the job's last logged step, silent off one."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection
from tools.jobs.launcher import Launcher, Resources
from tools.jobs.probe import CountConfig, EmptyConfig, count, empty
from tools.jobs.progress import last_metrics, render, wait_all


def _session(tmp_path: Path, executor: ExecutorSection | None = None) -> tuple[Notebook, Launcher]:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=2.0, reserve_gpuh=0.1, planner="playbook",
                    executor="local", config={})
    executor = executor or ExecutorSection(kind="local")
    return nb, Launcher.from_section(nb, "s1", executor, tmp_path / "jobs", poll_s=0.1)


def test_live_lines_on_a_terminal(tmp_path: Path) -> None:
    nb, launcher = _session(tmp_path)
    jobs = [
        launcher.submit("probe", count, CountConfig(steps=3, step_seconds=0.3, output_dir=tmp_path / "o"),
                        Resources(time_limit_min=1, signal_delay_s=10)),
        launcher.submit("empty", empty, EmptyConfig(tag="a"), Resources(time_limit_min=1, signal_delay_s=10)),
    ]
    out = io.StringIO()
    wait_all(jobs, nb, "s1", Console(file=out, force_terminal=True, width=140), refresh_s=0.1)
    text = out.getvalue()
    assert "probe" in text and "empty" in text and "completed" in text
    assert "step 3/3 loss 0.3333" in text
    spent = nb.ledger("s1").spent_gpuh
    assert f"budget: {spent:.3f} GPU-h spent" in text


def test_quiet_off_a_terminal(tmp_path: Path) -> None:
    nb, launcher = _session(tmp_path)
    job = launcher.submit("empty", empty, EmptyConfig(tag="b"), Resources(time_limit_min=1, signal_delay_s=10))
    out = io.StringIO()
    wait_all([job], nb, "s1", Console(file=out, force_terminal=False), refresh_s=0.1)
    assert out.getvalue() == "" and job.record.state == "completed"


def test_settled_cost_shows_device_seconds_and_a_simulated_label(tmp_path: Path) -> None:
    nb, launcher = _session(tmp_path, ExecutorSection(kind="local", simulated_gpuh_per_device_s=0.001))
    job = launcher.submit("empty", empty, EmptyConfig(tag="c"), Resources(time_limit_min=1, signal_delay_s=10))
    job.result(timeout_s=60)
    out = io.StringIO()
    Console(file=out, width=160).print(render([job], nb, "s1"))
    record = job.record
    assert f"{record.gpu_hours:.4g} GPU-h ({record.device_seconds:.1f} device-s, simulated)" in out.getvalue()


def test_last_metrics(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert last_metrics(path) == ""
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "of": 9, "loss": 1.25}\n')
    assert last_metrics(path) == "step 2/9 loss 1.25"
    with open(path, "a") as f:  # the job is halfway through appending its next line
        f.write('{"step": 3, "of": 9, "lo')
    assert last_metrics(path) == "step 2/9 loss 1.25"
    path.write_text('{"step": 1, "lo')
    assert last_metrics(path) == ""
