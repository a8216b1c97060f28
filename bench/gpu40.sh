#!/usr/bin/env bash
# Issue 40's 30B-A3B round in one call on the lent H200 (141 GB: the 30B-A3B LoRA step peaks near 99 GiB), as the
# device tool runs it (repository root, $OUT set), the wheels built here first by scripts/gpu-wheels:
#
#     scripts/gpu-wheels .whl                                                  # here, once
#     run(command="bash bench/gpu40.sh 520", carry=[".whl"], kind="nvidia-h200", needs_h200=true, timeout_s=540)
#
# BUDGET_S is the call's budget in seconds. Parts run in this order, each in its own process under `timeout`
# (its limit, or what is left of the budget); a part is skipped when its expected time (from the issue-32 and
# issue-40 logs on the H200: a 30B-A3B build in place takes ~1 s, the first training step ~70-90 s of Triton
# autotuning, the decoder's capture and compile tens of seconds) is more than what is left:
#
#   decode          bench/decode_hybrid.py at 30b-a3b: the check (float32 reduced depth + token agreement with
#                   generate), batch 256 and 64 timed, then the profile of a step at batch 256
#                   -> decode-30b-a3b.json, decode-profile-30b-a3b.json
#   decode-profile  the profile alone, only when the decode part did not write it
#   train-2         bench/train_memory.py LoRA r64 + FP32 head, 4096 tokens, micro 2, 4 steps, then one profiled step
#                   -> train_memory-30b-a3b-b2.json, train-profile-30b-a3b-b2.json
#   train-1         the same at micro 1 -> train_memory-30b-a3b-b1.json
#   summary         both runs with today's memory estimate -> train-30b-a3b-lora.json (no GPU)
#   gpu-tests       GPU_TESTS=1 pytest tests/evals/test_decode_hybrid.py tests/evals/test_gpu_jobs.py
#                   tests/trainers/test_step_graphs.py (137 s on 2026-12-04: it fits only when the rest ran fast)
#
# Everything lands in /tmp/r and comes back as $OUT/results.tgz (with env.txt, summary.txt and every part's log);
# the end of each part's log is printed. Copy the JSON files into bench/results/ after the call.
set -u
BUDGET=${1:?usage: bench/gpu40.sh BUDGET_S [PART...]}; shift
START=$(date +%s)
R=/tmp/r; mkdir -p "$R"
OUTDIR=${OUT:-/tmp/gpu40-out}; mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WHEELS=$(ls .whl/*.whl 2>/dev/null)
[ -n "$WHEELS" ] || { echo "no wheels in .whl/: run scripts/gpu-wheels .whl and carry .whl" >&2; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS || exit 3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -c "import mamba_ssm; print('mamba_ssm', mamba_ssm.__version__)" 2>&1 | tail -n 1
  git rev-parse HEAD 2>/dev/null; echo "install: $(( $(date +%s) - START ))s"
} > "$R/env.txt" 2>&1
cat "$R/env.txt"

TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node 1"
D="python3 bench/decode_hybrid.py --shape 30b-a3b"
M="$TORCHRUN bench/train_memory.py --shape 30b-a3b --steps 4"
declare -A CMD=(
  [decode]="$D --batches 256 64 --new-tokens 128 --generate-tokens 24 --profile $R/decode-profile-30b-a3b.json --out $R/decode-30b-a3b.json"
  [decode-profile]="$D --batches 256 --only-profile --out $R/decode-profile-30b-a3b.json"
  [train-2]="$M --runs lora:2 --profile $R/train-profile-30b-a3b-b2.json --out $R/train_memory-30b-a3b-b2.json"
  [train-1]="$M --runs lora:1 --out $R/train_memory-30b-a3b-b1.json"
  [summary]="python3 bench/train_memory.py --summarize $R/train_memory-30b-a3b-b1.json $R/train_memory-30b-a3b-b2.json --out $R/train-30b-a3b-lora.json"
  [gpu-tests]="env GPU_TESTS=1 python3 -m pytest -q -p no:cacheprovider tests/evals/test_decode_hybrid.py tests/evals/test_gpu_jobs.py tests/trainers/test_step_graphs.py"
)
# Expected seconds (skip when more than what is left) and the hard limit of each part.
declare -A EXPECT=([decode]=200 [decode-profile]=80 [train-2]=140 [train-1]=100 [summary]=5 [gpu-tests]=140)
declare -A LIMIT=([decode]=330 [decode-profile]=150 [train-2]=220 [train-1]=160 [summary]=30 [gpu-tests]=200)
declare -A NEEDS=([decode-profile]="!$R/decode-profile-30b-a3b.json"
                  [summary]="$R/train_memory-30b-a3b-b1.json $R/train_memory-30b-a3b-b2.json")
PARTS=("$@"); [ ${#PARTS[@]} -gt 0 ] || PARTS=(decode decode-profile train-2 train-1 summary gpu-tests)
for part in "${PARTS[@]}"; do
  [ -n "${CMD[$part]:-}" ] || { echo "unknown part $part" >&2; exit 2; }
  skip=""
  for need in ${NEEDS[$part]:-}; do
    if [ "${need#!}" != "$need" ]; then [ -e "${need#!}" ] && skip="already written: ${need#!}"
    else [ -e "$need" ] || skip="missing $need"; fi
  done
  left=$(( BUDGET - ($(date +%s) - START) ))
  (( EXPECT[$part] > left )) && skip="expects ${EXPECT[$part]}s, ${left}s left"
  if [ -n "$skip" ]; then echo "== $part: skipped ($skip)" | tee -a "$R/summary.txt"; continue; fi
  limit=${LIMIT[$part]}; (( limit > left )) && limit=$left
  t0=$(date +%s)
  timeout -k 5 "$limit" ${CMD[$part]} > "$R/$part.log" 2>&1
  rc=$?
  echo "== $part: rc $rc in $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$R/summary.txt"
  grep -v -e Warning -e warnings.warn -e '^ *return forward_call' -e 'output = func' -e '^\[transformers\]' \
    "$R/$part.log" | tail -n 16
done
tar -czf "$OUTDIR/results.tgz" -C /tmp r
cp "$R/summary.txt" "$OUTDIR/summary.txt" 2>/dev/null
ls "$R"
cat "$R/summary.txt"
