#!/usr/bin/env bash
# The GPU proving ground (issue 30): the demo session on one H200 with every model job on the GPU, and what each
# job recorded about where it ran. As the device tool runs it (repository root, $OUT set), with the session's wheels
# carried as .whl (scripts/gpu-wheels: every package of the lock at its locked version, hashes checked, but torch and
# the numerics the GPU image provides; mamba-ssm built pure-python, so its Triton kernels run the hybrid's Mamba layers):
#
#     scripts/gpu-wheels .whl                                              # here, once
#     run(command="GPU_TESTS=1 PROTOCOL=test bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
#
# PROTOCOL=test (or short) runs the playbook at that size (run_agent.py --protocol), for a call of a few minutes.
# Steps: install the wheels into /tmp/site; build the demo world (`world build --size demo`) in /tmp/gpu-lab; run
# `run_agent.py --budget 60gpuh` on it (the local executor sees the GPU: evals, reference answers, the truth scorer
# and training default to it, merges and data jobs stay on the CPU); check the nominee's bundle; write
# bench/results/gpu_session.json (and $OUT/gpu_session.json, with the session's report and logs); then, in the time
# left, the GPU-only tests (GPU_TESTS=1: tests/evals/test_gpu_jobs.py, tests/evals/test_decode_hybrid.py,
# tests/trainers/test_step_graphs.py), whose summary line joins the result:
#
#     {"jobs": [{"kind", "device", "dtype", "device_name", "seconds", "tokens_per_s"}, ...],
#      "session": {"status", "nominee", "check_bundle_passed"}, "versions": {torch, transformers, peft, trl, mamba_ssm},
#      "hardware": ..., "command": ...}
# (every job row carries the versions its own process recorded in its result, core/versions.py).
#
# A job without a model (merge, ingest, build, bundle) records no device: its row says "none". Exit status: the
# session's (0 when it nominated), 3 when the wheels do not install, 4 when no GPU is visible.
set -u
BUDGET_S=${1:-560}
START=$(date +%s)
LAB=/tmp/gpu-lab
RESULT=bench/results/gpu_session.json
OUTDIR=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUTDIR" bench/results
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
# NVLink multicast stays off on the lent GPU machines (the job wrapper sets the same in every job).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

