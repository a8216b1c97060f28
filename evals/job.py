"""The eval job: load a checkpoint once, generate every suite at the served decoding, score it.

`run(EvalJobConfig) -> EvalResult` is a plain function: it runs in-process in tests, as a local
subprocess or on a Slurm node through submitit. Everything it produces goes under `output_dir`:
`config.json` (the full config), one `completions-<suite>-r<k>.jsonl` per generated replicate,
`judgments-<suite>-r<k>.jsonl` for judged suites (each sampled replicate is judged anew, its A/B key
drawn from that replicate's seed), and `result.json`. The agent's tools record the result
in the notebook; the job itself never touches it.

Replicates (for the noise floor): with sampling, replicate k regenerates with seed `seed + k`;
under greedy decoding regeneration would repeat itself, so replicate 0 is the full suite and
replicate k >= 1 is a seeded bootstrap resample of its items (the item-sampling noise). A sampled job may
start at `first_replicate` > 0 to add draws to replicates an earlier job recorded (seed + k is still the seed).

Command (a config JSON written by the evaluate tool):

    .venv/bin/python -m evals.job CONFIG.json
"""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.jsonl import read_values
from core.placement import Placement, measured, require_device
from core.versions import Versions
from core.wall import Laps, Wall
from evals import constraints, judge, length_stop, loops, math, mcq, synthetic
from evals.decoding import Decoding
from evals.judge import JudgeRecord
from evals.types import Completion, Item, Outcome, suite_metrics

if TYPE_CHECKING:  # torch and transformers load only when a job runs (records and compare import this module)
    from evals import reward_proxy
    from evals.generate import Loaded

ScorerName = Literal["math", "mcq", "constraints", "loops", "length_stop", "synthetic", "battle_margin",
                     "reward_proxy", "judge"]
# Scorers that read the model's answers (battle_margin reads its likelihoods instead).
_GENERATING = {"math", "mcq", "constraints", "loops", "length_stop", "synthetic", "reward_proxy", "judge"}


class OpenAIJudgeSpec(BaseModel):
    """A judge behind an OpenAI-compatible endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["openai"] = Field(description="Judge through the openai client.")
    base_url: str = Field(description="Endpoint base URL, e.g. http://host:8000/v1.")
    model: str = Field(description="Judge model name at the endpoint.")
    api_key_env: str = Field(description="Environment variable holding the API key (never the key itself).")
    # Left out of the config's dump at its default, so eval jobs recorded before it keep their keys.
    policy: judge.JudgePolicy = Field(default_factory=judge.JudgePolicy, exclude_if=lambda v: v == judge.JudgePolicy(),
                                      description="Concurrency, retries with backoff, and the failure share a job "
                                      "tolerates.")


class CallableJudgeSpec(BaseModel):
    """A local judge function `(prompt, answer_a, answer_b) -> reply`, e.g. the toy world's oracle."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["callable"] = Field(description="Judge through an importable function.")
    target: str = Field(pattern=r"^[\w.]+:\w+$", description="'module:function' of the judge function.")


@dataclass(frozen=True)
class Scoring:
    """What the scorers read besides items and answers, built once per job from its config (`run`)."""

    decoding: Decoding  # battle_margin measures likelihoods at it; greedy replicates k >= 1 resample
    seed: int  # the job's base seed: replicate k samples, resamples and draws its judge's A/B key from seed + k
    output_dir: Path  # where completions and judgments files go
    math_timeout_s: float
    reward_model: reward_proxy.RewardModel | None
    judge: judge.Judge | None
    judge_policy: judge.JudgePolicy


@dataclass(frozen=True)
class Suite:
    """A suite as the job runs it: its spec and its items, read once."""

    spec: SuiteSpec
    items: list[Item]


@dataclass(frozen=True)
class Engine:
    """The loaded model and how it generates, built once per job from its config (`run`)."""

    loaded: Loaded
    batch_size: int
    static_cache: bool


