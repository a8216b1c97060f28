"""A 2-task trainer job through the loopback Slurm cluster (scripts/slurm-up): the launcher asks for one task per GPU,
the two ranks meet through the rendezvous read from Slurm's environment (submitit's TorchDistributedEnvironment) in a
gloo group, the run equals one process with the same global batch, and the ledger bills both tasks from sacct.

Skipped, with the reason, when no Slurm node is usable. Tolerances as in test_distributed.py (its docstring derives
them): losses and gradient norms rtol 1e-5, weights atol steps * lr * 1e-4."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from trainer_testkit import MEMO, assistant, metric_series, user, write_jsonl

from memory.notebook import Notebook
from tools.jobs.executor import ExecutorSection, SlurmSection
from tools.jobs.launcher import Launcher, Resources
from trainers import sft

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
STEPS, LR = 4, 1e-2
# The node of scripts/slurm-up advertises 2 GPU gres (no devices): 2 tasks of 1 CPU each fit a 2-core node.
SLURM = ExecutorSection(kind="slurm", time_limit_min=15,
                        slurm=SlurmSection(partition="debug", gpus_per_node=2, cpus_per_task=1, mem_gb=2))


def _slurm_unreachable() -> str | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T %c"], capture_output=True, text=True, timeout=15)
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        return f"sinfo failed ({err}); start the cluster with scripts/slurm-up"
    fields = out.stdout.split()
    if out.returncode != 0 or not {"idle", "mixed", "allocated"} & set(fields[::2]):
        return f"no usable Slurm node: {out.stdout.strip() or out.stderr.strip()}"
    if max(int(c) for c in fields[1::2]) < 2:
        return f"the Slurm node has {fields[1]} CPU(s): a 2-task job needs 2"
    return None


def _sacct(job_id: str, fields: str, steps: bool = False) -> list[list[str]]:
    out = subprocess.run(["sacct", "-j", job_id, "-P", "-n", "-o", fields, *([] if steps else ["-X"])],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


def test_two_task_sft_job_on_slurm_equals_one_process_and_bills_both_tasks(model_dirs, tmp_path):
    reason = _slurm_unreachable()
    if reason:
        pytest.skip(reason)
    data = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [user(q), assistant(a)]} for q, a in MEMO])
    config = sft.SFTConfig(model_path=model_dirs["llama"], data_path=data, output_dir=tmp_path / "slurm", lr=LR,
                           steps=STEPS, batch_size=8, micro_batch_size=2, system_prompt="Be brief.")
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook",
                    executor="slurm", config={})
    launcher = Launcher.from_section(nb, "s1", SLURM, tmp_path / "jobs", poll_s=1.0)
    job = launcher.submit("sft", sft.train, config, Resources(time_limit_min=15, signal_delay_s=60))
    try:
        single = sft.train(config.model_copy(update={"output_dir": tmp_path / "single"}))  # while Slurm runs
        result = job.result(timeout_s=1200)
    finally:
        if job.record.state in {"pending", "running"}:
            subprocess.run(["scancel", job.record.external_id], capture_output=True, timeout=60)
    (attempt,) = job.attempts()
    # One task per GPU: sbatch asked for 2 GPUs and 2 tasks, and the job's one step ran 2 tasks.
    script = next((tmp_path / "jobs").rglob(f"{attempt.external_id}_submission.sh")).read_text()
    assert "--gpus-per-node=2" in script and "--ntasks-per-node=2" in script
    assert [n for step, n in _sacct(attempt.external_id, "JobID,NTasks", steps=True) if step.endswith(".0")] == ["2"]
    # Two ranks in one group, equal to one process with the same global batch of 8 rows.
    assert result.world_size == 2 and single.world_size == 1
    assert (result.tokens_seen, result.supervised_tokens) == (single.tokens_seen, single.supervised_tokens)
    for key in ("loss", "grad_norm"):
        assert metric_series(config.output_dir, key) == pytest.approx(metric_series(single.run_dir, key), rel=1e-5)
    two, one = load_file(result.model_dir / "model.safetensors"), load_file(single.model_dir / "model.safetensors")
    assert two.keys() == one.keys()
    for k in two:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=STEPS * LR * 1e-4)
    # Billed for both tasks' GPUs from sacct's accounting: elapsed x allocated gres/gpu.
    ((elapsed, tres),) = _sacct(attempt.external_id, "ElapsedRaw,AllocTRES")
    assert "gres/gpu=2" in tres and attempt.charge == "measured"
    assert attempt.device_seconds == int(elapsed) * 2
    assert attempt.gpu_hours == pytest.approx(attempt.device_seconds / 3600)
    assert nb.ledger("s1").spent_gpuh == pytest.approx(attempt.gpu_hours)
    assert json.loads((config.output_dir / "result.json").read_text())["world_size"] == 2
