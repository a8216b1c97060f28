"""Jobs run where their resources say (issue 30): `[executor.resources.<kind>]` reaches sbatch, single-process
functions run once in a multi-task job, a 2-task eval shares its items and merges them as one process would, a
model job placed on CUDA fails as no_gpu on a host without one, and a job's config takes device and dtype from
its resources."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from core import tiny
from evals import synthetic
from evals.decoding import Decoding
from evals.job import EvalJobConfig, SuiteSpec
from evals.job import run as run_eval
from memory.notebook import Notebook
from tools.context import LabSpec, LabSuite, ToolContext
from tools.evaluate import engine_options
from tools.jobs.executor import ExecutorSection, ResourcesSection, SlurmSection
from tools.jobs.launcher import JobFailed, Launcher, Resources
from tools.jobs.probe import CallsConfig, calls
from tools.paths import LabPaths

SESSION = "s1"
# The loopback cluster's node has 2 GPU gres (without devices): enough to see them allocated.
SLURM2 = ExecutorSection(kind="slurm", time_limit_min=5,
                         slurm=SlurmSection(partition="debug", gpus_per_node=2, cpus_per_task=1, mem_gb=1))


def _ctx(nb: Notebook, root: Path, section: ExecutorSection, launcher: Launcher | None = None,
         local_gpus: int = 0, eval_batch_size: int | None = None) -> ToolContext:
    lab = LabSpec(parent=root / "parent", tokenizer=root / "parent", feedback=root / "feedback.jsonl",
                  dev_fraction=0.2, sealed_fraction=0.1,
                  suites=[LabSuite(name="digits", scorer="synthetic", file=root / "digits.jsonl")], bars=None,
                  served=Decoding(), time_limit_min=section.time_limit_min, eval_batch_size=eval_batch_size,
                  gpu_dtype=section.gpu_dtype,
                  job_resources={k: section.kind_resources(k, local_gpus) for k in ResourcesSection.model_fields})
    return ToolContext(nb=nb, session=SESSION, paths=LabPaths(root=root), lab=lab, jobs=launcher)  # type: ignore[arg-type]


def test_a_jobs_device_and_dtype_come_from_its_resources(notebook: Notebook, tmp_path: Path) -> None:
    # A GPU host (2 GPUs): evals on one GPU in bf16 with the engine's fast path, merges and data on the CPU.
    gpu = _ctx(notebook, tmp_path, ExecutorSection(kind="local"), local_gpus=2)
    assert gpu.placement("eval") == ("cuda", "bfloat16") and gpu.placement("reference") == ("cuda", "bfloat16")
    assert engine_options(gpu, "eval") == {"device": "cuda", "dtype": "bfloat16", "static_cache": True,
                                           "batch_size": None}  # None: the job sizes its batch from free memory
    eval_r, merge_r, train_r = (gpu.resources(kind=k) for k in ("eval", "merge", "sft"))
    assert (eval_r.gpus, eval_r.device, eval_r.single_process) == (1, "cuda", False)
    assert (merge_r.gpus, merge_r.device, merge_r.single_process) == (0, "cpu", True)
    assert (train_r.gpus, train_r.device) == (2, "cuda")
    # A CPU host: everything on the CPU in float32, at the lab's batch (64 unless lab.toml says).
    cpu = _ctx(notebook, tmp_path, ExecutorSection(kind="local"), local_gpus=0)
    assert engine_options(cpu, "eval") == {"device": "cpu", "dtype": "float32", "static_cache": False,
                                           "batch_size": 64}
    assert cpu.resources(kind="eval").device == "cpu" and cpu.resources(kind="sft").gpus == 0
    # lab.toml's dtype and batch size win; a kind set to no GPU runs on the CPU even on a GPU host.
    section = ExecutorSection(kind="local", gpu_dtype="float16", resources={"eval": {"gpus": 0}, "truth": {"gpus": 1}})
    lab = _ctx(notebook, tmp_path, section, local_gpus=2, eval_batch_size=16)
    assert engine_options(lab, "eval") == {"device": "cpu", "dtype": "float32", "static_cache": False, "batch_size": 16}
    assert lab.placement("truth") == ("cuda", "float16")


def test_slurm_defaults_per_kind() -> None:
    section = ExecutorSection(kind="slurm", time_limit_min=30, slurm=SlurmSection(partition="p", gpus_per_node=8),
                              resources={"train": {"nodes": 4, "time_limit_min": 600}, "merge": {"mem_gb": 512}})
    got = {k: section.kind_resources(k, local_gpus=0) for k in ResourcesSection.model_fields}
    assert {k: r.gpus for k, r in got.items()} == {"train": 8, "eval": 1, "reference": 1, "merge": 0, "data": 0,
                                                   "bundle": 1, "truth": 1}
    assert (got["train"].nodes, got["train"].time_limit_min, got["eval"].time_limit_min) == (4, 600, 30)
    assert (got["merge"].mem_gb, got["eval"].mem_gb, got["eval"].cpus) == (512, 64, 8)


@pytest.mark.slurm
def test_slurm_gets_per_kind_resources_in_sbatch(slurm_cluster: None, notebook: Notebook, tmp_path: Path) -> None:
    launcher = Launcher.from_section(notebook, SESSION, SLURM2, tmp_path / "jobs", poll_s=0.5)
    ctx = _ctx(notebook, tmp_path, SLURM2, launcher)
    jobs = {}
    for kind in ("eval", "merge", "sft"):
        # The probe loads no model: no device check (the loopback GPUs have no devices behind them).
        job = launcher.submit(kind, calls, CallsConfig(output_dir=tmp_path / kind), ctx.resources(kind=kind, device=None))
        jobs[kind] = job
    for kind, job in jobs.items():
        job.result(timeout_s=300)
        record = job.record
        tres = subprocess.run(["sacct", "-j", record.external_id, "-X", "-P", "-n", "-o", "AllocTRES"], check=True,
                              capture_output=True, text=True).stdout
        script = next(Path(record.folder).glob("*_submission.sh")).read_text()
        lines = (tmp_path / kind / "calls.txt").read_text().splitlines()
        if kind == "eval":
            assert "gres/gpu=1" in tres and "--ntasks-per-node=1" in script and len(lines) == 1
        if kind == "merge":  # no GPU asked, none charged; one process
            assert "gres/gpu" not in tres and "--gpus-per-node=0" in script and len(lines) == 1
            assert record.gpu_hours == 0
        if kind == "sft":  # a node's 2 GPUs, one task each, and every rank runs a trainer
            assert "gres/gpu=2" in tres and "--ntasks-per-node=2" in script
            assert sorted(int(line.split()[0]) for line in lines) == [0, 1]


def test_a_single_process_function_runs_once_in_a_two_task_job(launcher: Launcher, tmp_path: Path) -> None:
    slurm = launcher.backend.name == "slurm"
    extra = {"gpus": 2} if slurm else {"tasks": 2}
    once = launcher.submit("merge", calls, CallsConfig(output_dir=tmp_path / "once"),
                           Resources(time_limit_min=3, single_process=True, **extra))
    every = launcher.submit("sft", calls, CallsConfig(output_dir=tmp_path / "every"), Resources(time_limit_min=3, **extra))
    assert once.result(timeout_s=300).rank == 0 and every.result(timeout_s=300).rank == 0
    assert [line.split()[0] for line in (tmp_path / "once" / "calls.txt").read_text().splitlines()] == ["0"]
    assert sorted(line.split()[0] for line in (tmp_path / "every" / "calls.txt").read_text().splitlines()) == ["0", "1"]


def test_a_cuda_job_on_a_host_without_a_gpu_fails_as_no_gpu(notebook: Notebook, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    launcher = Launcher.from_section(notebook, SESSION, ExecutorSection(kind="local"), tmp_path / "jobs", poll_s=0.2)
    job = launcher.submit("eval", calls, CallsConfig(output_dir=tmp_path / "gpu"),
                          Resources(time_limit_min=2, gpus=1, device="cuda"))
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=180)
    record = failed.value.record
    assert record.failure_class == "no_gpu" and "no usable GPU" in record.failure_detail
    assert not (tmp_path / "gpu").exists()  # the function never ran: no quiet CPU run
    assert len(job.attempts()) == 1  # recorded, not retried
    # Placed on the CPU, a job sees no GPU even where there are some.
    cpu = launcher.submit("merge", calls, CallsConfig(output_dir=tmp_path / "cpu"),
                          Resources(time_limit_min=2, gpus=0, device="cpu"))
    assert cpu.result(timeout_s=180).cuda_visible_devices == ""


@pytest.fixture(scope="module")
def eval_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("split-eval")
    model = tiny.build_model("llama", tiny.build_tokenizer(root / "tokenizer"), root / "model")
    items = [t.item for t in synthetic.generate("digit_sum", 10, seed=3)]
    (root / "digits.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in items))
    return model, root / "digits.jsonl"


@pytest.mark.slow  # three eval jobs of a tiny model, two of them with two processes
@pytest.mark.parametrize("decoding", [Decoding(max_new_tokens=6), Decoding(temperature=1.0, max_new_tokens=6)],
                         ids=["greedy", "sampled"])
def test_a_two_task_eval_shares_its_items_and_merges_as_one_process(
        launcher: Launcher, eval_inputs: tuple[Path, Path], tmp_path: Path, decoding: Decoding) -> None:
    model, items = eval_inputs
    suites = (SuiteSpec(name="digits", scorer="synthetic", items_path=items),
              SuiteSpec(name="again", scorer="loops", items_path=items))
    outputs = {}
    # Batches of 4: the one-process plan has 3 batches per suite, which the ranks take 2 and 1 (greedy); sampled
    # replicates go whole to the ranks (each seeds itself).
    for tasks in (1, 2):
        cfg = EvalJobConfig(checkpoint=model, decoding=decoding, suites=suites, replicates=2, batch_size=4,
                            output_dir=tmp_path / f"tasks{tasks}")
        extra = {"gpus": 0, "tasks": tasks}
        job = launcher.submit("eval", run_eval, cfg, Resources(time_limit_min=5, device="cpu", **extra))
        outputs[tasks] = (job.result(timeout_s=600), job.record)
    one, two = outputs[1][0], outputs[2][0]
    assert two.placement is not None and (two.placement.devices, two.placement.device) == (2, "cpu")
    assert two.generated_tokens == one.generated_tokens > 0
    assert [s.model_dump(exclude={"completions_path"}) for s in two.suites] == \
        [s.model_dump(exclude={"completions_path"}) for s in one.suites]
    files = sorted(p.name for p in (tmp_path / "tasks1").glob("completions-*.jsonl"))
    assert len(files) == (4 if decoding.temperature else 2)
    for name in files:
        assert (tmp_path / "tasks2" / name).read_bytes() == (tmp_path / "tasks1" / name).read_bytes()
    assert json.loads((tmp_path / "tasks2" / "result.json").read_text())["placement"]["devices"] == 2
    # Both ranks generated a share, as their logs say.
    logs = "".join(p.read_text() for p in Path(outputs[2][1].folder).glob("*_log.err"))
    shares = [int(line.split("generated ")[1].split()[0]) for line in logs.splitlines() if " of 2: generated " in line]
    assert len(shares) == 2 and all(shares) and sum(shares) == (40 if decoding.temperature else 20)


def test_a_cpu_job_on_a_gpu_host_holds_and_is_charged_no_device() -> None:
    # On a host without GPUs the CPU processes are the devices (the toy world's cost model); on a GPU host a merge
    # or a dataset build holds none: its forecast bound and its charge are zero, as on Slurm (the H200 session's
    # merge was forecast 41.75 simulated GPU-h against a 60 GPU-h budget).
    from tools.jobs.launcher import LocalBackend

    merge = Resources(time_limit_min=240, gpus=0)
    train = Resources(time_limit_min=240, gpus=1)
    gpu_host, cpu_host = LocalBackend(host_gpus=1), LocalBackend(host_gpus=0)
    assert (gpu_host.devices(merge), gpu_host.devices(train)) == (0, 1)
    assert (cpu_host.devices(merge), cpu_host.devices(train)) == (1, 1)


def test_a_failed_task_ends_the_other_tasks_of_its_slurm_job(slurm_cluster: None, notebook: Notebook,
                                                             tmp_path: Path) -> None:
    # srun --kill-on-bad-exit: rank 0 fails at once and rank 1, which would sleep 240 s (as a rank waiting in a
    # collective or the rendezvous for one that died), is ended with it, long before the job's time limit.
    from tools.jobs.jobrun import RENDEZVOUS_PORTS, rendezvous_port

    launcher = Launcher.from_section(notebook, SESSION, SLURM2, tmp_path / "jobs", poll_s=0.5)
    job = launcher.submit("probe", calls, CallsConfig(output_dir=tmp_path / "c", fail_rank=0, others_sleep_s=240),
                          Resources(time_limit_min=5, gpus=2, device=None))
    with pytest.raises(JobFailed):
        job.result(timeout_s=200)
    assert "--kill-on-bad-exit=1" in next(Path(job.record.folder).glob("*_submission.sh")).read_text()
    elapsed = subprocess.run(["sacct", "-j", job.record.external_id, "-X", "-P", "-n", "-o", "ElapsedRaw"],
                             check=True, capture_output=True, text=True).stdout.split()
    assert elapsed and int(elapsed[0]) < 120
    assert sorted(int(line.split()[0]) for line in (tmp_path / "c" / "calls.txt").read_text().splitlines()) == [0, 1]
    # The rendezvous port is the job's, the same on every rank, below the ephemeral range.
    assert rendezvous_port("321") == rendezvous_port("321") and RENDEZVOUS_PORTS[0] <= rendezvous_port("321") <= 32767
