"""The result of a GPU session (bench/gpu_session.sh): what each job recorded about where it ran, what it was forecast
and what it took, where the session's wall went, the nominee's checked bundle and its ground truth.

    python bench/gpu_session_result.py LAB SESSION OUT.json --samples gpu_samples.csv --exit-status 0 --wall-s 300 \
        [--check-bundle] [--extra key=value ...]

Keys (for the scripts that read it): session {status, nominee, check_bundle_passed, exit_status, wall_s}, jobs [{kind,
state, device, dtype, device_name, seconds, device_seconds, forecast_device_s, gpu_hours, tokens_per_s, wall,
versions}], parent_parameters, parent_active_parameters, true_win_rate_ci [low, high], true_win_rate, truth_n,
forecast_actual_by_kind {kind: actual / forecast device-seconds}, wall {startup_s, work_s, write_s, unsplit_s, parts},
gpu_busy_share (nvidia-smi samples with utilization > 0 over all), every_model_job_on_cuda_bf16, charged_without_device
(jobs charged GPU-hours that held no device), lora_arms and lora_merges, versions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.versions import installed  # noqa: E402
from core.wall import wall_of  # noqa: E402
from memory.notebook import JobRecord, Notebook  # noqa: E402
from tools.jobs.accounts import elapsed_s, forecast_device_s, session_accounts  # noqa: E402

TRAIN_KINDS = {"sft", "dpo", "klce", "rft"}


def _found(result: dict[str, Any] | None, key: str) -> Any:
    """A field of a job's result, or of its training run's (RFT nests one)."""
    return (result or {}).get(key) or ((result or {}).get("train") or {}).get(key)


def job_row(j: JobRecord) -> dict[str, Any]:
    p = _found(j.result, "placement") or {}
    wall = wall_of(j.result)
    return {"kind": j.kind, "state": j.state, "device": p.get("device", "none"), "dtype": p.get("dtype"),
            "device_name": p.get("device_name"), "devices": p.get("devices"), "seconds": round(elapsed_s(j), 2),
            "device_seconds": j.device_seconds, "forecast_device_s": forecast_device_s(j), "gpu_hours": j.gpu_hours,
            "tokens_per_s": p.get("tokens_per_s"), "adapter": _found(j.result, "adapter"),
            "wall": None if wall is None else wall.model_dump(exclude={"began_at"}),
            "versions": _found(j.result, "versions")}


def busy_share(samples: Path | None) -> tuple[float | None, int]:
    """Share of nvidia-smi samples (lines 'utilization, memory') with utilization above 0, and how many."""
    if samples is None or not samples.is_file():
        return None, 0
    utils = []
    for line in samples.read_text().splitlines():
        head = line.split(",")[0].strip()
        if head.isdigit():
            utils.append(int(head))
    return (round(sum(u > 0 for u in utils) / len(utils), 3) if utils else None), len(utils)


def check_bundle(lab: Path, path: str) -> tuple[bool, str]:
    out = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "check-bundle", path, "--lab", str(lab)],
                         capture_output=True, text=True, cwd=REPO)
    return out.returncode == 0, out.stdout + out.stderr


def collect(lab: Path, session: str, samples: Path | None = None, run_check_bundle: bool = True,
            check_log: Path | None = None) -> dict[str, Any]:
    """The session's result, read from its notebook (and its world's spec)."""
    from agent.config import load_lab_config
    from trainers.recipe import model_shape

    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        s = nb.session(session)
        jobs = [job_row(j) for j in nb.jobs(session=session)]
        nominations = nb.decisions(session, kind="nominate")
        nominee = nb.artifact(nominations[-1].payload.artifact_id) if nominations else None
        bundles = [a for a in nb.artifacts(session=session) if a.kind == "bundle"]
        truths = nb.decisions(session, kind="truth")
        accounts = session_accounts(nb, session)
    bundle_ok = False
    if bundles and run_check_bundle:
        bundle_ok, text = check_bundle(lab, bundles[-1].path)
        if check_log is not None:
            check_log.write_text(text)
    truth = truths[-1].payload if truths else None
    model_jobs = [j for j in jobs if j["device"] != "none"]
    model = load_lab_config(lab).model
    shape = model_shape(model.parent or model.base)
    share, n_samples = busy_share(samples)
    return {
        "session": {"status": s.status, "nominee": nominee.name if nominee else None,
                    "check_bundle_passed": bundle_ok},
        "jobs": jobs,
        "parent_parameters": shape.params_total, "parent_active_parameters": shape.params_active,
        "true_win_rate_ci": [truth.ci_low, truth.ci_high] if truth else None,
        "true_win_rate": truth.win_rate if truth else None, "truth_n": truth.n if truth else None,
        "forecast_actual_by_kind": accounts.ratios(),
        "forecast_by_kind": {k: a.model_dump() for k, a in accounts.kinds.items()},
        "wall": accounts.wall.model_dump(),
        "gpu_busy_share": share, "gpu_samples": n_samples,
        "every_model_job_on_cuda_bf16": bool(model_jobs) and all(
            (j["device"], j["dtype"]) == ("cuda", "bfloat16") for j in model_jobs),
        # Placement and charge agree: a job charged GPU-hours held a device (on a GPU host a CPU job is charged 0).
        "charged_without_device": sorted({j["kind"] for j in jobs if (j["gpu_hours"] or 0) > 0 and j["device"] == "none"}),
        "lora_arms": sorted(j["kind"] for j in jobs if j["kind"] in TRAIN_KINDS and j["adapter"]),
        "lora_merges": sum(1 for j in jobs if j["kind"] == "merge" and j["state"] == "completed"),
        "versions": installed().model_dump(),
        "measured_at": datetime.now().isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("lab", type=Path)
    p.add_argument("session")
    p.add_argument("out", type=Path, nargs="+", help="file(s) the result is written to")
    p.add_argument("--samples", type=Path, help="nvidia-smi samples taken during the session")
    p.add_argument("--exit-status", type=int, default=None)
    p.add_argument("--wall-s", type=float, default=None)
    p.add_argument("--check-log", type=Path, help="where check-bundle's output goes")
    p.add_argument("--no-check-bundle", action="store_true")
    p.add_argument("--extra", action="append", default=[], metavar="KEY=JSON", help="more top-level keys")
    args = p.parse_args(argv)
    if not (args.lab / "notebook.db").exists():
        out: dict[str, Any] = {"session": {"status": "not started", "nominee": None, "check_bundle_passed": False}}
    else:
        out = collect(args.lab, args.session, args.samples, not args.no_check_bundle, args.check_log)
    out["session"] |= {"exit_status": args.exit_status, "wall_s": args.wall_s}
    for item in args.extra:
        key, _, value = item.partition("=")
        out[key] = json.loads(value)
    for path in args.out:
        path.write_text(json.dumps(out, indent=2) + "\n")
    s = out["session"]
    print(json.dumps(s), "| forecast/actual:", out.get("forecast_actual_by_kind"), "| busy:", out.get("gpu_busy_share"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
