"""Where a job ran and how fast: the record every model job (train, eval) returns with its result.

    placement = measured("cuda", "bfloat16", tokens=120_000, seconds=40.0)
    # Placement(device='cuda', dtype='bfloat16', device_name='NVIDIA H200', tokens_per_s=3000.0)

`require_device` is what a job calls before loading a model: a job handed a GPU that finds none fails with
a `no_gpu:` message (tools/jobs/failures.py classifies it) instead of quietly running on the CPU.
"""

from __future__ import annotations

import platform
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

NO_GPU_PREFIX = "no_gpu:"
Dtype = Literal["float32", "bfloat16", "float16"]


class NoGPUError(RuntimeError):
    """A job that was given GPUs finds no usable one on its host."""


class Placement(BaseModel):
    """Where a job's model ran, in what precision, and its throughput there."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    device: str = Field(description="torch device type the model ran on: cuda or cpu.")
    dtype: str = Field(description="Dtype of the model's weights and compute (bfloat16, float32, ...).")
    device_name: str = Field(description="The GPU's name (torch.cuda.get_device_name), or the CPU's.")
    devices: int = Field(1, ge=1, description="Devices (ranks) the job ran on.")
    tokens_per_s: float | None = Field(
        description="Tokens per second over the job: generated (evals) or trained (training); None when none.")


def device_name(device: str) -> str:
    """The name of the device a job runs on: its GPU's, else the host's processor."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


def measured(device: str, dtype: str, tokens: float, seconds: float, devices: int = 1) -> Placement:
    """The placement of a job that handled `tokens` in `seconds` of its work on `device`."""
    return Placement(device=device.split(":")[0], dtype=dtype, device_name=device_name(device), devices=devices,
                     tokens_per_s=tokens / seconds if tokens and seconds > 0 else None)


def require_device(device: str) -> None:
    """Refuse to run a GPU job where no GPU is usable (never a silent CPU fallback)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise NoGPUError(f"{NO_GPU_PREFIX} the job asked for device {device!r} but this host has no usable GPU "
                         "(torch.cuda.is_available() is False); give the job kind gpus = 0 to run it on the CPU")
