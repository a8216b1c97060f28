"""Admission beyond GPU-hours: a training job's memory estimate against the GPUs it asks for, and the
checkpoint signal's lead time derived from the save time trainers measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from submitit.core.utils import DelayedSubmission

from core import tiny
from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection, SlurmSection
from tools.jobs.launcher import (
    SIGNAL_LEAD_FLOOR_S,
    Launcher,
    MemoryRefused,
    Resources,
    SlurmBackend,
    signal_lead_s,
)
from tools.jobs.probe import EmptyConfig, empty
from trainers import sft

SESSION = "s1"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    return tiny.build_model("llama", tiny.build_tokenizer(root / "tokenizer"), root / "llama", seed=0)


def _sft_config(model: Path, tmp_path: Path, micro_batch_size: int = 4) -> sft.SFTConfig:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"The answer is {2 * i}."}]} for i in range(8)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sft.SFTConfig(model_path=model, data_path=data, output_dir=tmp_path / "run", steps=2, lr=1e-3,
                         batch_size=4, micro_batch_size=micro_batch_size, save_every=1)


def _launcher(tmp_path: Path, gpu_memory_gib: float | None) -> tuple[Notebook, Launcher]:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session(SESSION, lab=str(tmp_path), budget_gpuh=10.0, reserve_gpuh=0.0, planner="playbook",
                    executor="local", config={})
    section = ExecutorSection(kind="local", gpu_memory_gib=gpu_memory_gib)
    return nb, Launcher.from_section(nb, SESSION, section, tmp_path / "jobs", poll_s=0.2)


def test_a_training_job_that_cannot_fit_its_gpu_is_refused_with_the_numbers(tiny_llama: Path, tmp_path: Path) -> None:
    # Any estimate holds the 2 GiB CUDA reserve, so a 1.5 GiB GPU fits no training job.
    nb, launcher = _launcher(tmp_path, gpu_memory_gib=1.5)
    config = _sft_config(tiny_llama, tmp_path)
    with pytest.raises(MemoryRefused, match=r"GiB per GPU exceeds 1.5 GiB on 1 GPU"):
        launcher.submit("sft", sft.train, config, Resources(time_limit_min=5, gpus=1, model="tiny"))
    (refusal,) = nb.decisions(SESSION, kind="refuse")
    assert (refusal.payload.kind, refusal.payload.gpus, refusal.payload.gpu_memory_gib) == ("sft", 1, 1.5)
    assert refusal.payload.estimate_gib > 2.0 and refusal.payload.parts_gib["reserve"] == 2.0
    assert refusal.payload.estimate_gib == pytest.approx(sum(refusal.payload.parts_gib.values()), abs=0.01)
    assert "cannot fit its GPUs" in refusal.rationale
    assert nb.jobs() == [] and nb.decisions(SESSION, kind="launch") == []  # nothing recorded as launched, nothing ran
    # A CPU-only job (no GPUs asked for) is not held to a GPU's memory.
    cpu = launcher.submit("sft", sft.train, config, Resources(time_limit_min=5, model="tiny"))
    assert cpu.record.resources["memory"]["per_gpu_gib"] == refusal.payload.estimate_gib
    cpu.cancel()


def test_a_training_job_that_fits_runs_with_its_estimate_recorded(tiny_llama: Path, tmp_path: Path) -> None:
    nb, launcher = _launcher(tmp_path, gpu_memory_gib=139.0)
    config = _sft_config(tiny_llama, tmp_path)
    job = launcher.submit("sft", sft.train, config, Resources(time_limit_min=5, gpus=1, model="tiny"))
    result = job.result(timeout_s=240)
    memory = job.record.resources["memory"]
    assert memory["world_size"] == 1 and 2.0 < memory["per_gpu_gib"] < 139.0
    # The estimate admission recorded is the one the trainer itself wrote beside its run.
    written = json.loads((result.run_dir / "memory_estimate.json").read_text())
    assert memory["per_gpu_gib"] == pytest.approx(written["total"] / 1024**3, abs=1e-3)
    assert nb.decisions(SESSION, kind="refuse") == []
    # The trainer saved every step and measured it: the next sft on this model is warned that long
    # before its limit (the floor, as a tiny model saves in well under 15 s).
    assert result.metrics["max_save_s"] > 0
    assert launcher.measured_save_s("sft", "tiny") == result.metrics["max_save_s"]
    nxt = launcher.with_signal_lead("sft", Resources(time_limit_min=5, model="tiny"))
    assert nxt.signal_delay_s == SIGNAL_LEAD_FLOOR_S
    # A smaller micro-batch needs less memory: the OOM retry's config is estimated again, lower.
    smaller = launcher.check_memory("k", "sft", _sft_config(tiny_llama, tmp_path, 2), Resources(time_limit_min=5, gpus=1))
    assert smaller["parts_gib"]["activations"] < memory["parts_gib"]["activations"]


def test_signal_lead_from_the_measured_save_time() -> None:
    assert signal_lead_s(None, 3600) == SIGNAL_LEAD_FLOOR_S == 30  # nothing measured: the floor
    assert signal_lead_s(4.0, 3600) == 30  # 2 x 4 s is under the floor
    assert signal_lead_s(41.2, 3600) == 83  # twice the longest save, rounded up
    assert signal_lead_s(1000.0, 600) == 300  # never more than half the limit
    assert signal_lead_s(None, 12) == 6


def test_the_derived_lead_reaches_the_executor(tmp_path: Path) -> None:
    nb, launcher = _launcher(tmp_path, gpu_memory_gib=None)
    # Earlier completed trainer jobs of kind sft: one on this model saved in 41.2 s at most, one on
    # another model in 500 s, an RFT run reports its SFT phase's saves under `train`.
    for key, model, result in (("a", "m", {"metrics": {"max_save_s": 41.2}}), ("b", "other", {"metrics": {"max_save_s": 500}}),
                               ("c", "m", {"train": {"metrics": {"max_save_s": 12.0}}})):
        nb.start_job(key, session=SESSION, kind="sft", executor="local", resources={"model": model}, forecast_gpuh=0.1)
        nb.update_job(key, 1, state="completed", gpu_hours=0.1, result=result)
    assert launcher.measured_save_s("sft", "m") == 41.2
    resources = launcher.with_signal_lead("sft", Resources(time_limit_min=60, gpus=8, model="m"))
    assert resources.signal_delay_s == 83
    assert launcher.with_signal_lead("sft", Resources(time_limit_min=60, signal_delay_s=200)).signal_delay_s == 200
    # On Slurm it is the job's --signal; the job is never requeued behind the launcher's back.
    slurm = SlurmBackend.from_section(SlurmSection(partition="debug"))
    script = slurm.executor(tmp_path / "sb", "sft", resources)._make_submission_file_text("python -c 0", "uid")
    assert "#SBATCH --signal=USR2@83" in script and "#SBATCH --no-requeue" in script
    # Locally the same lead is the wrapper's (the local executor signals as Slurm does).
    job = launcher.submit("sft", empty, EmptyConfig(tag="lead"), Resources(time_limit_min=60, model="m"))
    job.result(timeout_s=60)
    assert job.record.resources["signal_delay_s"] == 83
    (pickle,) = Path(job.record.folder).glob("*_submitted.pkl")
    assert DelayedSubmission.load(pickle).function.signal_delay_s == 83


def test_a_refusal_says_what_would_fit(tiny_llama: Path, tmp_path: Path) -> None:
    from trainers.memory import GIB, estimate_job

    config = _sft_config(tiny_llama, tmp_path, micro_batch_size=4)
    whole, one = (estimate_job(c, 1).total / GIB for c in (config, config.model_copy(update={"micro_batch_size": 1})))
    assert one < whole
    # A GPU just too small for micro-batch 4: micro-batch 1 fits, and so do LoRA and two GPUs (sharded).
    gpu = (whole + one) / 2
    nb, launcher = _launcher(tmp_path, gpu_memory_gib=gpu)
    with pytest.raises(MemoryRefused, match=r"would fit: micro_batch_size = 1 \(\d+\.\d GiB\)"):
        launcher.submit("sft", sft.train, config, Resources(time_limit_min=5, gpus=1, model="tiny"))
    (refusal,) = nb.decisions(SESSION, kind="refuse")
    changes = [w.split(" (")[0] for w in refusal.payload.would_fit]
    assert changes[0] == "micro_batch_size = 1" and set(changes) <= {"micro_batch_size = 1", "LoRA (r 16)", "2 GPUs"}
    assert "would fit" in refusal.rationale and nb.jobs() == []
    # Each suggestion is one the estimate itself says fits.
    if "2 GPUs" in changes:
        assert estimate_job(config, 2).total / GIB <= gpu


def test_a_first_job_is_forecast_from_its_tokens_and_model_then_from_what_the_lab_measured(tmp_path: Path):
    nb, launcher = _launcher(tmp_path, gpu_memory_gib=None)
    slurm = Launcher(nb, SESSION, SlurmBackend(SlurmSection(partition="gpu", gpus_per_node=8)), tmp_path / "j")
    first = Resources(time_limit_min=240, gpus=8, tokens=2e8, active_params=3_000_000_000, job_class="train")
    made = slurm.forecast("sft", first)
    # 6 x 3e9 x 2e8 FLOPs at the declared 25% of 989 TFLOP/s: 0.67 GPU-h, not the 32 GPU-h of 240 min x 8 GPUs;
    # after the declared start-up of a training job (its compiled blocks' first step), on each of its 8 GPUs.
    startup, work = 8 * 45.0 / 3600, 6 * 3e9 * 2e8 / (0.25 * 989e12) / 3600
    assert made.source == "model" and made.gpuh == pytest.approx(startup + work)
    assert slurm.forecast("sft", first.model_copy(update={"tokens": 4e8})).gpuh == pytest.approx(startup + 2 * work)
    assert slurm.forecast("sft", first.model_copy(update={"active_params": 6_000_000_000})).gpuh == pytest.approx(
        startup + 2 * work)
    # A job of the lab measured at half that speed (in the ledger's own GPU-hours) refines every later forecast.
    nb.start_job("k" * 64, session=SESSION, kind="dpo", executor="slurm", forecast_gpuh=1.0,
                 resources={"tokens": 1e8, "active_params": 3_000_000_000, "job_class": "train"})
    nb.update_job("k" * 64, 1, state="completed", gpu_hours=2 * 6 * 3e9 * 1e8 / (0.25 * 989e12) / 3600)
    assert slurm.forecast("sft", first).gpuh == pytest.approx(startup + 2 * work)
    # Never above one run's bound, and none without its model: the bound of the time limit on every GPU.
    huge = first.model_copy(update={"tokens": 1e15})
    assert slurm.forecast("sft", huge).gpuh == slurm.forecast("sft", huge.model_copy(update={"tokens": None})).gpuh
