"""Forecasts from the model (tools/jobs/forecast.py): they scale with tokens and active parameters, count an
MoE's routed experts only for the share a token uses, and a measured job of the lab replaces the declared MFU."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import tiny
from tools.jobs.forecast import (
    Hardware,
    MeasuredJob,
    ModelCompute,
    eval_forecast,
    model_compute,
    train_forecast,
)

SPECIAL = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
SMALL = ModelCompute(total_params=30_000_000_000, active_params=3_000_000_000)
BIG = ModelCompute(total_params=30_000_000_000, active_params=6_000_000_000)


def test_train_forecast_scales_with_tokens_and_active_parameters() -> None:
    base = train_forecast(1e9, SMALL, gpus=8)
    assert base.source == "declared_mfu"
    assert train_forecast(2e9, SMALL, gpus=8).gpu_hours == pytest.approx(2 * base.gpu_hours)
    assert train_forecast(1e9, BIG, gpus=8).gpu_hours == pytest.approx(2 * base.gpu_hours)
    # More GPUs: the same GPU-hours, less wall time.
    wide = train_forecast(1e9, SMALL, gpus=16)
    assert wide.gpu_hours == pytest.approx(base.gpu_hours) and wide.wall_hours == pytest.approx(base.wall_hours / 2)
    # 6 FLOPs per active parameter per token at the declared 25% of 989 TFLOP/s.
    hw = Hardware()
    assert base.gpu_hours == pytest.approx(6 * 3e9 * 1e9 / (hw.declared_mfu * hw.peak_flops_per_gpu) / 3600)


def test_a_measured_training_job_refines_the_forecast() -> None:
    declared = train_forecast(1e9, SMALL, gpus=8)
    # An earlier job of the lab trained 1e8 tokens of the 3B-active model in 2 GPU-hours: its achieved speed wins.
    job = MeasuredJob(kind="train", tokens=1e8, gpu_seconds=7200, active_params=SMALL.active_params)
    refined = train_forecast(1e9, SMALL, gpus=8, measured=[job])
    assert refined.source == "measured" and refined.measured_jobs == 1
    assert refined.gpu_hours == pytest.approx(20.0) and refined.gpu_hours != pytest.approx(declared.gpu_hours)
    # The lab's FLOP/s carry over to a model twice as active: twice the cost per token.
    assert train_forecast(1e9, BIG, gpus=8, measured=[job]).gpu_hours == pytest.approx(40.0)
    # Eval measurements do not speak for training.
    probe = MeasuredJob(kind="eval", tokens=1e6, gpu_seconds=10, active_params=SMALL.active_params)
    assert train_forecast(1e9, SMALL, gpus=8, measured=[probe]).source == "declared_mfu"


def test_eval_forecast_from_tokens_and_measured_decode_throughput() -> None:
    declared = eval_forecast(1e6, SMALL, gpus=1)
    assert declared.source == "declared_mfu"
    assert eval_forecast(2e6, SMALL, gpus=1).gpu_hours == pytest.approx(2 * declared.gpu_hours)
    runs = [MeasuredJob(kind="eval", tokens=3.6e6, gpu_seconds=3600, active_params=SMALL.active_params),
            MeasuredJob(kind="eval", tokens=1.8e6, gpu_seconds=1800, active_params=SMALL.active_params)]
    measured = eval_forecast(1e6, SMALL, gpus=2, measured=runs)
    assert measured.source == "measured" and measured.tokens_per_s_per_gpu == pytest.approx(1000.0)
    assert measured.gpu_hours == pytest.approx(1e6 / 1000 / 3600)
    assert measured.wall_hours == pytest.approx(measured.gpu_hours / 2)
    # Rescaled to the model's active parameters: twice as many, half the decode speed.
    assert eval_forecast(1e6, BIG, gpus=2, measured=runs).tokens_per_s_per_gpu == pytest.approx(500.0)


def test_model_compute_counts_routed_experts_by_their_share(tmp_path: Path) -> None:
    moe = tmp_path / "moe"
    tiny._nemotron_h_config(256, SPECIAL).save_pretrained(moe)
    counted = model_compute(moe)
    # The tiny hybrid's one MoE block: 4 experts of up 64x64 and down 64x64, 2 routed per token.
    routed = 4 * 2 * 64 * 64
    assert counted.active_params == counted.total_params - routed + routed * 2 // 4
    dense = tmp_path / "dense"
    tiny._dense_config("llama", 256, SPECIAL).save_pretrained(dense)
    counted = model_compute(dense)
    assert counted.active_params == counted.total_params > 0


def test_a_forecast_needs_tokens_and_gpus() -> None:
    with pytest.raises(ValueError, match="gpus = 0"):
        train_forecast(1e9, SMALL, gpus=0)
    with pytest.raises(ValueError, match="tokens = 0"):
        eval_forecast(0, SMALL, gpus=1)