# A suite scored on the reserve split's prompts instead of the dev holdout's is recorded under its name with this
# suffix (a lab's suite names cannot hold '@'): its own first looks, never mixed with the suite's dev looks.
RESERVE = "@reserve"


def reserve_suite(suite: str) -> str:
    """The name `suite`'s evals on the reserve split are recorded under."""
    return suite + RESERVE


class SuiteSpec(BaseModel):
    """One suite of a job: its items file and the scorer that reads it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[\w.-]+(@reserve)?$", description="Suite name (file-name safe), as recorded in the "
                      "notebook; `<suite>@reserve`: the suite on the reserve split's prompts.")
    scorer: ScorerName = Field(description="Which scorer (one per file in evals/) scores the suite.")
    items_path: Path = Field(description="JSONL file, one evals.types.Item per line.")
    sealed: bool = Field(False, description="Sealed confirmation suite: scored once per session, nominee only.")
    incumbent_completions: Path | None = Field(
        None, description="For judge suites: the incumbent's completions JSONL on the same items.")
    constraint_mode: constraints.Mode = Field(
        "plain", description="Constraints suites: plain-meaning rules, or 'ifeval' (IFEval reference semantics).")

    @model_validator(mode="after")
    def _judge_needs_incumbent(self) -> SuiteSpec:
        if (self.scorer == "judge") != (self.incumbent_completions is not None):
            raise ValueError(f"suite {self.name}: incumbent_completions is required for judge suites and only for them")
        if self.constraint_mode != "plain" and self.scorer != "constraints":
            raise ValueError(f"suite {self.name}: constraint_mode applies to constraints suites only")
        return self


class EvalJobConfig(BaseModel):
    """Everything one eval job needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    checkpoint: Path = Field(description="Checkpoint directory (weights, config, tokenizer).")
    decoding: Decoding = Field(description="The decoding to evaluate at (the candidate's served one to promote).")
    served: bool = Field(True, description="Whether `decoding` is the candidate's served decoding; if not, diagnostic only.")
    suites: tuple[SuiteSpec, ...] = Field(min_length=1, description="Suites to run on the one loaded model.")
    replicates: int = Field(1, ge=1, le=32, description="Replicates per suite (K >= 3 for a noise floor).")
    first_replicate: int = Field(0, ge=0, le=31, description="Index of the job's first replicate: replicates "
                                 "first_replicate .. first_replicate + replicates - 1 run, so a job can add new draws "
                                 "to replicates recorded by an earlier one (sampled decoding only).")
    seed: int = Field(0, ge=0, description="Base seed: sampling seed of replicate k is seed + k.")
    batch_size: int | None = Field(64, ge=1, description="Prompts generated together; None: chosen from the GPU's "
                                   "free memory once the model is loaded (64 on the CPU).")
    static_cache: bool = Field(False, description="The engine's static-KV-cache decode loop, each step one CUDA graph replay on GPU (attention-only models; see evals/generate.py).")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype.")
    output_dir: Path = Field(description="Directory for config, completions, judgments and result.")
    reward_model: Path | None = Field(None, description="Sequence-classification reward model for reward_proxy suites.")
    judge: OpenAIJudgeSpec | CallableJudgeSpec | None = Field(
        None, discriminator="kind", description="Judge for judge suites.")
    math_timeout_s: float = Field(10.0, gt=0, description="Per-item time bound of math verification.")

    @model_validator(mode="after")
    def _scorer_inputs(self) -> EvalJobConfig:
        scorers = {s.scorer for s in self.suites}
        if "reward_proxy" in scorers and self.reward_model is None:
            raise ValueError("reward_proxy suites need reward_model")
        if "judge" in scorers and self.judge is None:
            raise ValueError("judge suites need judge")
        if self.first_replicate and self.decoding.greedy:
            raise ValueError("greedy replicates k >= 1 resample replicate 0's items: run them in replicate 0's job")
        if (self.replicates > 1 or self.first_replicate) and any(s.sealed for s in self.suites):
            raise ValueError("sealed suites are scored once: run them in a job with replicates = 1")
        names = [s.name for s in self.suites]
        if len(set(names)) != len(names):
            raise ValueError(f"suite names repeat: {names}")
        return self


