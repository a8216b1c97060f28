"""The world builder: a complete miniature lab, generated offline and deterministically from a seed.

    python run_agent.py world build [--lab DIR] [--seed N] [--size demo|test|gpu|gpu-test] [--template chatml|llama3|gemma]
                                    [--variant default|noisy-judge|small-holdout|harmful-arms|strong-parent|misleading-screens]

A variant (tools/world/variants.py) makes the world hard in one named way; `default` is the world itself.

What lands in the lab directory (every path relative to it):

    lab.toml                          an ordinary lab config (nothing in the agent special-cases the world)
    world/world.json                  the spec: seed, size, model sizes, oracle noise, opponent profile, cost factor
    world/tokenizer/                  BPE over whole characters (tools/world/tokenizer.py), with the special tokens
                                      and chat template of --template (ChatML by default; core/templates.py)
    world/models/base/                tiny Nemotron-H (Mamba2, attention, MoE, MLP) "pretrained" by trainers.sft
    world/models/parent/              the stage-1 chat parent: the base after a short SFT (deliberately mediocre)
    world/feedback/battles.jsonl      parent vs opponent battles voted by the noisy oracle (feedback format)
    world/suites/synthetic.jsonl      synthetic verified tasks (evals.synthetic ids and checker)
    world/suites/loops.jsonl          prompts for the loop and stop suites
    world/data/stage1_sft.jsonl       replay data: the parent's own stage-1 SFT conversations
    world/bars.toml                   default promotion bars
    world/serving/system_prompt.txt   the served system prompt
    world/manifest.json               sha256 of every file above; world/manifest.sha256 commits the build

Caching: a build is skipped when world/manifest.sha256 holds the sha256 of manifest.json, the manifest
was made for the same seed, size, template, variant and builder version, and every listed file still has its sha256. A
missing, partial or edited cache fails that check and is rebuilt from scratch in a staging directory,
then moved into place (manifest.sha256 last, so a killed build is never taken for a finished one). A
lab.toml that no world manifest vouches for belongs to a real lab and is never overwritten.

Prompt pools (suites, battles, stage-1 data, pretraining text) are drawn from seeds derived apart and
made disjoint under the agent's own leak audit (tools/world/tasks.py), so dataset builds on the world's
feedback pass their audits and the ground-truth sample (tools/world/truth.py) can be drawn fresh.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.chat import Message
from core.util import file_sha256, sha256_text, write_atomic, write_json_atomic
from tools.data.leak import DEFAULT_NGRAM, ReferenceIndex
from tools.world import cost, opponent, oracle, parts, tokenizer, variants
from tools.world.tasks import WORLD_FAMILIES, WorldTask, draw, draw_mix, hash_seed
from tools.world.variants import Variant, VariantName

Size = Literal["demo", "test", "gpu", "gpu-test"]
# The chat templates a world can be built on (`world build --template`); a session on it trains, evaluates
# and ships in that template.
WorldTemplate = Literal["chatml", "llama3", "gemma"]
WORLD_TEMPLATES: tuple[WorldTemplate, ...] = ("chatml", "llama3", "gemma")
# Bump whenever anything a build writes changes (lab.toml values too): an older cache is then rebuilt.
WORLD_VERSION = 9
WORLD_DIR = "world"
MANIFEST = "manifest.json"
COMMIT = "manifest.sha256"
SYSTEM_PROMPT = "You are a careful assistant. Work step by step and end with the final answer."
# Lab-relative paths of the world's parts: lab.toml names them, and truth.py audits against them.
BASE = "world/models/base"
PARENT = "world/models/parent"
TOKENIZER = "world/tokenizer"
FEEDBACK = "world/feedback/battles.jsonl"
SYNTHETIC_SUITE = "world/suites/synthetic.jsonl"
LOOPS_SUITE = "world/suites/loops.jsonl"
STAGE1_DATA = "world/data/stage1_sft.jsonl"
AUDITED_FILES = (("eval:synthetic", SYNTHETIC_SUITE), ("eval:loops", LOOPS_SUITE), ("data:stage1", STAGE1_DATA),
                 ("data:verified", parts.VERIFIED_POOL))
# Items of the verified pool ([[data]] kind = "verified"), per size preset.
VERIFIED_ITEMS = {"test": 32, "demo": 120, "gpu": 240, "gpu-test": 32}
# Prompts of the ground truth lab.toml's [truth] measures the nominee on, per size preset.
TRUTH_N = {"test": 40, "demo": 300, "gpu": 1000, "gpu-test": 40}
# Share of the feedback lab.toml holds out for selection (small-holdout cuts it to fit its cap).
DEV_FRACTION = 0.3
# Served sampling (lab.toml [serving.decoding]); max_new_tokens comes from the size preset.
TEMPERATURE = 0.7
TOP_P = 0.95
# Extra answer lines of a looping stage-1 answer: more than the served cap of 64 tokens holds after a worked
# answer, so a parent that learned to run on does not stop (and, when it repeats exactly, the loop scorer's
# tail of 4+ copies and 24+ word tokens is reached: 6 repeats of "Answer: 3" fell short of it).
LOOP_REPEATS = 12


class ModelDims(BaseModel):
    """A Nemotron-H's widths beyond its hidden size, for presets that state them (the GPU world's parent); the toy
    presets derive them from the hidden size (init_model)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    heads: int = Field(description="Attention heads.")
    kv_heads: int = Field(description="Key/value heads.")
    head_dim: int = Field(description="Attention head width.")
    intermediate: int = Field(description="MLP blocks' inner width.")
    mamba_heads: int = Field(description="Mamba-2 heads.")
    mamba_head_dim: int = Field(description="Mamba-2 head width.")
    ssm_state: int = Field(description="Mamba-2 state size.")
    n_groups: int = Field(description="Mamba-2 groups.")
    chunk: int = Field(description="Mamba-2 scan chunk.")
    experts_per_tok: int = Field(description="Routed experts a token goes to.")
    moe_intermediate: int = Field(description="A routed expert's inner width.")
    shared_intermediate: int = Field(description="The shared expert's inner width.")
    context: int = Field(description="max_position_embeddings.")


