"""Job entry points that run on a worker (locally or on a Slurm node, one process per GPU): SFT, DPO+NLL,
KL-leashed CE, rejection-sampling FT and merges, with collation, the shared loop and checkpoint/resume.

Each job is a plain function taking one pydantic config and returning a pydantic result.

- `rows`: the JSONL training row formats (SFT, preference pairs, KL-CE with replay rows).
- `common`: the shared config, typed failures (`nan_loss:`, `preempted:`), run paths, model/LoRA loading,
  weights manifests.
- `batch`, `losses`, `data_cache`: collation; the chunked head + losses at supervised positions; the token cache.
- `distributed`, `checkpoint`, `memory`: the process group and FSDP2; DCP resume state and the consolidated
  model; the per-job memory estimate.
- `loop`: the optimizer loop every trainer runs.
- `sft`, `dpo`, `klce`, `rft`, `merge`: one job per file, its config beside it.
"""