class SuiteResult(BaseModel):
    """One replicate of one suite."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    suite: str = Field(description="Suite name.")
    scorer: ScorerName = Field(description="Scorer used.")
    sealed: bool = Field(description="Whether the suite is a sealed confirmation suite.")
    replicate: int = Field(description="Replicate index k.")
    seed: int = Field(description="Sampling seed (or resample seed under greedy) of this replicate.")
    resampled: bool = Field(description="True if this replicate is a bootstrap resample of items (greedy).")
    metrics: dict[str, float] = Field(description="Suite metrics: means of per-item values, plus counts.")
    outcomes: list[Outcome] = Field(description="Per-item outcomes, in item order.")
    completions_path: str | None = Field(description="Completions JSONL (None for likelihood-only suites).")
    judge: JudgeRecord | None = Field(None, description="Judge seed, key hash and judgments file for judge suites.")


class EvalResult(BaseModel):
    """What the eval job returns (and writes as result.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    checkpoint: str = Field(description="Checkpoint evaluated.")
    decoding: Decoding = Field(description="Decoding used.")
    decoding_sha256: str = Field(description="Decoding fingerprint.")
    served: bool = Field(description="Whether the decoding is the candidate's served one.")
    suites: list[SuiteResult] = Field(description="One entry per suite and replicate.")
    generated_tokens: int = Field(description="Tokens generated over the whole job.")
    generation_s: float = Field(description="Seconds spent generating.")
    load_s: float = Field(description="Seconds spent loading the model (once per job).")
    placement: Placement | None = Field(None, description="Device, dtype, device name, ranks and generated tokens "
                                        "per second of the job (None: recorded before jobs said where they ran).")
    batch_size: int | None = Field(None, description="Prompts generated together (the configured or chosen size).")
    versions: Versions | None = Field(None, description="The versions of torch, transformers, peft, trl and mamba-ssm the job ran with (stamped by the job wrapper, tools/jobs/jobrun.py).")
    wall: Wall | None = Field(None, description="Start-up, work and write-out seconds of the job (core/wall.py; completed by the job wrapper, tools/jobs/jobrun.py).")


def read_items(path: Path) -> list[Item]:
    """Items of a JSONL file (read by core/jsonl.py); a bad line is reported with its file and line number."""
    items = []
    for lineno, value in read_values(path):
        try:
            items.append(Item.model_validate(value))
        except ValidationError as err:
            raise ValueError(f"{path}:{lineno}: not a valid eval item: {err}") from err
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids) or not items:
        raise ValueError(f"{path}: item ids must be unique and the file non-empty")
    return items


def write_jsonl(path: Path, records: list[BaseModel]) -> str:
    path.write_text("".join(r.model_dump_json() + "\n" for r in records))
    return str(path)


def read_completions(path: Path, items: list[Item]) -> list[Completion]:
    by_id = {}
    for lineno, value in read_values(path):
        try:
            comp = Completion.model_validate(value)
        except ValidationError as err:
            raise ValueError(f"{path}:{lineno}: not a completion record: {err}") from err
        by_id[comp.item_id] = comp
    missing = [item.id for item in items if item.id not in by_id]
    if missing:
        raise ValueError(f"{path}: no completion for items {missing[:5]}")
    return [by_id[item.id] for item in items]


def make_judge(spec: OpenAIJudgeSpec | CallableJudgeSpec) -> judge.Judge:
    if isinstance(spec, OpenAIJudgeSpec):
        if spec.api_key_env not in os.environ:
            raise ValueError(f"judge.api_key_env: environment variable {spec.api_key_env} is not set")
        return judge.OpenAIJudge(spec.base_url, spec.model, os.environ[spec.api_key_env])
    module, name = spec.target.split(":")
    return getattr(importlib.import_module(module), name)