class SizeSpec(BaseModel):
    """How big a world is: pools, model and training lengths."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    battles: int = Field(description="Battle prompts drawn (battles with an empty parent answer are dropped).")
    synthetic_per_family: int = Field(description="Items per family in the synthetic verified suite.")
    loops_items: int = Field(description="Prompts of the loop/stop suites.")
    pretrain_rows: int = Field(description="Worked examples in the base model's pretraining text.")
    pretrain_steps: int = Field(description="Optimizer steps of pretraining.")
    sft_rows: int = Field(description="Stage-1 SFT conversations (also the replay data).")
    sft_steps: int = Field(description="Optimizer steps of stage-1 SFT (few: the parent must stay mediocre).")
    stage1_families: tuple[str, ...] = Field(
        WORLD_FAMILIES, description="Families the stage-1 SFT covers (the base saw all of them in pretraining).")
    stage1_loop_share: float = Field(
        0.0, description="Share of stage-1 answers that run on, repeating their answer line (the parent learns to loop).")
    stage1_worked: bool = Field(
        True, description="Stage-1 answers are the worked references; False: only their final answer line (a parent "
                          "that ends its turn within a short served cap).")
    batch_size: int = Field(description="Rows per optimizer step (both stages).")
    pretrain_lr: float = Field(description="Peak learning rate of pretraining.")
    sft_lr: float = Field(description="Peak learning rate of stage-1 SFT.")
    hidden: int = Field(description="Model hidden size.")
    layers: tuple[str, ...] = Field(description="Nemotron-H block types, in order.")
    experts: int = Field(description="Routed experts per MoE block.")
    vocab: int = Field(description="Tokenizer vocabulary size.")
    max_new_tokens: int = Field(description="Served cap on generated tokens.")
    # The fields below are written only when they differ from the toy presets', so the toy worlds' bytes never moved.
    lab: Literal["toy", "gpu"] = Field("toy", exclude_if=lambda v: v == "toy", description=(
        "toy: the CPU lab (full fine-tuning of the tiny model, simulated cost); gpu: a lab as a team's on one GPU "
        "(LoRA arms at the recipe defaults for the parent's shape, bf16, measured GPU-hours, gpu_memory_gib)."))
    dims: ModelDims | None = Field(None, exclude_if=lambda v: v is None,
                                   description="The parent's widths; None: derived from `hidden`.")
    build_max_len: int = Field(384, exclude_if=lambda v: v == 384,
                               description="Row token limit of the build's own training (pretraining, stage 1).")


# The GPU world's parent: 24 Nemotron-H blocks in the 30B-A3B's pattern of Mamba-2 and MoE blocks with attention
# every sixth, 332M parameters (201M in the routed experts, 181M active per token).
GPU_LAYERS = ("linear_attention", "moe", "linear_attention", "moe", "full_attention", "moe") * 4
GPU_DIMS = ModelDims(heads=16, kv_heads=4, head_dim=64, intermediate=4096, mamba_heads=32, mamba_head_dim=64,
                     ssm_state=128, n_groups=8, chunk=128, experts_per_tok=2, moe_intermediate=1024,
                     shared_intermediate=2048, context=4096)
# The same code at the test's size: the suite builds it on the CPU (tests/world/test_gpu_world.py).
GPU_TEST_DIMS = ModelDims(heads=4, kv_heads=2, head_dim=16, intermediate=128, mamba_heads=8, mamba_head_dim=16,
                          ssm_state=16, n_groups=2, chunk=16, experts_per_tok=2, moe_intermediate=64,
                          shared_intermediate=64, context=2048)


SIZES: dict[Size, SizeSpec] = {
    # Small enough for the test suite: quality does not matter there, only that every part is real.
    "test": SizeSpec(battles=64, synthetic_per_family=4, loops_items=16, pretrain_rows=200, pretrain_steps=100,
                     sft_rows=96, sft_steps=100, stage1_worked=False, batch_size=8, pretrain_lr=3e-3, sft_lr=3e-3, hidden=64,
                     layers=("linear_attention", "moe", "full_attention", "mlp"), experts=4, vocab=512,
                     max_new_tokens=32),
    # The stage-1 SFT leaves out string edits and the JSON and follow-up requests (a stage 1 that under-served
    # them), which the base saw only as plain text, and 30% of its answers run on (LOOP_REPEATS more answer
    # lines, past the served cap of 64 tokens): the parent often fails to stop and sometimes loops, and the
    # oracle's votes in the feedback show both weaknesses. Sized for a 2-core CPU: the build's CPU time is mostly the 450
    # pretraining steps, a session's mostly its eval jobs' generation (suites of 72 + 32 + 32 items).
    "demo": SizeSpec(battles=480, synthetic_per_family=12, loops_items=32, pretrain_rows=3000, pretrain_steps=450,
                     sft_rows=800, sft_steps=60, stage1_families=("letter_count", "word_count", "digit_sum",
                                                                  "long_division", "arithmetic_chain"),
                     stage1_loop_share=0.3, batch_size=8, pretrain_lr=4e-3, sft_lr=1e-3, hidden=128,
                     layers=("linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"),
                     experts=4, vocab=1024, max_new_tokens=64),
    # A parent of real size for one GPU (issue 39): the demo's tasks and stage 1 over bigger pools, pretrained and
    # trained to stage 1 by the project's trainers in bf16 on the GPU, in at most a few minutes on an H200.
    "gpu": SizeSpec(battles=960, synthetic_per_family=24, loops_items=48, pretrain_rows=6000, pretrain_steps=400,
                    sft_rows=1600, sft_steps=80, stage1_families=("letter_count", "word_count", "digit_sum",
                                                                 "long_division", "arithmetic_chain"),
                    stage1_loop_share=0.3, batch_size=32, pretrain_lr=6e-4, sft_lr=1e-4, hidden=1024,
                    layers=GPU_LAYERS, experts=8, vocab=1024, max_new_tokens=64, lab="gpu", dims=GPU_DIMS,
                    build_max_len=512),
    "gpu-test": SizeSpec(battles=64, synthetic_per_family=4, loops_items=16, pretrain_rows=200, pretrain_steps=60,
                         sft_rows=96, sft_steps=40, stage1_worked=False, batch_size=8, pretrain_lr=3e-3, sft_lr=3e-3,
                         hidden=64, layers=("linear_attention", "moe", "full_attention", "moe"), experts=4, vocab=512,
                         max_new_tokens=32, lab="gpu", dims=GPU_TEST_DIMS, build_max_len=512),
}


class WorldSpec(BaseModel):
    """world/world.json: what was built and with which settings (the truth command reads it)."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(description="Builder version; a cache built by another version is rebuilt.")
    seed: int = Field(description="The world seed.")
    size: Size = Field(description="Size preset.")
    template: WorldTemplate = Field("chatml", description="Chat-template family of the tokenizer and models.")
    variant: VariantName = Field("default", description="The world variant (tools/world/variants.py); written only "
                                                        "when not the default, so a default build's bytes never moved.")
    sizes: SizeSpec = Field(description="The preset's values (stage 1 as the variant trained the parent).")
    system_prompt: str = Field(description="Served system prompt.")
    oracle_noise: oracle.OracleNoise = Field(description="The judge's stated vote noise.")
    opponent_error_rate: dict[str, float] = Field(description="The opponent's chance of a wrong answer, per family.")
    gpuh_per_device_s: float = Field(description="Simulated GPU-hours per device-second (lab.toml [executor]).")
    battles_dropped: int = Field(description="Battles dropped because the parent's answer was empty.")
    votes: dict[str, int] = Field(description="Battles per vote.")
    params: int = Field(description="Parameters of the base model.")
    reward_model: dict[str, float] = Field(
        default_factory=dict, description="The reward model's fit (tools/world/parts.py): decisive battles, and its "
        "pairwise accuracy on them before and after training.")


