"""Rejection-sampling fine-tuning: sample k answers per prompt, keep one verified answer, SFT on them.

1. Sample: the current policy (`model_path`) answers every prompt item k times with the eval
   generation engine (`evals.generate.generate`, the one renderer, served stop ids) at the given
   temperature/top_p, seeds `seed + j` for j < k.
2. Verify: the scorer named by `scorer` ("module:function", an eval scorer `(items, completions) ->
   list[Outcome]`, default the synthetic checker `evals.synthetic:score`) marks each answer; an
   answer counts as verified when its outcome has `correct == 1` and generation stopped on a stop id
   (a truncated answer is not a clean SFT target). The reward and the eval score are one function.
3. Select, per prompt with any verified answer: `median_length` keeps the lower-median answer by
   generated token count among the verified ones (neither the shortest shortcut nor the longest
   ramble); `shortest` keeps the shortest. Ties go to the lower sample index.
4. Train: SFT (`trainers.sft.train`) on the kept answers, in `<output_dir>/sft`.

Records pass@1 = mean over prompts of c/k and pass@k = share of prompts with c > 0 (c verified of
k; the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
with n = k). Prompt items are `evals.types.Item` rows (JSONL).

Command:

    .venv/bin/python -m trainers.rft CONFIG.json
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.util import write_json_atomic
from core.versions import Versions
from core.wall import Wall
from evals.decoding import Decoding
from evals.types import Completion, Item, Outcome
from trainers import distributed
from trainers.common import (
    ConfigError,
    TrainConfig,
    TrainResult,
    check_lora_targets,
    device,
    start_run,
)
from trainers.rows import SFTRow, read_rows, write_rows
from trainers.sft import SFTConfig
from trainers.sft import train as sft_train

Scorer = Callable[[list[Item], list[Completion]], list[Outcome]]


class RFTConfig(TrainConfig):
    """Rejection-sampling FT; `data_path` holds prompt items (`evals.types.Item` JSONL)."""

    scorer: str = Field("evals.synthetic:score", description="Verifier: 'module:function', an eval scorer (items, completions) -> outcomes.")
    k: int = Field(4, ge=1, description="Samples per prompt.")
    temperature: float = Field(1.0, gt=0, le=5, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(256, ge=1, description="Cap on generated tokens per sample.")
    selection: Literal["median_length", "shortest"] = Field("median_length", description="Which verified answer to keep per prompt.")
    sample_batch_size: int = Field(64, ge=1, description="Prompts per generation batch.")

    @field_validator("scorer")
    @classmethod
    def _scorer_resolves(cls, v: str) -> str:
        load_scorer(v)
        return v


class SamplingStats(BaseModel):
    """What the sampling phase measured and kept."""

    model_config = ConfigDict(extra="forbid")
    prompts: int = Field(description="Prompt items sampled.")
    k: int = Field(description="Samples per prompt.")
    pass_at_1: float = Field(description="Mean over prompts of verified/k.")
    pass_at_k: float = Field(description="Share of prompts with at least one verified sample.")
    kept: int = Field(description="Prompts with a kept (verified, stopped) answer: the SFT rows.")
    samples_path: Path = Field(description="JSONL of every sample with its outcome.")
    sft_data_path: Path = Field(description="The SFT rows built from the kept answers.")


class RFTResult(BaseModel):
    """Sampling statistics plus the SFT run on the kept answers."""

    model_config = ConfigDict(extra="forbid")
    sampling: SamplingStats = Field(description="pass@1, pass@k and what was kept.")
    train: TrainResult = Field(description="The SFT run on the kept answers.")
    versions: Versions | None = Field(None, description="The versions of torch, transformers, peft, trl and mamba-ssm the job ran with (stamped by the job wrapper, tools/jobs/jobrun.py).")
    wall: Wall | None = Field(None, description="Start-up, work and write-out seconds of the job (core/wall.py; completed by the job wrapper, tools/jobs/jobrun.py).")


def load_scorer(path: str) -> Scorer:
    """Imports 'module:function'; a bad path raises ValueError naming it."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"scorer: {path!r} is not 'module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scorer: cannot import {path!r} ({e})") from e
    if not callable(fn):
        raise ValueError(f"scorer: {path!r} is not callable")
    return fn


# The value each verifying scorer gives an answer it holds right: math, mcq and synthetic report `correct`; the
# constraints scorer `strict` (every constraint followed as written), `ifeval_strict` in its ifeval mode. A lab's
# constraints pool verified nothing while only `correct` was read.
VERIFIED_WHEN = ("correct", "strict", "ifeval_strict")


def _verified(outcome: Outcome, completion: Completion) -> bool:
    return completion.stopped and any(outcome.values.get(name) == 1.0 for name in VERIFIED_WHEN)


