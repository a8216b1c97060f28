"""Job entry points that run on a worker (locally or on a Slurm node): SFT, DPO+NLL, KL-leashed CE,
rejection-sampling FT and merges, plus the one chat renderer, collation and checkpoint/resume.

Each job is a plain function taking one pydantic config and returning a pydantic result.

- `chat`: the one chat renderer (ids + assistant-only loss mask) and the Jinja template equal to it.
- `rows`: the JSONL training row formats (SFT, preference pairs, KL-CE with replay rows).
- `tiny`: the offline tokenizer and tiny models (Nemotron-H, Llama, Qwen2, a reward model).
- `common`: the shared config, typed failures (`nan_loss:`, `preempted:`), run paths, model/LoRA loading.
- `batch`, `loop`: collation and log-probs; the optimizer loop with signal-time checkpoint/resume.
- `sft`, `dpo`, `klce`, `rft`, `merge`: one job per file, its config beside it.
"""