WHEELS=$(ls .whl/*.whl 2>/dev/null)
[ -n "$WHEELS" ] || { echo "no wheels in .whl/: run ../shared/gpu/wheels.sh .whl and carry .whl" >&2; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS || exit 3
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 4)" || { echo "no GPU visible" >&2; exit 4; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "import os; from tools.jobs.executor import local_gpus; print('GPUs the local executor sees:', local_gpus(os.environ))"
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
rm -rf "$LAB"
# A world built elsewhere (the same seed and size build the same files) may travel as .gpu-lab: the build below
# then finds it cached (its manifest's sha256 matches) and the session gets the call's minutes.
[ -d .gpu-lab ] && cp -r .gpu-lab "$LAB"
timeout "$(left)" python3 run_agent.py world build --lab "$LAB" --size demo > "$OUTDIR/world.log" 2>&1 \
  || { tail -20 "$OUTDIR/world.log"; echo "world build failed or ran out of time" >&2; }
# GPU memory sampled through the session: an idle GPU is what this script exists to catch.
( while sleep 2; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits; done ) \
  > "$OUTDIR/gpu_samples.csv" 2>/dev/null &
SAMPLER=$!
SESSION_START=$(date +%s)
# 90 s of the call are kept for the report and the result (check-bundle reloads the bundle on the GPU).
timeout "$(( $(left) - 90 ))" python3 run_agent.py --budget 60gpuh ${PROTOCOL:+--protocol "$PROTOCOL"} --lab "$LAB" --session gpu1 --quiet > "$OUTDIR/session.log" 2>&1
RC=$?
kill "$SAMPLER" 2>/dev/null
SESSION_S=$(( $(date +%s) - SESSION_START ))
tail -8 "$OUTDIR/session.log"
python3 run_agent.py report --lab "$LAB" -o "$OUTDIR/report.html" > /dev/null 2>&1

python3 - "$LAB" "$RESULT" "$RC" "$SESSION_S" "$OUTDIR" <<'EOF'
"""Collect the session's jobs (where each ran, from its recorded result) and its outcome into the result file."""
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from core.versions import installed
from memory.notebook import Notebook

lab, result, rc, session_s, outdir = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])


def placement(job_result):
    found = (job_result or {}).get("placement") or ((job_result or {}).get("train") or {}).get("placement")
    return found or {}


def versions(job_result):
    found = (job_result or {}).get("versions") or ((job_result or {}).get("train") or {}).get("versions")
    return found


def seconds(job):
    if not (job.started_at and job.ended_at):
        return None
    return round(datetime.fromisoformat(job.ended_at).timestamp() - datetime.fromisoformat(job.started_at).timestamp(), 2)


jobs, session, bundle_ok = [], {"status": "not started", "nominee": None, "check_bundle_passed": False}, False
if (lab / "notebook.db").exists():
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        for j in nb.jobs(session="gpu1"):
            p = placement(j.result)
            jobs.append({"kind": j.kind, "state": j.state, "device": p.get("device", "none"), "dtype": p.get("dtype"),
                         "device_name": p.get("device_name"), "devices": p.get("devices"), "seconds": seconds(j),
                         "tokens_per_s": p.get("tokens_per_s"), "gpu_hours": j.gpu_hours,
                         "versions": versions(j.result)})
        s = nb.session("gpu1")
        nominations = nb.decisions("gpu1", kind="nominate")
        nominee = nb.artifact(nominations[-1].payload.artifact_id) if nominations else None
        bundles = [a for a in nb.artifacts(session="gpu1") if a.kind == "bundle"]
    if bundles:
        check = subprocess.run([sys.executable, "run_agent.py", "check-bundle", bundles[-1].path, "--lab", str(lab)],
                               capture_output=True, text=True)
        (outdir / "check_bundle.txt").write_text(check.stdout + check.stderr)
        bundle_ok = check.returncode == 0
    session = {"status": s.status, "nominee": nominee.name if nominee else None, "check_bundle_passed": bundle_ok}
env = (outdir / "env.txt").read_text().splitlines()
model_jobs = [j for j in jobs if j["device"] != "none"]
out = {"jobs": jobs, "session": session | {"exit_status": rc, "wall_s": session_s},
       "every_model_job_on_cuda_bf16": bool(model_jobs) and all(
           (j["device"], j["dtype"]) == ("cuda", "bfloat16") for j in model_jobs),
       "versions": installed().model_dump(),
       # Data jobs (ingest, build) load no model and record no versions: their results are content-hashed records.
       "every_job_on_these_versions": bool(jobs) and all(j["versions"] == installed().model_dump() for j in jobs
                                                          if j["state"] == "completed" and j["versions"] is not None),
       "jobs_without_versions": sorted({j["kind"] for j in jobs if j["versions"] is None}),
       "hardware": env[0] if env else None, "software": env[2] if len(env) > 2 else None,
       "command": "bash bench/gpu_session.sh (world build --size demo; run_agent.py --budget 60gpuh"
                  + (f" --protocol {os.environ['PROTOCOL']}" if os.environ.get("PROTOCOL") else "") + ")",
       "measured_at": datetime.now().isoformat(timespec="seconds")}
result.write_text(json.dumps(out, indent=2) + "\n")
(outdir / "gpu_session.json").write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps(out["session"]), "| model jobs on cuda/bf16:", out["every_model_job_on_cuda_bf16"], "|",
      len(model_jobs), "model jobs of", len(jobs))
EOF
# The GPU-only tests in the call's time that is left (jobs on the GPU record cuda and bf16; the static decoder against
# generate; the captured training step graphs), after the session so that a slow test cannot starve it; their summary
# line joins the result. USE_HUB_KERNELS is left unset: the project's own code turns Hub kernels off.
if [ "${GPU_TESTS:-1}" = 1 ]; then
  t=$(left); [ "$t" -gt 60 ] || t=60
  timeout "$t" python3 -m pytest -q -p no:cacheprovider \
    tests/evals/test_gpu_jobs.py tests/evals/test_decode_hybrid.py tests/trainers/test_step_graphs.py \
    > "$OUTDIR/gpu_tests.log" 2>&1
  echo "gpu tests: exit $? ($(tail -1 "$OUTDIR/gpu_tests.log"))"
  python3 - "$RESULT" "$OUTDIR" <<'EOF2'
import json, sys
from pathlib import Path
result, outdir = Path(sys.argv[1]), Path(sys.argv[2])
lines = (outdir / "gpu_tests.log").read_text().strip().splitlines()
out = json.loads(result.read_text()) | {"gpu_tests": lines[-1] if lines else "no output"}
for path in (result, outdir / "gpu_session.json"):
    path.write_text(json.dumps(out, indent=2) + "\n")
EOF2
fi
exit $RC