def select(samples: list[tuple[Completion, bool]], rule: str) -> Completion | None:
    """The kept answer among one prompt's (completion, verified) samples, or None."""
    good = sorted((c.n_tokens, j) for j, (c, ok) in enumerate(samples) if ok)
    if not good:
        return None
    pick = good[0] if rule == "shortest" else good[(len(good) - 1) // 2]
    return samples[pick[1]][0]


def sample(config: RFTConfig, items: list[Item]) -> list[list[tuple[Completion, bool]]]:
    """k verified-or-not samples per item, from the policy at config.model_path."""
    from evals.generate import generate, load

    loaded = load(config.model_path, device=str(device()), dtype=config.compute_dtype)
    decoding = Decoding(system_prompt=config.system_prompt or "", temperature=config.temperature,
                        top_p=config.top_p, max_new_tokens=config.max_new_tokens)
    scorer = load_scorer(config.scorer)
    per_item: list[list[tuple[Completion, bool]]] = [[] for _ in items]
    for j in range(config.k):
        completions = generate(loaded, items, decoding, seed=config.seed + j, batch_size=config.sample_batch_size)
        outcomes = scorer(items, completions)
        for i, (c, o) in enumerate(zip(completions, outcomes, strict=True)):
            per_item[i].append((c, _verified(o, c)))
    return per_item


def sampling_phase(config: RFTConfig, items: list[Item]) -> SamplingStats:
    """Samples, verifies, selects and writes samples.jsonl and sft.jsonl (skipped when already done)."""
    stats_path = config.output_dir / "sampling.json"
    if distributed.broadcast_object(stats_path.is_file()):  # a requeued job does not resample
        return SamplingStats.model_validate_json(stats_path.read_text())
    # Under several ranks each samples its share of the prompts with its own copy of the policy (generation needs
    # no sharding), and rank 0 writes the files the SFT phase then reads on every rank.
    per_item = distributed.map_shared(lambda part: sample(config, part), items, len(items))
    stats = _write_samples(config, items, per_item) if distributed.setup().is_main else None
    distributed.barrier()
    return distributed.broadcast_object(stats)


def _write_samples(config: RFTConfig, items: list[Item], per_item) -> SamplingStats:
    stats_path = config.output_dir / "sampling.json"
    samples_path, data_path = config.output_dir / "samples.jsonl", config.output_dir / "sft_data.jsonl"
    with open(samples_path, "w") as f:
        for item, samples in zip(items, per_item, strict=True):
            for c, ok in samples:
                f.write(json.dumps({"item_id": item.id, "verified": ok, **c.model_dump()}) + "\n")
    rows = []
    for item, samples in zip(items, per_item, strict=True):
        kept = select(samples, config.selection)
        if kept is not None:
            messages = [m.model_dump() for m in item.messages] + [{"role": "assistant", "content": kept.text}]
            rows.append(SFTRow(id=item.id, messages=messages))
    counts = [sum(ok for _, ok in s) for s in per_item]
    stats = SamplingStats(
        prompts=len(items), k=config.k, pass_at_1=sum(c / config.k for c in counts) / len(items),
        pass_at_k=sum(c > 0 for c in counts) / len(items), kept=len(rows),
        samples_path=samples_path, sft_data_path=data_path,
    )
    if rows:
        write_rows(data_path, rows)
    write_json_atomic(stats_path, json.loads(stats.model_dump_json()))
    return stats


def sft_config(config: RFTConfig, data_path: Path) -> SFTConfig:
    shared = config.model_dump(include=set(TrainConfig.model_fields))
    return SFTConfig(**(shared | {"data_path": data_path, "output_dir": config.output_dir / "sft"}))


def train(config: RFTConfig) -> RFTResult:
    """Runs (or resumes) sampling, verification, selection and the SFT on the kept answers."""
    items = read_rows(config.data_path, Item)
    if config.lora is not None:
        check_lora_targets(config.model_path, config.lora)
    # Every rank checks (the same files give the same answer, so a refusal cannot leave ranks waiting on each other);
    # the identical atomic writes of config.json do not collide.
    paths = start_run(config)  # refuses a run directory that holds another config
    if paths.result.is_file():  # a requeued finished job does no compute
        return RFTResult.model_validate_json(paths.result.read_text())
    stats = sampling_phase(config, items)
    if stats.kept == 0:
        raise ConfigError(f"rft: no verified answer among {config.k} samples for any of {stats.prompts} prompts")
    result = RFTResult(sampling=stats, train=sft_train(sft_config(config, stats.sft_data_path)))
    if distributed.setup().is_main:
        write_json_atomic(paths.result, json.loads(result.model_dump_json()))
    distributed.barrier()
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m trainers.rft CONFIG.json`: runs rejection-sampling FT with the config file's settings."""
    from core.entry import run_main
    from trainers.common import ConfigError
    from trainers.rows import RowsError

    return run_main("python -m trainers.rft", (RFTConfig, train), argv, bad_input=(ConfigError, RowsError))


if __name__ == "__main__":
    sys.exit(main())