def score(spec: SuiteSpec, items: list[Item], comps: list[Completion] | None, loaded: Loaded | None,
          scoring: Scoring | None, replicate: int = 0) -> tuple[list[Outcome], JudgeRecord | None]:
    """Dispatch to the suite's scorer (scorers differ in what besides items and answers they read)."""
    match spec.scorer:
        case "math":
            return math.score(items, comps, timeout_s=scoring.math_timeout_s), None
        case "constraints":
            return constraints.score(items, comps, mode=spec.constraint_mode), None
        case "mcq" | "loops" | "length_stop" | "synthetic":
            module = {"mcq": mcq, "loops": loops, "length_stop": length_stop, "synthetic": synthetic}
            return module[spec.scorer].score(items, comps), None
        case "battle_margin":
            from evals import battle_margin

            return battle_margin.score(items, battle_margin.measure(loaded, items, scoring.decoding)), None
        case "reward_proxy":
            from evals import reward_proxy

            return reward_proxy.score(items, comps, scoring.reward_model), None
        case "judge":
            incumbent = read_completions(spec.incumbent_completions, items)
            path = scoring.output_dir / f"judgments-{spec.name}-r{replicate}.jsonl"
            return judge.score(items, comps, incumbent, scoring.judge, seed=scoring.seed + replicate,
                               judgments_path=path, policy=scoring.judge_policy)


def resample(outcomes: list[Outcome], seed: int) -> list[Outcome]:
    """A bootstrap resample of items (with replacement), for greedy-decoding replicates."""
    rng = random.Random(seed)
    return [outcomes[rng.randrange(len(outcomes))] for _ in outcomes]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: rank `rank` of `world` (one model per GPU), from the torchrun variables the
    launcher's wrapper exports (tools/jobs/jobrun.py); a job of one process is rank 0 of 1."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Ranks:
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                   int(os.environ.get("LOCAL_RANK", "0")))

    def gather(self, mine: dict) -> dict:
        """Every rank's dict merged, on every rank (gloo: the completions are small Python objects)."""
        if self.world == 1:
            return mine
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        parts: list[dict] = [{} for _ in range(self.world)]
        dist.all_gather_object(parts, mine)
        return {k: v for part in parts for k, v in part.items()}


def generation_units(suites: list[Suite], replicates: range, greedy: bool) -> list[tuple[Suite, int]]:
    """(suite, replicate) pairs whose answers are generated (greedy replicates k >= 1 resample replicate 0's)."""
    return [(suite, k) for suite in suites if suite.spec.scorer in _GENERATING
            for k in replicates if k == 0 or not greedy]


