#!/usr/bin/env bash
# All GPU benchmarks of issues 17 and 18 in one call on the lent H200, as the device tool runs it (repository root,
# $OUT set, wheels carried in bench/.wheels/h6: pydantic, TRL, datasets, peft and transformers 5.24 to match the
# development pins; the GPU image has torch 2.11 and transformers 5.17):
#
#     run(command="bash bench/h200.sh 560 PART...", carry=["bench/.wheels/h6"], timeout_s=600)
#
# The first argument is the call's budget in seconds; each PART runs in its own process, in the order given, under
# `timeout` (its own limit, or what is left of the budget), and is skipped when too little is left. Results and logs
# land in /tmp/r and come back as $OUT/results.tgz (the tool returns at most 8 files); the end of each part's log is
# printed. Parts: gen-b128 gen-b64 gen-b128-sampled gen-b64-sampled gen-b128-dynamic gen-nemotron train-dense train-lora train-hybrid
# train-dpo train-dense-all train-hybrid-compiled train-hybrid-auto gen-b256 variants variants-compile variants-hybrid
# decode decode-triton memory merge packing gpu-tests variants-graphs train-hybrid-b2 train-hybrid-b4 gpu-tests-decode
# decode-30b decode-bench-hybrid train-30b-1 train-30b-2 (issue 32: carry=[".whl"], the wheels of ../shared/gpu/wheels.sh). The hybrid parts need the mamba-ssm wheel carried too:
#     carry=["bench/.wheels/h6", "bench/.wheels/h8/mamba_ssm-2.3.2.post1-py3-none-any.whl"]
set -u
BUDGET=$1; shift
START=$(date +%s)
R=/tmp/r; mkdir -p "$R"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_DATASETS_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The mamba-ssm pure-python wheel (bench/.wheels/h8) joins when carried too: the hybrid parts need it.
# The session's wheels (../shared/gpu/wheels.sh .whl, mamba-ssm's pure-python build among them) when carried as .whl.
WHEELS=$(ls .whl/*.whl 2>/dev/null)
[ -n "$WHEELS" ] || WHEELS="$(ls bench/.wheels/h6/*.whl) $(ls bench/.wheels/h8/mamba_ssm-*.whl 2>/dev/null)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS || exit 3
export PYTHONPATH=/tmp/site
{ nvidia-smi; df -h /tmp .; python3 -c "import torch, transformers, trl, peft, datasets, pydantic, pyarrow;
print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft',
      peft.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__, 'cuda', torch.version.cuda)"
} > "$R/env.txt" 2>&1
{ nproc; grep -m1 'model name' /proc/cpuinfo; grep -o -m1 -w sha_ni /proc/cpuinfo; } >> "$R/env.txt"
tail -7 "$R/env.txt"
G="python3 bench/gen_throughput.py --device cuda --dtype bfloat16 --prompts 256 --max-new-tokens 256"
T="python3 bench/train_throughput.py --device cuda --seq-len 4096"
declare -A CMD=(
  [gen-b128]="$G --model llama-1b --batch-size 128 --static-cache --baseline-prompts 2 --out $R/gen-llama-b128.json"
  [gen-b64]="$G --model llama-1b --batch-size 64 --static-cache --baseline-prompts 1 --out $R/gen-llama-b64.json"
  [gen-b128-sampled]="$G --model llama-1b --batch-size 128 --static-cache --sampled --baseline-prompts 1 --out $R/gen-llama-b128-sampled.json"
  [gen-b128-dynamic]="$G --model llama-1b --batch-size 128 --baseline-prompts 1 --out $R/gen-llama-b128-dynamic.json"
  [gen-nemotron]="python3 bench/gen_throughput.py --device cuda --dtype bfloat16 --model nemotron-h --prompts 64 --batch-size 64 --max-new-tokens 64 --baseline-prompts 1 --out $R/gen-nemotron-h.json"
  [train-dense]="$T --shape llama-1b --batch 4 --steps 6 --trl-no-checkpointing --out $R/train_throughput-llama-1b.json"
  [train-hybrid]="$T --shape nemotron-h --batch 2 --steps 3 --kinds sft-full sft-lora --out $R/train_throughput-nemotron-h.json"
  [train-dense-all]="$T --shape llama-1b --batch 4 --steps 6 --kinds sft-full sft-lora dpo --out $R/train_throughput-llama-1b-all.json"
  [train-hybrid-compiled]="$T --shape nemotron-h --batch 2 --steps 3 --kinds sft-full sft-lora --compile-blocks on --out $R/train_throughput-nemotron-h-compiled.json"
  [train-hybrid-auto]="$T --shape nemotron-h --batch 2 --steps 6 --kinds sft-full sft-lora --out $R/train_throughput-nemotron-h-lora-auto.json"
  [variants-hybrid]="python3 bench/train_step_variants.py --device cuda --shape nemotron-h --batch 2 --steps 8 --variants full-compile-fused lora-compile-fused lora-compile-fused-mamba lora-compile-fused-nogc full-compile-fused-nogc --profile full-compile-fused lora-compile-fused --out $R/train_step_variants-nemotron-h-lora.json"
  [train-lora]="$T --shape llama-1b --batch 4 --steps 6 --kinds sft-full sft-lora --out $R/train_throughput-llama-1b-lora.json"
  [train-dpo]="$T --shape llama-1b --batch 4 --steps 6 --kinds dpo --out $R/train_throughput-llama-1b-dpo.json"
  [gen-b256]="$G --model llama-1b --batch-size 256 --static-cache --baseline-prompts 1 --out $R/gen-llama-b256.json"
  [decode]="python3 bench/decode_step.py --profile --out $R/decode_step-llama-1b.json"
  [variants]="python3 bench/train_step_variants.py --device cuda --profile --out $R/train_step_variants-llama-1b.json"
  [variants-compile]="python3 bench/train_step_variants.py --device cuda --profile --variants full-compile full-compile-fused lora-compile lora-compile-fused --out $R/train_step_variants-llama-1b-compile.json"
  [decode-triton]="python3 bench/decode_step.py --profile --variants default triton triton-fused --profile-engine --out $R/decode_step-llama-1b-triton.json"
  [packing]="python3 bench/mamba_kernels.py --parts packing --out $R/mamba_kernels-packing.json"
  [memory]="python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/train_memory.py --out $R/train_memory-h200.json"
  [merge]="python3 bench/merge_throughput.py --size-gb 4 --shard-gb 1 --repeats 4 --profile --results $R/merge_throughput-h200.json"
  [gpu-tests]="env PYTHONPATH=/tmp/site:. python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/trainers tests/trainers/test_step_graphs.py"
  [variants-graphs]="python3 bench/train_step_variants.py --device cuda --shape nemotron-h --batch 2 --steps 8 --variants full-compile-fused-nographs full-compile-fused lora-compile-fused-nographs lora-compile-fused --profile lora-compile-fused --out $R/train_step_variants-nemotron-h-graphs.json"
  [train-hybrid-b2]="$T --shape nemotron-h --batch 2 --steps 8 --kinds sft-full sft-lora --out $R/train_throughput-nemotron-h-b2.json"
  [train-hybrid-b4]="$T --shape nemotron-h --batch 4 --steps 8 --kinds sft-full sft-lora --out $R/train_throughput-nemotron-h-b4.json"
  [gpu-tests-decode]="env PYTHONPATH=/tmp/site:. python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/evals tests/evals/test_decode_hybrid.py"
  [decode-30b]="python3 bench/decode_hybrid.py --shape 30b-a3b --batches 64 256 --new-tokens 128 --generate-tokens 24 --profile --out $R/decode-30b-a3b.json"
  [decode-bench-hybrid]="python3 bench/decode_hybrid.py --shape nemotron-h --batches 64 --new-tokens 128 --out $R/decode-nemotron-h.json"
  [memory-lora]="python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/train_memory.py --runs lora:1 lora:2 --out $R/train_memory-bench-3b-lora.json"
  [train-30b-1]="python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/train_memory.py --shape 30b-a3b --runs lora:1 --steps 4 --out $R/train_memory-30b-a3b-b1.json"
  [train-30b-2]="python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/train_memory.py --shape 30b-a3b --runs lora:2 --steps 4 --out $R/train_memory-30b-a3b-b2.json"
  [gen-b64-sampled]="$G --model llama-1b --batch-size 64 --static-cache --sampled --baseline-prompts 1 --out $R/gen-llama-b64-sampled.json"
)
declare -A LIMIT=([gen-b128]=110 [gen-b64]=70 [gen-b128-sampled]=70 [gen-b128-dynamic]=90 [gen-nemotron]=100
                  [train-dense]=240 [train-lora]=120 [train-dpo]=90 [gen-b256]=80 [decode]=120 [train-hybrid]=150 [variants]=90 [memory]=170 [merge]=170 [gen-b64-sampled]=70
                  [variants-compile]=210 [decode-triton]=90 [packing]=200
                  [train-dense-all]=270 [train-hybrid-compiled]=170 [train-hybrid-auto]=200 [variants-hybrid]=330
                  [gpu-tests]=120 [gpu-tests-decode]=90 [decode-30b]=240 [decode-bench-hybrid]=80 [memory-lora]=120 [train-30b-1]=130 [train-30b-2]=130 [variants-graphs]=330 [train-hybrid-b2]=260 [train-hybrid-b4]=280)
for part in "$@"; do
  left=$(( BUDGET - ($(date +%s) - START) ))
  limit=${LIMIT[$part]}; (( limit > left )) && limit=$left
  if (( limit < 30 )); then echo "== $part: skipped, ${left}s left" | tee -a "$R/summary.txt"; continue; fi
  t0=$(date +%s)
  timeout -k 5 "$limit" ${CMD[$part]} > "$R/$part.log" 2>&1
  rc=$?
  echo "== $part: rc $rc in $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$R/summary.txt"
  grep -v -e Warning -e warnings.warn -e '^ *return forward_call' "$R/$part.log" | tail -n 14
done
tar -czf "$OUT/results.tgz" -C /tmp r
