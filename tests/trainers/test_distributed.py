"""FSDP2 over 2 gloo ranks on the CPU (started by torchrun, as the local executor starts a multi-task job) against
one process with the same global batch: same loss and gradient-norm trajectory, same final weights; a SIGTERM on
one rank mid-run saves a DCP checkpoint on both, and the requeued job ends on the uninterrupted run's weights; the
consolidated model loads with from_pretrained; a copy of the interrupted run resumes on 1 rank (DCP reshards);
the interrupted run's whole-model snapshots (before and after the stop) match the single process's.

Tolerances. The two runs compute every micro-batch identically (rank r takes rows [4r, 4r+4) of each 8-row step,
in micro-batches of 2, exactly the single process's micro-batches 2r and 2r+1), so they differ only in how float32
sums are associated: the gradient is (g0+g1)+(g2+g3) instead of ((g0+g1)+g2)+g3, and the gradient norm sums
shard-wise squares. Each such sum is within a few eps of the other relative to sum |g_i| (Higham, "Accuracy and
Stability of Numerical Algorithms", 4.2). AdamW divides the update by sqrt(v), so a relative gradient error d
moves each update by about lr * d; over `steps` steps weights may drift by steps * lr * d. We allow d = 1e-4,
i.e. a few eps times a cancellation factor of ~200 between micro-batch gradients (measured here: 1e-5 after 4
steps). Losses and gradient norms are sums of the same terms: rtol 1e-5. A real difference fails these by orders
of magnitude: a dropped or duplicated row moves the step-1 loss by ~1e-2, and gradients averaged instead of summed
over ranks halve the recorded gradient norm (AdamW itself is blind to that scale, the norm is not).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_testkit import MEMO, assistant, metric_series, user, write_jsonl
from transformers import AutoModelForCausalLM

from evals import synthetic
from trainers import dpo, klce, rft, sft
from trainers.common import LoRASettings
from trainers.distributed import DistEnv, rank_share, read_env

REPO = Path(__file__).resolve().parents[2]
# torchrun of the interpreter running the tests (whatever venv or clone that is).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
WORKER = Path(__file__).with_name("dist_worker.py")
STEPS, LR = 4, 1e-2
WEIGHT_ATOL = STEPS * LR * 1e-4


def _common(model_dir, data, out) -> dict:
    return dict(model_path=str(model_dir), data_path=str(data), output_dir=str(out), lr=LR, steps=STEPS,
                batch_size=8, micro_batch_size=2, system_prompt="Be brief.")


@pytest.fixture(scope="module")
def jobs(model_dirs, tmp_path_factory) -> dict:
    """trainer name -> (config for 2 ranks, same config for 1 process), sharing data and settings."""
    root = tmp_path_factory.mktemp("dist")
    sft_rows = write_jsonl(root / "sft.jsonl", [{"messages": [user(q), assistant(a)]} for q, a in MEMO])
    pairs = write_jsonl(root / "pairs.jsonl", [
        {"id": f"p{i}", "prompt": [user(q)], "chosen": a, "rejected": f"The answer is {i * 3 + 1}."}
        for i, (q, a) in enumerate(MEMO)] + [{"id": "h", "prompt": [user("What is 9 + 9?")], "chosen": "18.",
                                               "rejected": "No."}])
    kl_rows = write_jsonl(root / "klce.jsonl", [{"messages": [user(q), assistant(a)], "kl_only": i >= 6}
                                                for i, (q, a) in enumerate(MEMO)])
    specs = {
        "sft": (sft.SFTConfig, model_dirs["nemotron_h"], sft_rows, {}),
        "dpo": (dpo.DPOConfig, model_dirs["llama"], pairs, dict(beta=0.5, nll_weight=0.2, heldout_fraction=0.1)),
        "klce": (klce.KLCEConfig, model_dirs["nemotron_h"], kl_rows,
                 dict(kl_coef=0.5, lora=LoRASettings(r=4, alpha=8, train_lm_head=True))),
    }
    out = {}
    for name, (config_type, model_dir, data, extra) in specs.items():
        out[name] = tuple(config_type.model_validate(_common(model_dir, data, root / f"{name}-{n}") | extra)
                          for n in ("2ranks", "1proc"))
    out["rft"] = (_rft_config(model_dirs["llama"], root), None)
    return out


def _rft_config(model_dir, root: Path) -> rft.RFTConfig:
    """RFT from a policy that sometimes answers digit sums right (a short SFT on reference answers)."""
    tasks = synthetic.generate("digit_sum", 4, 7)
    items = write_jsonl(root / "items.jsonl", [json.loads(t.item.model_dump_json()) for t in tasks])
    refs = write_jsonl(root / "refs.jsonl", [
        {"messages": [m.model_dump() for m in t.item.messages] + [{"role": "assistant", "content": t.reference}]}
        for t in tasks])
    policy = sft.train(sft.SFTConfig(model_path=model_dir, data_path=refs, output_dir=root / "rft-pre", lr=1e-2,
                                     steps=40, batch_size=4, micro_batch_size=4)).model_dir
    return rft.RFTConfig(model_path=policy, data_path=items, output_dir=root / "rft-2ranks", lr=1e-2, steps=4,
                         batch_size=2, micro_batch_size=1, k=4, temperature=1.0, max_new_tokens=40)


def _torchrun(spec: dict, path: Path, timeout_s: float = 600) -> subprocess.Popen:
    path.write_text(json.dumps(spec))
    env = os.environ | {"OMP_NUM_THREADS": "1", "TRAINER_COLLECTIVE_TIMEOUT_S": str(timeout_s)}
    return subprocess.Popen([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(WORKER), str(path)],
                            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _payload(config) -> dict:
    return json.loads(config.model_dump_json())


@pytest.fixture(scope="module")
def two_rank_runs(jobs, model_dirs, tmp_path_factory):
    """One torchrun job running the SFT, DPO and KL-CE configs on 2 ranks, one after another, then an 8-step SFT
    run that rank 1 holds at step 3 until the test has sent that rank (only) a SIGTERM. Returns the configs."""
    root = tmp_path_factory.mktemp("dist-jobs")
    held = jobs["sft"][0].model_copy(update={"model_path": model_dirs["llama"], "output_dir": root / "held",
                                             "steps": 8, "snapshot_steps": [2, 6]})
    sent = root / "sent"
    spec = {"jobs": [{"trainer": name, "config": _payload(pair[0])} for name, pair in jobs.items()]
            + [{"trainer": "sft", "config": _payload(held)}], "hold": {"step": 3, "until": str(sent)}}
    proc = _torchrun(spec, root / "jobs.json")
    try:
        deadline = time.monotonic() + 600
        while not sent.with_suffix(".held").is_file():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0][-8000:]
            time.sleep(0.05)
        os.kill(int(sent.with_suffix(".pid").read_text()), signal.SIGTERM)  # rank 1 only, as a stray signal
        sent.touch()
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return {name: pair[0] for name, pair in jobs.items()} | {"held": held, "held_output": output,
                                                             "held_rc": proc.returncode}


def _assert_same_run(two, one) -> None:
    for key in ("loss", "grad_norm"):
        assert metric_series(Path(two.output_dir), key) == pytest.approx(metric_series(Path(one.output_dir), key),
                                                                         rel=1e-5)
    a, b = _weights(Path(two.output_dir) / "model"), _weights(Path(one.output_dir) / "model")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=WEIGHT_ATOL)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if (model_dir / "adapter_model.safetensors").is_file() else "model.safetensors"
    return load_file(model_dir / name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "dpo", "klce"])
def test_two_ranks_match_one_process(name, jobs, two_rank_runs):
    two, one = two_rank_runs[name], jobs[name][1]
    train = {"sft": sft.train, "dpo": dpo.train, "klce": klce.train}[name]
    single = train(one)
    result = json.loads((Path(two.output_dir) / "result.json").read_text())
    assert result["world_size"] == 2 and single.world_size == 1
    assert result["tokens_seen"] == single.tokens_seen and result["supervised_tokens"] == single.supervised_tokens
    _assert_same_run(two, one)
    if name == "dpo":
        assert result["metrics"]["heldout_reward_accuracy"] == single.metrics["heldout_reward_accuracy"]


@pytest.mark.slow
def test_rft_samples_each_prompt_once_across_ranks_then_trains_on_both(two_rank_runs):
    run = Path(two_rank_runs["rft"].output_dir)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    # 4 prompts x k=4: each rank sampled its half, rank 0 wrote them all once.
    assert len(samples) == 16 and sorted({s["item_id"] for s in samples}) == sorted(
        json.loads(x)["id"] for x in Path(two_rank_runs["rft"].data_path).read_text().splitlines())
    result = json.loads((run / "result.json").read_text())
    assert result["sampling"]["kept"] > 0 and result["train"]["world_size"] == 2 and result["train"]["steps"] == 4


@pytest.mark.slow
def test_consolidated_full_model_loads_with_from_pretrained(jobs, two_rank_runs):
    model_dir = Path(two_rank_runs["sft"].output_dir) / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    saved = load_file(model_dir / "model.safetensors")
    single = load_file(Path(jobs["sft"][1].output_dir) / "model" / "model.safetensors")
    assert saved.keys() == single.keys()  # the architecture's own checkpoint layout, as one process writes it
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape[-1] == model.config.vocab_size


@pytest.mark.slow
def test_sigterm_on_one_rank_saves_dcp_on_both_and_resume_matches(two_rank_runs, tmp_path):
    base, output = two_rank_runs["held"], two_rank_runs["held_output"]
    assert two_rank_runs["held_rc"] != 0 and "preempted: step 3" in output, output[-8000:]
    run = Path(base.output_dir)
    assert {p.name for p in (run / "resume").iterdir()} >= {".metadata", "rank0.pt", "rank1.pt"}
    assert _lines(run / "metrics.jsonl")[-1]["step"] == 3
    # A copy of the run directory resumes in one process: DCP reshards the 2-rank checkpoint onto 1 rank.
    moved = base.model_copy(update={"output_dir": tmp_path / "one-rank"})
    shutil.copytree(run, moved.output_dir)
    (moved.output_dir / "config.json").write_text(moved.model_dump_json())
    again = _torchrun({"jobs": [{"trainer": "sft", "config": _payload(base)}]}, tmp_path / "again.json")
    output, _ = again.communicate(timeout=600)  # what the launcher does on requeue: the same job again
    assert again.returncode == 0, output[-4000:]
    result = json.loads((run / "result.json").read_text())
    assert result["resumed_at_steps"] == [3] and result["steps"] == 8 and not (run / "resume").exists()
    straight = base.model_copy(update={"output_dir": tmp_path / "straight"})
    sft.train(straight)  # one process, uninterrupted
    _assert_same_run(base, straight)
    assert [line["step"] for line in _lines(run / "metrics.jsonl")] == list(range(1, 9))
    # Whole-model snapshots consolidated from both ranks, one saved before the stop and one after the resume.
    assert [s["step"] for s in result["snapshots"]] == [2, 6]
    for step in (2, 6):
        a, b = _weights(run / "snapshots" / f"step-{step}"), _weights(Path(straight.output_dir) / "snapshots" / f"step-{step}")
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=WEIGHT_ATOL)
    resharded = sft.train(moved)
    assert resharded.resumed_at_steps == [3] and resharded.world_size == 1
    _assert_same_run(moved, straight)


@pytest.mark.slow
def test_a_rank_that_hangs_fails_the_job_as_nccl_timeout(model_dirs, sft_data, tmp_path):
    from tools.jobs.failures import classify

    # Rank 1 stops at step 2 for 20 s; rank 0 waits in the step's collective for 5 s, then fails.
    config = sft.SFTConfig.model_validate(_common(model_dirs["llama"], sft_data, tmp_path / "run"))
    spec = {"jobs": [{"trainer": "sft", "config": _payload(config)}],
            "hold": {"step": 2, "until": str(tmp_path / "never"), "exit_after_s": 20}}
    proc = _torchrun(spec, tmp_path / "jobs.json", timeout_s=5)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert classify("FAILED", proc.returncode, output).failure_class == "nccl_timeout", output[-4000:]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def test_env_torchrun_first_then_slurm_then_single():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_NTASKS": "4", "SLURM_PROCID": "3"}
    assert read_env(torchrun) == DistEnv(rank=1, world_size=2, local_rank=1, source="torchrun")
    slurm = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}
    assert read_env(slurm) == DistEnv(rank=3, world_size=4, local_rank=1, source="slurm")
    assert read_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == DistEnv()  # a one-task Slurm job is one process
    assert read_env({}) == DistEnv() and not DistEnv().distributed
    assert read_env(torchrun | {"TRAINER_COLLECTIVE_TIMEOUT_S": "5"}).collective_timeout_s == 5.0


def test_rank_shares_cover_the_step_once():
    rows = [7, 3, 5, 1, 0, 2, 6, 4]
    shares = [rank_share(rows, DistEnv(rank=r, world_size=4, source="torchrun")) for r in range(4)]
    assert sum(shares, []) == rows and all(len(s) == 2 for s in shares)