class Manifest(BaseModel):
    """world/manifest.json: every file of the world with its sha256."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(description="Builder version.")
    seed: int = Field(description="The world seed.")
    size: Size = Field(description="Size preset.")
    template: WorldTemplate = Field("chatml", description="Chat-template family of the tokenizer and models.")
    variant: VariantName = Field("default", description="The world variant; written only when not the default.")
    files: dict[str, str] = Field(description="Lab-relative path -> sha256, for every file of the world.")


# ---- cache -------------------------------------------------------------------------------------------

def _dumped(model: BaseModel, **kwargs) -> str:
    """A manifest or world spec as JSON, without its variant when that is the default (a default build's bytes
    are those of the builds made before variants)."""
    return model.model_dump_json(exclude={"variant"} if model.variant == "default" else None, **kwargs)


def cached(lab: Path, seed: int, size: Size, template: WorldTemplate = "chatml",
           variant: VariantName = "default") -> Manifest | None:
    """The manifest of a complete, untouched world of this seed, size, template and variant in `lab`, else None."""
    world = lab / WORLD_DIR
    try:
        text = (world / MANIFEST).read_text(encoding="utf-8")
        committed = (world / COMMIT).read_text(encoding="utf-8").strip()
        manifest = Manifest.model_validate_json(text)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if committed != sha256_text(text) or ((manifest.version, manifest.seed, manifest.size, manifest.template,
                                           manifest.variant) != (WORLD_VERSION, seed, size, template, variant)):
        return None
    for rel, digest in manifest.files.items():
        path = lab / rel
        if not path.is_file() or file_sha256(path) != digest:
            return None
    return manifest


class WorldError(ValueError):
    """A world cannot be built here; the message says why (exit 2)."""


STAGE_PREFIX = ".world-build-"
# Left in a lab by the run that holds it (tools/paths.py); not a user's file.
LOCK_NAME = "lab.lock"


def _built_manifest(lab: Path) -> Manifest | None:
    """world/manifest.json as a build wrote it, else None (missing, unreadable, or not a manifest)."""
    try:
        return Manifest.model_validate_json((lab / WORLD_DIR / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def check_target(lab: Path) -> None:
    """Refuse, with the reason, a build that would destroy a user's files: a directory of other files
    (a build replaces `world/` and lab.toml), a lab.toml no build wrote or one edited since, and a lab
    whose notebook holds sessions (their replay and resume read this world's files)."""
    if os.path.lexists(lab) and not lab.is_dir():
        raise WorldError(f"{lab}: not a directory")
    if not lab.is_dir():
        return
    toml, manifest = lab / "lab.toml", _built_manifest(lab)
    if not os.path.lexists(toml):
        others = sorted(p.name for p in lab.iterdir() if not p.name.startswith(STAGE_PREFIX) and p.name != LOCK_NAME
                        and not (p.name == WORLD_DIR and manifest is not None))
        if others:
            raise WorldError(f"{lab}: holds other files ({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}) "
                             "and no lab.toml; refusing to build a toy world over them (build into a new or empty "
                             "directory)")
        return
    if manifest is None:
        raise WorldError(f"{toml}: this lab.toml was not written by a world build (no readable {WORLD_DIR}/{MANIFEST}"
                         "); refusing to overwrite a real lab's config")
    if manifest.files.get("lab.toml") != file_sha256(toml):
        raise WorldError(f"{toml}: edited since the world build wrote it; refusing to overwrite it (move it away to "
                         "rebuild, or keep it and use a lab directory of its own)")
    if os.path.lexists(lab / "notebook.db"):
        raise WorldError(f"{lab / 'notebook.db'}: this lab holds a notebook whose sessions read this world's files; "
                         "refusing to rebuild the world under them (build into a new --lab directory)")


def check_build(lab: Path, seed: int, size: Size, template: WorldTemplate = "chatml",
                variant: VariantName = "default") -> None:
    """What `build` refuses, checked before anything is written (even the lab's lock): an intact cache of
    this world is always fine; anything else needs a target `check_target` accepts."""
    if cached(lab, seed, size, template, variant) is None:
        check_target(lab)


def _clean_stale_stages(lab: Path) -> None:
    """Remove the staging directories of builds whose process is gone (killed mid-build); a live build's
    is left alone (its pid is in the name)."""
    for stage in lab.glob(f"{STAGE_PREFIX}*"):
        pid = stage.name.removeprefix(STAGE_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(stage, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


# ---- pools -------------------------------------------------------------------------------------------

class Pools(BaseModel):
    """The world's prompt pools, mutually disjoint under the leak audit."""

    model_config = ConfigDict(extra="forbid")
    synthetic: list[WorldTask] = Field(description="Synthetic verified suite tasks.")
    loops: list[WorldTask] = Field(description="Loop/stop suite prompts.")
    battles: list[WorldTask] = Field(description="Battle prompts.")
    stage1: list[WorldTask] = Field(description="Stage-1 SFT conversations.")
    pretrain: list[WorldTask] = Field(description="Pretraining worked examples.")


def draw_pools(seed: int, spec: SizeSpec) -> Pools:
    index = ReferenceIndex([], DEFAULT_NGRAM)
    synthetic = [t for f in WORLD_FAMILIES[:6]
                 for t in draw(f, spec.synthetic_per_family, hash_seed(seed, "synthetic", f), index, "synthetic")]
    return Pools(
        synthetic=synthetic,
        loops=draw_mix(spec.loops_items, hash_seed(seed, "loops"), index, "loops"),
        battles=draw_mix(spec.battles, hash_seed(seed, "battles"), index, "battles"),
        stage1=draw_mix(spec.sft_rows, hash_seed(seed, "stage1"), index, "stage1", spec.stage1_families),
        pretrain=draw_mix(spec.pretrain_rows, hash_seed(seed, "pretrain"), index, "pretrain"),
    )


def _document(task: WorldTask) -> str:
    """A pretraining document: the conversation as plain text (questions and worked answers)."""
    return "\n".join(m.content for m in [*task.messages, Message(role="assistant", content=task.reference)])


def _jsonl(path: Path, rows: list[dict]) -> None:
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows))


def _conversation(task: WorldTask, loop_share: float = 0.0, worked: bool = True) -> list[dict]:
    """The task answered by its reference (`worked`) or by the reference's final line alone; for a
    `loop_share` of tasks (chosen by id hash) the answer runs on, repeating its final line, as a sloppy
    stage-1 data set would (the oracle and the loop suite see it)."""
    answer = task.reference if worked else task.reference.splitlines()[-1]
    if int(sha256_text(task.id)[:8], 16) / 16**8 < loop_share:
        answer += f"\nAnswer: {task.gold}" * LOOP_REPEATS
    return [m.model_dump() for m in task.messages] + [{"role": "assistant", "content": answer}]


# ---- models ------------------------------------------------------------------------------------------

def init_model(tokenizer_dir: Path, out: Path, spec: SizeSpec, seed: int) -> int:
    """A randomly initialised Nemotron-H of the preset's size, saved with its tokenizer; returns its parameter count."""
    import torch
    from transformers import GenerationConfig, NemotronHConfig, NemotronHForCausalLM, PreTrainedTokenizerFast

    from core.chat import stop_ids
    from core.tiny import special_ids

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    ids = special_ids(tok)  # pad, the template's end of turn (EOS) and BOS: derived, never named here
    config = NemotronHConfig(vocab_size=len(tok), hidden_size=spec.hidden, layers_block_type=list(spec.layers),
                             n_routed_experts=spec.experts, tie_word_embeddings=False, **widths(spec), **ids)
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=stop_ids(tok), pad_token_id=ids["pad_token_id"],
                                               do_sample=False)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def widths(spec: SizeSpec) -> dict[str, int]:
    """NemotronHConfig's widths: the preset's own, else the toy presets' rule from the hidden size."""
    d = spec.dims
    if d is None:
        h = spec.hidden
        return dict(num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4, intermediate_size=2 * h,
                    mamba_num_heads=8, mamba_head_dim=h // 4, ssm_state_size=16, n_groups=2, chunk_size=16,
                    num_experts_per_tok=2, moe_intermediate_size=h, moe_shared_expert_intermediate_size=h,
                    max_position_embeddings=2048)
    return dict(num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, head_dim=d.head_dim,
                intermediate_size=d.intermediate, mamba_num_heads=d.mamba_heads, mamba_head_dim=d.mamba_head_dim,
                ssm_state_size=d.ssm_state, n_groups=d.n_groups, chunk_size=d.chunk, num_experts_per_tok=d.experts_per_tok,
                moe_intermediate_size=d.moe_intermediate, moe_shared_expert_intermediate_size=d.shared_intermediate,
                max_position_embeddings=d.context)


