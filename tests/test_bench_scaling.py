"""bench/train_scaling.py on the CPU: the cpu-smoke preset as a user runs it (a real torchrun job of 1 gloo process,
then one of 2, full fine-tuning and LoRA each), every field of the results JSON, the 2-rank loss and gradient-norm
trajectories equal to the 1-rank run's, a world size above what is available recorded as not run; bad input exits 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import train_scaling
from tools.jobs.jobrun import NO_MULTICAST_ENV

REPO = Path(__file__).resolve().parents[1]
STEPS = 2


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("scaling")
    proc = subprocess.run([sys.executable, "bench/train_scaling.py", "--preset", "cpu-smoke", "--gpus", "1", "2", "4",
                           "--steps", str(STEPS), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()
    assert last[-1].startswith(" lora    4  not_run"), last[-6:]  # the table is printed last
    return json.loads((out / "train_scaling-cpu-smoke.json").read_text())


@pytest.mark.slow
def test_cpu_smoke_writes_every_field_and_trajectories_match(report):
    assert "bench/train_scaling.py --preset cpu-smoke --gpus 1 2 4 --steps 2 --out" in report["command"]
    assert report["environment"] == NO_MULTICAST_ENV
    assert report["hardware"]["device"] == "cpu" and report["hardware"]["cpu_count"] >= 1
    assert {"torch", "transformers", "peft", "python"} <= set(report["versions"])
    assert report["settings"]["global_batch"] == 2  # micro-batch 1 x the largest world size that ran
    assert report["model_config"]["model_type"] == "nemotron_h"
    for mode in ("full", "lora"):
        one, two = report["runs"]["1"][mode], report["runs"]["2"][mode]
        for n, run in ((1, one), (2, two)):
            assert run["status"] == "ok"
            assert len(run["losses"]) == len(run["grad_norms"]) == len(run["step_s"]) == STEPS
            assert run["tokens_per_s"] > 0 and run["tokens_per_step"] == 2 * 64
            assert len(run["peak_per_rank"]) == n and all(p["peak_rss_gib"] > 0 for p in run["peak_per_rank"])
            assert run["estimate_gib_per_rank"] > 0 and 0 < run["trainable_params"] <= run["total_params"]
            assert run["multicast_env_seen"] == NO_MULTICAST_ENV
        assert two["speedup"] == pytest.approx(two["tokens_per_s"] / one["tokens_per_s"])
        assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
        assert two["goal_speedup"] == 1.7 and two["goal_met"] == (two["speedup"] >= 1.7)
        assert two["matches_1gpu"] and two["max_rel_diff_vs_1gpu"] <= 1e-5
        assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert two["losses"][-1] != one["losses"][0]  # the steps trained: a trajectory, not one repeated value
    assert report["runs"]["1"]["lora"]["trainable_params"] < report["runs"]["1"]["full"]["trainable_params"]
    assert report["runs"]["4"] == {m: {"status": "not_run", "reason": "4 GPUs asked, 2 visible"}
                                   for m in ("full", "lora")}


def test_compare_flags_a_different_trajectory():
    ref = {"status": "ok", "tokens_per_s": 100.0, "losses": [7.0, 6.5], "grad_norms": [3.0, 2.0]}
    same = ref | {"tokens_per_s": 180.0, "losses": [7.0, 6.5 * (1 + 5e-6)]}
    off = same | {"grad_norms": [1.5, 1.0]}  # gradients averaged where they should be summed over ranks
    assert train_scaling.compare(same, ref, 2, 1e-5) == {
        "speedup": 1.8, "efficiency": 0.9, "goal_speedup": 1.7, "goal_met": True,
        "max_rel_diff_vs_1gpu": pytest.approx(5e-6), "rtol": 1e-5, "matches_1gpu": True}
    assert train_scaling.compare(off, ref, 2, 1e-5)["matches_1gpu"] is False


def test_multicast_off_in_the_job_environment():
    assert train_scaling.NO_MULTICAST_ENV == NO_MULTICAST_ENV
    for preset in train_scaling.PRESETS.values():
        assert NO_MULTICAST_ENV.items() <= train_scaling.job_env(preset).items()
    assert train_scaling.job_env(train_scaling.PRESETS["cpu-smoke"])["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("argv, message", [
    (["--preset", "h200"], "--preset h200: needs CUDA GPUs and none is visible"),
    (["--preset", "cpu-smoke", "--gpus", "1", "3"], "--gpus: [3] not a power of two"),
    (["--preset", "cpu-smoke", "--gpus", "2"], "--gpus: must include 1"),
    (["--preset", "cpu-smoke", "--steps", "1"], "--steps: 1; expected at least 2"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys, tmp_path):
    if argv[1] == "h200" and train_scaling.torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    assert train_scaling.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train_scaling: {message}") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # no partial results