def batch_plan(loaded: Loaded, items: list[Item], decoding: Decoding, batch_size: int) -> list[list[int]]:
    """The batches (item indices) one `generate` call forms: prompts sorted by rendered length, in order (as
    evals.generate.generate sorts them; tests/tools/test_job_resources.py holds a split run to one process's)."""
    from core.chat import render_prompt

    lengths = [len(render_prompt(loaded.tokenizer, item.messages, decoding.system_prompt or None)) for item in items]
    order = sorted(range(len(items)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def generate_all(units: list[tuple[Suite, int]], engine: Engine, decoding: Decoding, seed: int, ranks: Ranks,
                 stats: dict) -> dict[tuple[str, int], list[Completion]]:
    """Every generation unit's completions, the work shared by the job's ranks, identical to one process's.

    Greedy decoding: rank r takes batches r, r + world, ... of each unit's one-process batch plan (a batch's
    answers depend only on its own padded prompts). Sampled decoding: a unit's draws run through all of its batches
    from one seed, so whole units go round robin to the ranks (each `generate` call seeds itself)."""
    from evals.generate import generate

    mine: dict[tuple[str, int, int], list[Completion]] = {}
    for u, (suite, k) in enumerate(units):
        items = suite.items
        if decoding.greedy and ranks.world > 1:
            plan = batch_plan(engine.loaded, items, decoding, engine.batch_size)
            parts = [(b, [items[i] for i in batch]) for b, batch in enumerate(plan) if b % ranks.world == ranks.rank]
        else:
            parts = [(0, items)] if u % ranks.world == ranks.rank else []
        for b, part in parts:
            start = time.perf_counter()
            comps = generate(engine.loaded, part, decoding, seed=seed + k, batch_size=engine.batch_size,
                             static_cache=engine.static_cache)
            stats["generation_s"] += time.perf_counter() - start
            stats["generated_tokens"] += sum(c.n_tokens for c in comps)
            mine[(suite.spec.name, k, b)] = comps
    gathered = ranks.gather(mine)
    if ranks.world > 1:  # the job's log says how the work was shared
        print(f"rank {ranks.rank} of {ranks.world}: generated {sum(len(c) for c in mine.values())} answers",
              file=sys.stderr, flush=True)
        stats["generated_tokens"] = sum(ranks.gather({ranks.rank: stats["generated_tokens"]}).values())
    return _in_item_order(units, gathered)


def _in_item_order(units: list[tuple[Suite, int]],
                   parts: dict[tuple[str, int, int], list[Completion]]) -> dict[tuple[str, int], list[Completion]]:
    out = {}
    for suite, k in units:
        name = suite.spec.name
        by_id = {c.item_id: c for (n, kk, _), comps in parts.items() if (n, kk) == (name, k) for c in comps}
        out[(name, k)] = [by_id[item.id] for item in suite.items]
    return out


def run_suite(suite: Suite, replicates: range, loaded: Loaded, scoring: Scoring,
              generated: dict[tuple[str, int], list[Completion]]) -> list[SuiteResult]:
    spec, items = suite.spec, suite.items
    results: list[SuiteResult] = []
    base: list[Outcome] = []
    for k in replicates:
        seed = scoring.seed + k
        if k > 0 and scoring.decoding.greedy:
            outs = resample(base, seed)
            results.append(SuiteResult(suite=spec.name, scorer=spec.scorer, sealed=spec.sealed, replicate=k,
                                       seed=seed, resampled=True, metrics=suite_metrics(outs), outcomes=outs,
                                       completions_path=results[0].completions_path))
            continue
        comps, path = generated.get((spec.name, k)), None
        if comps is not None:
            path = write_jsonl(scoring.output_dir / f"completions-{spec.name}-r{k}.jsonl", comps)
        outs, record = score(spec, items, comps, loaded, scoring, replicate=k)
        base = outs
        results.append(SuiteResult(suite=spec.name, scorer=spec.scorer, sealed=spec.sealed, replicate=k, seed=seed,
                                   resampled=False, metrics=suite_metrics(outs), outcomes=outs,
                                   completions_path=path, judge=record))
    return results


def choose_batch_size(batch_size: int | None, max_new_tokens: int, loaded: Loaded) -> int:
    """The configured batch size, else one from the GPU's free memory after loading (64 on the CPU).

    Each row holds its KV cache for the longest prompt plus max_new_tokens and a float32 row of logits; half the
    free memory goes to them (the rest to activations and the allocator), rounded down to a power of two so that
    ranks with the same GPUs choose the same size, at most MAX_AUTO_BATCH."""
    if batch_size is not None:
        return batch_size
    if loaded.device.type != "cuda":
        return 64
    import torch

    free, _ = torch.cuda.mem_get_info(loaded.device)
    c = loaded.model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    width = AUTO_BATCH_CONTEXT + max_new_tokens
    per_row = 2 * c.num_hidden_layers * heads * head_dim * loaded.model.dtype.itemsize * width + 4 * c.vocab_size
    fit = max(1, int(free / 2 // per_row))
    return min(MAX_AUTO_BATCH, 1 << (fit.bit_length() - 1))


AUTO_BATCH_CONTEXT = 1024  # prompt tokens a row is sized for when the batch is chosen from memory
MAX_AUTO_BATCH = 512


def run(cfg: EvalJobConfig) -> EvalResult:
    """Load the checkpoint once, run every suite and replicate on it, write and return the result.

    In a job of several ranks each loads the model on its own GPU and generates its share (generate_all); rank 0
    scores and writes everything and returns the result, the other ranks return None (the launcher reads a job's
    result from rank 0: tools/jobs/launcher.py). The config stops here: it becomes the engine, the suites (items
    read once) and the scoring, and the functions below take those."""
    laps = Laps()
    require_device(cfg.device)  # a GPU job on a host without one fails here, never quietly on the CPU
    ranks = Ranks.from_env()
    device = cfg.device
    if cfg.device == "cuda":
        import torch

        torch.cuda.init()
        # One model per GPU; modulo the GPUs this task sees (all of the node's, or only its own when bound).
        device = f"cuda:{ranks.local_rank % torch.cuda.device_count()}" if ranks.world > 1 else device
    laps.startup("cuda_init")
    if ranks.rank == 0:
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        (cfg.output_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    start = time.perf_counter()
    from evals import reward_proxy
    from evals.generate import load

    loaded = load(cfg.checkpoint, device=device, dtype=cfg.dtype)
    load_s = time.perf_counter() - start
    engine = Engine(loaded, choose_batch_size(cfg.batch_size, cfg.decoding.max_new_tokens, loaded), cfg.static_cache)
    main = ranks.rank == 0  # rank 0 scores: the reward model and the judge are its own
    scoring = Scoring(
        decoding=cfg.decoding, seed=cfg.seed, output_dir=cfg.output_dir, math_timeout_s=cfg.math_timeout_s,
        reward_model=reward_proxy.load(cfg.reward_model, device, cfg.dtype) if main and cfg.reward_model else None,
        judge=make_judge(cfg.judge) if main and cfg.judge is not None else None,
        judge_policy=cfg.judge.policy if isinstance(cfg.judge, OpenAIJudgeSpec) else judge.JudgePolicy(),
    )
    laps.startup("load")
    suites = [Suite(spec, read_items(spec.items_path)) for spec in cfg.suites]
    replicates = range(cfg.first_replicate, cfg.first_replicate + cfg.replicates)
    stats = {"generation_s": 0.0, "generated_tokens": 0}
    units = generation_units(suites, replicates, cfg.decoding.greedy)
    generated = generate_all(units, engine, cfg.decoding, cfg.seed, ranks, stats)
    if ranks.rank != 0:
        return typing.cast(EvalResult, None)
    results = [r for suite in suites for r in run_suite(suite, replicates, loaded, scoring, generated)]
    laps.work()
    placement = measured(device, cfg.dtype, stats["generated_tokens"], stats["generation_s"], devices=ranks.world)
    # The static decoders' warm-up and graph capture ran inside the generation: start-up, not work.
    capture_s = sum(d.capture_s for d in loaded.decoders.values())
    result = EvalResult(checkpoint=str(cfg.checkpoint), decoding=cfg.decoding,
                        decoding_sha256=cfg.decoding.fingerprint(), served=cfg.served, suites=results,
                        generated_tokens=stats["generated_tokens"], generation_s=stats["generation_s"], load_s=load_s,
                        placement=placement, batch_size=engine.batch_size,
                        wall=laps.wall().to_startup("compile", capture_s))
    (cfg.output_dir / "result.json").write_text(result.model_dump_json(indent=2))  # after the last lap: write-out
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m evals.job CONFIG.json`: run one eval job from its config file."""
    from core.entry import run_main
    from core.util import file_sha256

    def summary(cfg: EvalJobConfig, _: EvalResult) -> str:
        return json.dumps({"result": str(cfg.output_dir / "result.json"), "sha256": file_sha256(cfg.output_dir / "result.json")})

    return run_main("python -m evals.job", (EvalJobConfig, run), argv, bad_input=(ValueError, OSError), summary=summary)


if __name__ == "__main__":
    sys.exit(main())