def sft(model: Path, data: Path, run_dir: Path, out: Path, steps: int, lr: float, spec: SizeSpec,
        system_prompt: str | None, seed: int) -> None:
    """One run of the project's SFT trainer; the trained weights are moved to `out`."""
    from trainers.sft import SFTConfig, train

    config = SFTConfig(model_path=model, data_path=data, output_dir=run_dir, system_prompt=system_prompt, lr=lr,
                       steps=steps, batch_size=spec.batch_size, micro_batch_size=spec.batch_size,
                       max_len=spec.build_max_len,
                       warmup_steps=max(1, steps // 10), seed=seed, log_every=max(1, steps // 5))
    result = train(config)
    shutil.move(str(result.model_dir), out)


# ---- battles -----------------------------------------------------------------------------------------

def served_decoding(tokenizer_dir: Path, spec: SizeSpec):
    """The world's served decoding (the same values lab.toml's [serving] declares)."""
    from core import loading
    from core.chat import stop_ids
    from evals.decoding import Decoding

    tok = loading.load_tokenizer(tokenizer_dir)
    stops = tuple(stop_ids(tok))  # derived from the chat template and the tokenizer (core.chat)
    return Decoding(system_prompt=SYSTEM_PROMPT, temperature=TEMPERATURE, top_p=TOP_P, repetition_penalty=1.0,
                    max_new_tokens=spec.max_new_tokens, stop_token_ids=stops)


# The default world's voters: the oracle's stated noise.
STATED_NOISE = oracle.OracleNoise()
_VOTE = {"A": "own", "B": "other", "tie": "tie", "both_bad": "both_bad"}


def vote(prompt: str, own: str, other: str, own_first: bool, noise: oracle.OracleNoise = STATED_NOISE) -> str:
    """The noisy oracle's vote on one battle (at the voters' `noise`), mapped from positions to own/other."""
    from evals.judge import parse_verdict

    a, b = (own, other) if own_first else (other, own)
    verdict = parse_verdict(oracle.judge_with(prompt, a, b, noise))
    if verdict in ("A", "B") and not own_first:
        verdict = "B" if verdict == "A" else "A"
    return _VOTE[verdict]


def battles(parent: Path, tasks: list[WorldTask], decoding, seed: int,
            noise: oracle.OracleNoise = STATED_NOISE) -> tuple[list[dict], int]:
    """Parent vs opponent on every battle prompt, voted by the oracle at the voters' `noise`; battles with an
    empty parent answer are dropped (the feedback format requires both answers) and counted."""
    from evals.generate import generate, load
    from trainers.common import device

    where = device()
    loaded = load(parent, device=str(where), dtype="bfloat16" if where.type == "cuda" else "float32")
    on_gpu = where.type == "cuda"
    answers = generate(loaded, [t.item("battle") for t in tasks], decoding, seed=seed,
                       batch_size=512 if on_gpu else 64, static_cache=on_gpu)
    return voted_battles(tasks, [a.text for a in answers], seed, noise)


def voted_battles(tasks: list[WorldTask], own: list[str], seed: int,
                  noise: oracle.OracleNoise = STATED_NOISE) -> tuple[list[dict], int]:
    """The feedback rows of `own` answers (the parent's) against the opponent's, voted by the oracle: the part of
    `battles` that needs no model (a test ingests the feedback of many seeds without training their parents)."""
    from evals.judge import judged_prompt

    rng = random.Random(seed)
    rows, dropped = [], 0
    for task, text in zip(tasks, own, strict=True):
        own_first = rng.random() < 0.5
        if not text.strip():
            dropped += 1
            continue
        prompt = judged_prompt(task.item("battle"))
        other = opponent.answer(prompt)
        rows.append({"id": f"b-{task.id.replace('/', '-')}", "messages": [m.model_dump() for m in task.messages],
                     "own": text, "other": other, "vote": vote(prompt, text, other, own_first, noise),
                     "meta": {"family": task.family, "turns": sum(m.role == "user" for m in task.messages)}})
    return rows, dropped


# ---- config files ------------------------------------------------------------------------------------

BARS = """# Default promotion bars of the toy world (registered before any candidate is scored).
# p_family: the comparisons the full playbook makes (agent.planners.playbook.PlaybookSettings().comparisons());
# a larger family only raises every p bar (Holm counts the untested rest as p = 1).
p_family = 10
# The bars without a p-value read each side's mean over 3 served draws (the incumbent's K = 3 calibration; the
# candidate's replicates 1-2 are drawn before its comparison): one draw against one draw rejects a truly equal
# candidate at a one-floor guard about one time in five.
replicates = 3
# The sequential rule (evals/bars.py): the holdout's p bar may be read at up to 3 looks, look j on the mean of the
# candidate's served draws 0 .. j-1; p* = min p_j / w_j, w = the spending t**0.5 (0.58, 0.24, 0.18 of the alpha); a
# look may continue while its raw p <= 0.25. A guard the judge contradicts beyond chance holds at 3x its margin
# until a person clears its suite.
looks = 3
look_spending = 0.5
continue_p = 0.25
audit_margin = 3.0

[[bar]]
suite = "holdout"
metric = "win_score"
rule = "p <= 0.05"
test = "paired_t"

[[bar]]
suite = "synthetic"
metric = "correct"
rule = "delta >= -1.0 * noise_floor"

[[bar]]
suite = "loops"
metric = "looping"
rule = "delta <= 1.0 * noise_floor"

[[bar]]
suite = "stop"
metric = "stopped"
rule = "delta >= -1.0 * noise_floor"
"""


def lab_toml(seed: int, size: Size, spec: SizeSpec, stage1_rows: int) -> str:
    return f"""# The toy world (seed {seed}, size {size}), written by `python run_agent.py world build`.
# An ordinary lab: nothing in the agent special-cases it. Its ground truth ([truth] below) is measured
# for the nominee after the sealed confirmation, for the card and the report, and is never shown to the
# agent; `python run_agent.py world truth CHECKPOINT` measures any checkpoint.
bars = "world/bars.toml"

[model]
base = "{BASE}"
parent = "{PARENT}"
tokenizer = "{TOKENIZER}"
# The world's models are built here, from nothing downloaded: they carry the project's license.
license = "apache-2.0"

[truth]
kind = "world"
n = {TRUTH_N[size]}

[feedback]
file = "{FEEDBACK}"
dev_fraction = {DEV_FRACTION}
sealed_fraction = 0.1
stratify_by = "family"

[[data]]
name = "stage1"
path = "{STAGE1_DATA}"
cap = {stage1_rows}

# The lab's own verified items (RFT on them, leak-audited; the synthetic suite's scorer verifies them).
[[data]]
name = "verified"
kind = "verified"
path = "{parts.VERIFIED_POOL}"
verifier = "synthetic"

[[evals]]
name = "synthetic"
scorer = "synthetic"
file = "{SYNTHETIC_SUITE}"

[[evals]]
name = "loops"
scorer = "loops"
file = "{LOOPS_SUITE}"

[[evals]]
name = "stop"
scorer = "length_stop"
file = "{LOOPS_SUITE}"

[[evals]]
name = "holdout"
scorer = "judge"

[[evals]]
name = "confirm"
scorer = "judge"
sealed = true

[executor]
kind = "local"
time_limit_min = 30
# Simulated cost: GPU-hours charged per measured device-second of a toy job (tools/world/cost.py).
simulated_gpuh_per_device_s = {cost.GPUH_PER_DEVICE_S}

[budget]
# The nomination's jobs (bundle, sealed confirmation) run on this share alone (sized in tools/world/cost.py).
reserve_fraction = {cost.RESERVE_FRACTION}

[planner]
kind = "playbook"

[judge]
# The oracle (tools/world/oracle.py): prefers correct, clean, stopped answers, with stated noise.
kind = "oracle"
# The world's reward model, trained on these battles, scores the judge suites instead (a reward-proxy win rate
# against the parent's recorded answers; bars then name reward_proxy metrics, win and margin) with:
#   kind = "reward_model"
#   path = "{parts.REWARD_MODEL}"
# and the model's own log-probability preference on the dev battles is one more suite with:
#   [[evals]]
#   name = "margin"
#   scorer = "battle_margin"

[train]
# The toy world's own small settings, stated here because the rules a real model's defaults come from
# (trainers/recipe.py) are for real models: full fine-tuning of the tiny model, a linear decay to zero without
# warm-up, 30 steps of 8 sequences at 512 tokens. The playbook's arms choose lr, steps and batch within the ranges.
method = "full"
schedule = "linear"
warmup_ratio = 0.0
min_lr_ratio = 0.0
steps = 30
steps_range = [1, 1000]
batch_unit = "sequences"
batch = 8
batch_range = [1, 64]
micro_batch = 8
max_len = 512
weight_decay = 0.0
grad_clip = 1.0
lr = 1e-3
lr_range = [1e-5, 1e-2]

[train.sft]
packing = false

[train.dpo]
lr = 2e-4
beta = 0.1
nll_weight = 1.0

[train.klce]
kl_coef = 0.1

[train.rft]
k = 4
max_answer_len = 256
verifiers = ["synthetic"]

[serving]
system_prompt_file = "world/serving/system_prompt.txt"

[serving.decoding]
temperature = {TEMPERATURE}
top_p = {TOP_P}
repetition_penalty = 1.0
max_new_tokens = {spec.max_new_tokens}
"""


# The GPU world's [executor] and [budget]: real GPU-hours measured on the GPU the jobs hold (no simulated cost),
# training admitted against one H200's memory, every model job in bf16, a time limit a one-GPU session can spend.
GPU_EXECUTOR = """[executor]
kind = "local"
time_limit_min = 10
# One H200 (139 GiB): a training job whose estimate per GPU is larger is refused before launch.
gpu_memory_gib = 139
# Eval, reference, truth and bundle jobs generate in bf16 on the GPU (training computes in bf16 there too).
gpu_dtype = "bfloat16"

[budget]
# The nomination's jobs (bundle, sealed confirmation) run on this share alone.
reserve_fraction = 0.15
"""
# Steps and lengths of the GPU world's arms: what a one-GPU session has time for, at lengths a GPU wants (the
# world's rows are short: 512 tokens holds every one).
GPU_STEPS = 24
GPU_MAX_LEN = 512


def gpu_train_table(shape) -> str:
    """[train] of the GPU world: LoRA arms at the recipe's defaults for the parent's shape (trainers/recipe.py rules:
    learning rates by size, batch, micro-batch, adapter, schedule), stated in full, with the session's steps and
    lengths."""
    from trainers.recipe import TrainSection, resolve

    recipe = resolve(TrainSection(method="lora", steps=GPU_STEPS, max_len=GPU_MAX_LEN), shape, ["synthetic"])
    sft, dpo, klce, rft = (recipe.families[f] for f in ("sft", "dpo", "klce", "rft"))
    return f"""[train]
# LoRA arms at the recipe's defaults for this parent ({shape.params_total:,} parameters, \
{shape.params_active:,} active; trainers/recipe.py), stated in full; steps and lengths sized for one GPU.
method = "lora"
schedule = "{sft.schedule}"
warmup_ratio = {sft.warmup_ratio}
min_lr_ratio = {sft.min_lr_ratio}
steps = {GPU_STEPS}
steps_range = [1, 1000]
batch_unit = "{sft.batch_unit}"
batch = {sft.batch}
batch_range = [{sft.batch_range[0]}, {sft.batch_range[1]}]
micro_batch = {sft.micro_batch}
max_len = {GPU_MAX_LEN}
weight_decay = {sft.weight_decay}
grad_clip = {sft.grad_clip}
lr = {sft.lr:g}
lr_range = [{sft.lr_range[0]:g}, {sft.lr_range[1]:g}]

[train.lora]
r = {sft.lora.r}
alpha = {sft.lora.alpha:g}
dropout = {sft.lora.dropout:g}

[train.sft]
packing = false

[train.dpo]
lr = {dpo.lr:g}
lr_range = [{dpo.lr_range[0]:g}, {dpo.lr_range[1]:g}]
beta = {dpo.beta:g}
nll_weight = {dpo.nll_weight:g}

[train.klce]
kl_coef = {klce.kl_coef:g}

[train.rft]
k = {rft.k}
max_answer_len = 256
verifiers = ["synthetic"]
"""


def gpu_lab_toml(text: str, shape) -> str:
    """The toy lab.toml with the GPU world's [executor], [budget] and [train] in place of the toy's."""
    start, end = text.index("[executor]\n"), text.index("[planner]\n")
    text = text[:start] + GPU_EXECUTOR + "\n" + text[end:]
    start, end = text.index("[train]\n"), text.index("[serving]\n")
    return text[:start] + gpu_train_table(shape) + "\n" + text[end:]


def variant_lab_toml(text: str, v: Variant, n_battles: int) -> str:
    """The default lab.toml as variant `v` states it: the dev share it cuts and the reserve it holds (small-holdout),
    the learning rates it sets per family (harmful-arms), and a header line naming the variant."""
    if v.name == "default":
        return text
    text = _edited(text, "\nbars = ", f"\n# World variant: {v.name} (tools/world/variants.py).\nbars = ")
    share = variants.dev_fraction(v, n_battles, DEV_FRACTION)
    if share != DEV_FRACTION:
        text = _edited(text, f"dev_fraction = {DEV_FRACTION}\n", f"dev_fraction = {share}  # at most {v.max_dev_battles} "
                                                              "dev battles (small-holdout)\n")
    if v.reserve_fraction:
        text = _edited(text, "sealed_fraction = 0.1\n", f"sealed_fraction = 0.1\nreserve_fraction = {v.reserve_fraction}"
                       "  # more holdout prompts, drawn only for a comparison the dev holdout leaves unresolved\n")
    if not v.stratify_by_family:
        text = _edited(text, 'stratify_by = "family"\n', '# stratify_by = "family": not with votes this noisy (see '
                                                           'tools/world/variants.py)\n')
    for family, lr in sorted(v.train_lr.items()):
        head = f"[train.{family}]\n"
        old = re.search(rf"(?m)^\[train\.{family}\]\n(lr = .*\n)?", text)
        if old is None:
            raise ValueError(f"lab.toml has no [train.{family}] table for variant {v.name}")
        text = (text[:old.start()] + head + f"lr = {lr:g}  # too high: this family's arms hurt ({v.name})\n"
                f"lr_range = [1e-05, {lr:g}]\n" + text[old.end():])
    return text


def _edited(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise ValueError(f"lab.toml: expected one {old.strip()!r}, found {text.count(old)}")
    return text.replace(old, new)


# ---- the build ---------------------------------------------------------------------------------------

def _write_pools(world: Path, pools: Pools, spec: SizeSpec) -> None:
    root = world.parent
    _jsonl(root / SYNTHETIC_SUITE, [json.loads(t.item("synthetic").model_dump_json()) for t in pools.synthetic])
    _jsonl(root / LOOPS_SUITE, [json.loads(t.item("loops").model_dump_json()) for t in pools.loops])
    _jsonl(root / STAGE1_DATA, [{"id": f"stage1-{t.id.replace('/', '-')}",
                                 "messages": _conversation(t, spec.stage1_loop_share, spec.stage1_worked)}
                                for t in pools.stage1])


def _pretrain_row(task: WorldTask, template: WorldTemplate) -> dict:
    """A pretraining document as an assistant turn. Templates that require conversations to open with a user
    turn (Gemma's raises otherwise) get an empty one first; ChatML keeps the lone turn its worlds were built with."""
    opening = [] if template == "chatml" else [{"role": "user", "content": ""}]
    return {"messages": [*opening, {"role": "assistant", "content": _document(task)}]}


def _train(world: Path, scratch: Path, pools: Pools, spec: SizeSpec, seed: int, template: WorldTemplate,
           reuse: Path | None = None, reuse_parent: bool = False) -> int:
    """Tokenizer, base (pretraining) and parent (stage-1 SFT); returns the parameter count. `reuse`: a finished
    default build of the same seed, size and template, whose tokenizer and base (and parent, `reuse_parent`) are
    copied rather than trained again: the same bytes, since every step is seeded and runs on one thread."""
    root = world.parent
    (world / "models").mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    if reuse is not None:
        shutil.copytree(reuse / TOKENIZER, root / TOKENIZER)
        shutil.copytree(reuse / BASE, root / BASE)
        params = load_spec(reuse).params
        if reuse_parent:
            shutil.copytree(reuse / PARENT, root / PARENT)
            return params
    else:
        params = _pretrain(root, scratch, pools, spec, seed, template)
    # Train from a scratch copy: the trainer may keep a token cache beside its data file, and the world's
    # files must be only the world's.
    stage1 = shutil.copy(root / STAGE1_DATA, scratch / "stage1.jsonl")
    sft(root / BASE, Path(stage1), scratch / "run-stage1", root / PARENT, spec.sft_steps, spec.sft_lr, spec, SYSTEM_PROMPT,
        hash_seed(seed, "stage1-run") % 2**31)
    return params


def _pretrain(root: Path, scratch: Path, pools: Pools, spec: SizeSpec, seed: int, template: WorldTemplate) -> int:
    """The tokenizer and the base model; returns the parameter count."""
    docs = [_document(t) for t in pools.pretrain + pools.stage1] + [SYSTEM_PROMPT]
    tok_dir = tokenizer.build(root / TOKENIZER, corpus=docs, vocab_size=spec.vocab, template=template)
    params = init_model(tok_dir, scratch / "init", spec, hash_seed(seed, "init") % 2**31)
    pretrain = scratch / "pretrain.jsonl"
    _jsonl(pretrain, [_pretrain_row(t, template) for t in pools.pretrain])
    sft(scratch / "init", pretrain, scratch / "run-pretrain", root / BASE, spec.pretrain_steps,
        spec.pretrain_lr, spec, None, hash_seed(seed, "pretrain-run") % 2**31)
    return params


def _parent_labels(stage: Path, tasks: list[WorldTask], decoding, seed: int) -> None:
    """misleading-screens: the verified suite rewritten with the parent's own answers at greedy decoding (its most
    likely answer) as the expected ones, the gold where the checker can read none in it."""
    from evals.generate import generate, load
    from evals.synthetic import extract, family_of
    from trainers.common import device

    items = [t.item("synthetic") for t in tasks]
    greedy = decoding.model_copy(update={"temperature": 0.0, "top_p": 1.0})
    answers = generate(load(stage / PARENT, device=str(device())), items, greedy, seed=seed)
    rows = []
    for item, answer in zip(items, answers, strict=True):
        given = extract(family_of(item.id), answer.text)
        rows.append(json.loads(item.model_copy(update={"gold": given if given else item.gold}).model_dump_json()))
    _jsonl(stage / SYNTHETIC_SUITE, rows)


def variant_sizes(v: Variant, spec: SizeSpec) -> SizeSpec:
    """The preset's values as this variant trains its parent (the pools are always the preset's)."""
    if v.stage1_steps_factor == 1 and not v.stage1_clean:
        return spec
    update: dict = {"sft_steps": spec.sft_steps * v.stage1_steps_factor}
    if v.stage1_clean:
        update |= {"stage1_worked": True, "stage1_loop_share": 0.0}
    return spec.model_copy(update=update)


def _build_into(stage: Path, seed: int, size: Size, template: WorldTemplate, v: Variant,
                reuse: Path | None = None) -> None:
    pools = draw_pools(seed, SIZES[size])  # a variant's pools are its seed's default pools
    spec = variant_sizes(v, SIZES[size])
    world = stage / WORLD_DIR
    _write_pools(world, pools, spec)
    params = _train(world, stage / "scratch", pools, spec, seed, template, reuse, not variants.changes_parent(v))
    decoding = served_decoding(stage / TOKENIZER, spec)
    if v.screen_labels == "parent":
        _parent_labels(stage, pools.synthetic, decoding, hash_seed(seed, "screen-labels") % 2**31)
    same_feedback = reuse is not None and not variants.changes_parent(v) and v.oracle_noise == STATED_NOISE
    rows, dropped, reward = (_feedback_of(reuse, stage) if same_feedback else
                             _feedback(stage, pools, decoding, seed, v.oracle_noise))
    taken = pools.synthetic + pools.loops + pools.battles + pools.stage1 + pools.pretrain
    # Ids as the synthetic suite's ("synthetic/<family>/<hash>"): its scorer, the pool's verifier, reads the family there.
    _jsonl(stage / parts.VERIFIED_POOL, [json.loads(t.item("synthetic").model_dump_json())
                                         for t in parts.verified_pool(seed, VERIFIED_ITEMS[size], taken)])
    write_atomic(world / "bars.toml", BARS)
    write_atomic(world / "serving" / "system_prompt.txt", SYSTEM_PROMPT + "\n")
    toml = lab_toml(seed, size, spec, len(pools.stage1))
    if spec.lab == "gpu":
        from trainers.recipe import model_shape

        toml = gpu_lab_toml(toml, model_shape(stage / PARENT))
    write_atomic(stage / "lab.toml", variant_lab_toml(toml, v, len(rows)))
    shutil.rmtree(stage / "scratch")
    votes = {name: sum(r["vote"] == name for r in rows) for name in ("own", "other", "tie", "both_bad")}
    info = WorldSpec(version=WORLD_VERSION, seed=seed, size=size, template=template, variant=v.name, sizes=spec,
                     system_prompt=SYSTEM_PROMPT, oracle_noise=v.oracle_noise, opponent_error_rate=dict(opponent.ERROR_RATE),
                     gpuh_per_device_s=cost.GPUH_PER_DEVICE_S if spec.lab == "toy" else 1 / 3600,
                     battles_dropped=dropped, votes=votes, params=params,
                     reward_model=reward)
    write_json_atomic(world / "world.json", json.loads(_dumped(info)))


def _feedback(stage: Path, pools: Pools, decoding, seed: int,
              noise: oracle.OracleNoise) -> tuple[list[dict], int, dict[str, float]]:
    """The battles voted at `noise`, written, and the reward model trained on them: (rows, dropped, its fit)."""
    rows, dropped = battles(stage / PARENT, pools.battles, decoding, hash_seed(seed, "battles-gen") % 2**31, noise)
    _jsonl(stage / FEEDBACK, rows)
    reward = parts.train_reward_model(stage / TOKENIZER, stage / parts.REWARD_MODEL, rows, hash_seed(seed, "reward"))
    return rows, dropped, reward


def _feedback_of(reuse: Path, stage: Path) -> tuple[list[dict], int, dict[str, float]]:
    """A variant with the default's parent and voters has the default's battles and reward model: copied from the
    default build `reuse` (what `_feedback` would make again, byte for byte)."""
    (stage / FEEDBACK).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(reuse / FEEDBACK, stage / FEEDBACK)
    shutil.copytree(reuse / parts.REWARD_MODEL, stage / parts.REWARD_MODEL)
    spec = load_spec(reuse)
    rows = [json.loads(line) for line in (stage / FEEDBACK).read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows, spec.battles_dropped, spec.reward_model


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread while building: the same float arithmetic (so the same bytes) whatever the core
    count, and on a shared 2-core machine two threads ran tiny models several times slower than one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# The trainer's cache of a checkpoint's weight hashes, keyed by file size and mtime: it differs between two
# builds of the same bytes, and the trainer re-checks it itself, so the manifest leaves it out.
UNHASHED = {"weights_manifest.json"}


def _files(root: Path) -> dict[str, str]:
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in UNHASHED)
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in paths}


def build(lab: Path, seed: int = 0, size: Size = "demo", template: WorldTemplate = "chatml",
          variant: VariantName = "default", reuse: Path | None = None) -> tuple[Manifest, bool]:
    """Builds the world (its `variant`, tools/world/variants.py) into `lab` on the `template` chat-template family
    unless an intact cache of it is there; returns (manifest, rebuilt). `reuse`: a lab holding the finished default
    build of the same seed, size and template, whose trained parts the variant shares are copied from it (the
    benchmark builds five variants of one seed at the cost of about one)."""
    v = variants.variant(variant)
    if lab.is_dir():
        _clean_stale_stages(lab)
    found = cached(lab, seed, size, template, v.name)
    if found is not None:
        return found, False
    if reuse is not None and cached(reuse, seed, size, template) is None:
        raise WorldError(f"{reuse}: not a finished default world of seed {seed}, size {size}, template {template}")
    check_target(lab)
    lab.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=lab))
    try:
        with one_thread():
            _build_into(stage, seed, size, template, v, reuse)
        manifest = Manifest(version=WORLD_VERSION, seed=seed, size=size, template=template, variant=v.name,
                            files=_files(stage))
        text = _dumped(manifest, indent=2) + "\n"
        write_atomic(stage / WORLD_DIR / MANIFEST, text)
        _swap_in(stage, lab)
        write_atomic(lab / WORLD_DIR / COMMIT, sha256_text(text) + "\n")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return manifest, True


def _swap_in(stage: Path, lab: Path) -> None:
    """Replace the lab's world and lab.toml by the staged ones (the commit file is written after)."""
    shutil.rmtree(lab / WORLD_DIR, ignore_errors=True)
    (lab / "lab.toml").unlink(missing_ok=True)
    (stage / WORLD_DIR).rename(lab / WORLD_DIR)
    (stage / "lab.toml").rename(lab / "lab.toml")


def load_spec(lab: Path) -> WorldSpec:
    """world/world.json of a built world."""
    path = lab / WORLD_DIR / "world.json"
    if not path.is_file():
        raise WorldError(f"{path}: no toy world here (build one with `python run_agent.py world build --lab {lab}`)")
    return WorldSpec.model_validate_json(path.read_text(encoding="utf-8"))
