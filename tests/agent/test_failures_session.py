"""A whole playbook session with three injected job failures (issue 13): the SFT arm runs out of
memory at its full micro-batch, the session's first eval job is preempted (SIGUSR2 to its worker, as
Slurm and the local executor signal; the job waits for it, so a fast eval cannot finish first), and the KL-CE arm diverges to a NaN loss. Each
failure is classified and recorded, the requeue and the retry are admitted against the budget,
the ledger stays within it, no job key is launched twice, and the session still nominates.

The test protocol with KL-CE as a second first arm (so there is an arm to lose) and, to keep it cheap,
without its dose step (its greedy serving alternative stays: a nominee sampled at temperature 1 does
not pass check-bundle), on labkit's lab, run in this process so that the `train` and `evaluate`
tools can be pointed at tests/agent/faults.py. Real jobs, minutes on the 2-core test machine: marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

import tools.evaluate
import tools.train
from agent import runner
from agent.planners.playbook import PlaybookSettings
from memory.notebook import Notebook, NotebookError
from memory.records import FailPayload
from trainers import klce, sft

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import faults  # noqa: E402
from labkit import make_lab  # noqa: E402

pytestmark = pytest.mark.slow
SESSION = "faults"


class Preempter(threading.Thread):
    """Sends SIGUSR2 to the worker of the session's first eval job (faults.eval_awaiting_preemption: it waits for
    the signal) once its run has started, and notes which job and attempt it hit."""

    def __init__(self, notebook: Path, marker: Path):
        super().__init__(daemon=True)
        self.notebook, self.marker, self.stop, self.hit = notebook, marker, threading.Event(), None

    def run(self) -> None:
        while not self.stop.wait(0.2):
            pid = self._started_eval()
            if pid is not None:
                os.kill(pid, signal.SIGUSR2)
                return

    def _started_eval(self) -> int | None:
        text = self.marker.read_text() if self.marker.exists() else ""
        if not text:
            return None
        try:
            with Notebook.open(self.notebook, readonly=True) as nb:
                jobs = [j for j in nb.jobs(session=SESSION) if j.kind in ("eval", "reference") and j.external_id]
        except NotebookError:  # not created yet
            return None
        for job in jobs:
            # The wrapper logs its start inside the job function: the executor's signal handler is set by then.
            events = Path(job.folder) / f"{job.external_id}_events.jsonl"
            starts = [json.loads(ln) for ln in events.read_text().splitlines()] if events.exists() else []
            if job.state in ("pending", "running") and starts and starts[0]["pid"] == int(text):
                self.hit = (job.key, job.attempt)
                return int(text)
        return None


def test_a_session_with_an_oom_a_preemption_and_a_nan_arm_still_nominates(tmp_path, monkeypatch, capsys):
    lab = make_lab(tmp_path / "lab")
    faulty = {"sft": SimpleNamespace(train=faults.sft_oom_at_full_batch, SFTConfig=sft.SFTConfig),
              "klce": SimpleNamespace(train=faults.klce_diverging, KLCEConfig=klce.KLCEConfig)}
    monkeypatch.setattr(tools.train, "trainer_module", faulty.__getitem__)
    monkeypatch.setattr(tools.evaluate, "run_eval", faults.eval_awaiting_preemption)
    marker = tmp_path / "preempt.pid"
    monkeypatch.setenv("POSTLAB_FAULT_PREEMPT", str(marker))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    two_arms = PlaybookSettings.test().model_copy(update={"families": ("sft", "klce"), "dose_alphas": ()})
    monkeypatch.setattr(PlaybookSettings, "test", classmethod(lambda cls: two_arms))
    preempter = Preempter(lab / "notebook.db", marker)
    preempter.start()
    t0 = time.monotonic()
    try:
        runner.start(lab, SESSION, 5.0, "playbook", "local", "test", quiet=True)
    finally:
        preempter.stop.set()
    print(f"injected-failures session: {time.monotonic() - t0:.0f} s")
    log = capsys.readouterr().out[-3000:]

    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        jobs = nb.jobs(session=SESSION)
        by_key: dict[str, list] = {}
        for j in jobs:
            by_key.setdefault(j.key, []).append(j)
        fails = {(d.payload.key, d.payload.attempt): d.payload for d in nb.decisions(SESSION, kind="fail")
                 if isinstance(d.payload, FailPayload)}  # a job's failures (a failed step without a job has its own)
        launches = [(d.payload.key, d.payload.attempt) for d in nb.decisions(SESSION, kind="launch")]

        # The OOM: classified, retried once with half the micro-batch, and the retry trained.
        (sft_job,) = [a for a in by_key.values() if a[0].kind == "sft"]
        assert [(a.failure_class, a.state) for a in sft_job] == [("oom", "failed"), (None, "completed")]
        assert [a.resources["args"]["micro_batch_size"] for a in sft_job] == [8, 4]
        # The preemption: classified, requeued (a new submission), and the requeue completed.
        assert preempter.hit is not None, "no eval job was preempted"
        evals = by_key[preempter.hit[0]]
        assert [(a.failure_class, a.state) for a in evals] == [("preempted", "failed"), (None, "completed")]
        assert evals[0].external_id != evals[1].external_id and evals[0].gpu_hours > 0
        # The NaN arm: classified, not retried, a recorded failure; the arm's tool call failed.
        (klce_job,) = [a for a in by_key.values() if a[0].kind == "klce"]
        assert [(a.failure_class, a.state) for a in klce_job] == [("nan_loss", "failed")]
        assert "nan_loss: step" in klce_job[0].failure_detail
        assert fails[(klce_job[0].key, 1)].failure_class == "nan_loss"
        assert [c.status for c in nb.tool_calls(SESSION) if c.tool == "train"] == ["done", "failed"]

        # Every attempt was admitted (a launch decision each, retries included) and none launched twice.
        assert len(launches) == len(set(launches)) == len(jobs)
        assert Counter((j.key, j.attempt) for j in jobs).most_common(1)[0][1] == 1
        ledger = nb.ledger(SESSION)
        assert 0 < ledger.spent_gpuh <= ledger.budget_gpuh and ledger.reserved_gpuh == 0
        # And the session still ends in one nomination, on a verifying notebook (what happens to the
        # nominee's bundle after that is the nomination tests' concern).
        assert len(nb.decisions(SESSION, kind="nominate")) == 1, log
        assert nb.verify().ok
