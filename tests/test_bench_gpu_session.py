"""bench/gpu_session.sh's result (issue 39), collected on the CPU from a finished session: every job with where it ran,
its forecast and actual device-seconds and its wall split; forecast/actual by kind; the session's wall summed; the
GPU's busy share from nvidia-smi's samples; the nominee's bundle reloaded by check-bundle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_result_has_the_keys_the_scripts_read(finished, tmp_path: Path) -> None:
    samples = tmp_path / "gpu_samples.csv"
    samples.write_text("0, 512\n37, 20480\n100, 20480\nnot a sample\n")
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_session_result.py"), str(finished.lab),
                          finished.session, str(out), "--samples", str(samples), "--exit-status", "0", "--wall-s", "12",
                          "--extra", 'world_build_s=3'], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["session"]["status"] == "done" and result["session"]["check_bundle_passed"]
    assert result["session"]["nominee"] and result["session"]["exit_status"] == 0 and result["world_build_s"] == 3
    assert result["gpu_busy_share"] == pytest.approx(2 / 3, abs=1e-3) and result["gpu_samples"] == 3
    jobs = result["jobs"]
    assert jobs and all(j["forecast_device_s"] is not None and j["gpu_hours"] is not None for j in jobs)
    model_jobs = [j for j in jobs if j["kind"] in ("eval", "reference", "sft")]
    assert model_jobs and all(j["device"] == "cpu" and j["wall"]["startup_s"] > 0 for j in model_jobs)
    # the nomination's bundle job holds the device its reload serves on; the publish job (kind bundle too) none
    assert "cpu" in {j["device"] for j in jobs if j["kind"] == "bundle"}
    ratios = result["forecast_actual_by_kind"]
    assert {"eval", "sft", "bundle"} <= set(ratios) and all(ratios[k] > 0 for k in ("eval", "sft", "bundle"))
    assert all(r >= 0 for r in ratios.values())  # a data job holds no device: it may take 0 of its forecast
    assert result["wall"]["work_s"] > 0 and "load" in result["wall"]["parts"]
    # On the CPU every job's process is the toy world's device and is charged (tools/world/cost.py), data jobs too;
    # on a GPU host a job that holds no GPU is charged nothing: the list is empty there.
    assert set(result["charged_without_device"]) <= {"ingest", "build", "merge", "bundle"}
    assert result["parent_parameters"] > 0 and set(result["versions"]) >= {"torch", "transformers"}
