"""`[train]` against the model it trains and the lab's own data, before a session opens (issue 44, item 1).

lab.toml's loader (agent/config.py, trainers/recipe.py) checks what the file alone decides: ranges positive and
ordered, batch a multiple of micro-batch, LoRA target names well formed. What needs the parent and the data is
checked here, with the session's other inputs (agent/inputs.py runtime_problems), so a value that cannot train is
refused with exit 2 before anything is written or spent, never found by the first training job:

- LoRA targets the user wrote are matched against the parent's module and parameter names on the meta device
  (trainers/targets.py; no weights, no peft): no match, or a match peft cannot adapt (an embedding, a norm), is
  refused, listing what would match;
- a max_len that leaves no room for the answers of the lab's feedback: under the longest prompt plus ANSWER_ROOM
  tokens (that battle's row would keep almost no answer; at or under the prompt none, and the trainer refuses a job
  holding such a row: trainers/batch.py check_supervised), or under the length at which half of the battles' rows
  (the prompt and the longer answer) fit whole (most answers cut before their end of turn, the stop the model learns);
- a micro-batch larger than the lab's data (its feedback battles and [[data]] rows);
- a micro-batch or length whose memory estimate (trainers/memory.py, from shapes) exceeds one GPU: lab.toml's
  [executor] gpu_memory_gib, else the GPU this host shows (local executor); on a host without a GPU, where local
  jobs train on the CPU, this host's memory.

Values derived by the rules are not checked here: the launcher sizes them against the GPUs at admission.

    problems = train_problems(cfg, os.environ, "local", battle_tokens(cfg))     # [] when [train] can train
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from agent.config import LabConfig
from tools.data.datasets import DatasetError, read_chat_rows
from tools.data.feedback import load_feedback
from tools.jobs.executor import host_memory_gb, local_gpus
from trainers.recipe import FAMILIES, FamilyRecipe, TrainRecipe, rule_max_len

GIB = 1024**3
# Answer tokens a written max_len must leave after the lab's longest prompt. The prompt counts are the length check's
# (contents plus a guess of the template's tokens per message, no system prompt): a margin, not an exact fit.
ANSWER_ROOM = 16


def train_problems(cfg: LabConfig, env: Mapping[str, str], executor: str, battles: list[tuple[int, int]]) -> list[str]:
    """Every [train] value the parent or the data cannot take, each naming its key; [] when all can. `battles`: the
    (prompt, answer) tokens of each feedback battle (agent/inputs.py battle_tokens; [] when they cannot be counted)."""
    recipe = cfg.train_recipe()
    model = cfg.model.parent or cfg.model.base
    problems = _target_problems(cfg, recipe, model)
    rows = len(load_feedback(cfg.feedback.file).battles) + _data_rows(cfg)
    for family in FAMILIES:
        settings = recipe.families[family]
        for key, problem in _length_and_batch(settings, battles, rows):
            problems.append(f"{_where(settings, key)}: {problem}")
    if not problems:  # the estimate needs targets that match
        problems += _memory_problems(cfg, recipe, model, env, executor)
    return list(dict.fromkeys(problems))  # a [train] value inherited by every family: named once


def _where(settings: FamilyRecipe, key: str) -> str:
    """The lab.toml key a family's value came from: train.<family>.<key> or train.<key>."""
    source = settings.source.get(key, "")
    return f"train.{settings.family}.{key}" if source.endswith(f"[train.{settings.family}]") else f"train.{key}"


def _target_problems(cfg: LabConfig, recipe: TrainRecipe, model: Path) -> list[str]:
    from trainers.targets import model_names, target_problems  # torch: only a lab that names targets

    tables = [(f"train.{f}.lora", getattr(cfg.train, f).lora) for f in FAMILIES] + [("train.lora", cfg.train.lora)]
    written = [(where, t) for where, t in tables
               if t is not None and (t.target_modules is not None or t.target_parameters is not None)]
    if not written:
        return []
    names = model_names(model)
    problems = []
    for where, table in written:
        problems += target_problems(names, table.target_modules or [], table.target_parameters or [], where)
    return problems


def _data_rows(cfg: LabConfig) -> int:
    rows = 0
    for source in cfg.data:
        try:
            rows += len(read_chat_rows(source.path)) if source.kind != "verified" else 0
        except (DatasetError, OSError):
            continue  # refused by check_inputs with its own message
    return rows


def _length_and_batch(settings: FamilyRecipe, battles: list[tuple[int, int]], rows: int) -> list[tuple[str, str]]:
    out = []
    written = {k for k, v in settings.source.items() if v != "rule"}
    if "max_len" in written and settings.max_len is not None and battles:
        problem = _length_problem(settings.max_len, battles)
        if problem is not None:
            out.append(("max_len", problem))
    if "micro_batch" in written and rows:
        limit = rows if settings.batch_unit == "sequences" else rows * (settings.max_len or settings.context)
        if settings.micro_batch > limit:
            out.append(("micro_batch", f"{settings.micro_batch} {settings.batch_unit} per forward pass is more than "
                                       f"the lab's data holds ({rows} rows: feedback battles and [[data]] rows); "
                                       f"expected at most {limit}"))
    return out


def _length_problem(max_len: int, battles: list[tuple[int, int]]) -> str | None:
    """Why a written max_len leaves no room for the answers of the lab's feedback (module docstring); None when it
    does."""
    longest = max(prompt for prompt, _ in battles)
    if max_len < longest + ANSWER_ROOM:
        return (f"{max_len} tokens leaves no room for an answer: the longest prompt of the lab's feedback is {longest} "
                f"tokens; expected at least {longest + ANSWER_ROOM}, that prompt and {ANSWER_ROOM} answer tokens (a row "
                "cut within its prompt trains no answer, and the trainer refuses its job)")
    whole = sorted(prompt + answer for prompt, answer in battles)
    half = whole[(len(whole) - 1) // 2]  # the shortest max_len at which half of the rows fit whole
    if max_len < half:
        cut = sum(n > max_len for n in whole)
        return (f"{max_len} tokens cuts the answer of {cut} of the lab's {len(whole)} feedback battles (the prompt and "
                f"the longer answer) before its end; expected at least {half}, the length at which half of them fit "
                "whole (or leave max_len out: the rule fits 99% of a dataset's rows)")
    return None


def _memory_problems(cfg: LabConfig, recipe: TrainRecipe, model: Path, env: Mapping[str, str],
                     executor: str) -> list[str]:
    """Families whose written micro-batch or max_len cannot fit the memory a training job has, by the estimate: one
    GPU ([executor] gpu_memory_gib, else the local GPU nvidia-smi shows), and on a local host without a GPU, where
    jobs train on the CPU, this host's memory."""
    gpus = local_gpus(env) if executor == "local" else None
    limits = []
    gpu_gib = cfg.executor.gpu_memory_gib or (local_gpu_memory_gib() if gpus else None)
    if gpu_gib is not None:
        limits.append((gpu_gib, False, "one GPU"))
    if executor == "local" and not gpus:
        limits.append((host_memory_gb(), True, "this host's memory (no GPU: local jobs train on the CPU)"))
    over: dict[tuple, list[str]] = {}  # families over a limit by what they share: a value inherited is named once
    for family in FAMILIES:
        settings = recipe.families[family]
        written = [k for k in ("micro_batch", "max_len") if settings.source.get(k, "rule") != "rule"]
        for limit_gib, on_cpu, device in limits if written else []:
            need = _estimate_gib(settings, model, world=_train_world(cfg, gpus), on_cpu=on_cpu)
            if need > limit_gib:
                where = " and ".join(_where(settings, k) for k in written)
                key = (where, settings.micro_batch, _seq_len(settings), device, limit_gib)
                over.setdefault(key, []).append(f"{need:.1f} GiB ({family})")
    return [f"{where}: a step at micro_batch {micro} x {seq} tokens is estimated at {', '.join(needs)}, more than "
            f"{device} has ({limit_gib:.1f} GiB); expected a smaller micro_batch or max_len, or LoRA (trainers/memory.py)"
            for (where, micro, seq, device, limit_gib), needs in over.items()]


def _seq_len(settings: FamilyRecipe) -> int:
    return settings.max_len or rule_max_len(settings.context, None)


def _train_world(cfg: LabConfig, host_gpus: int | None) -> int:
    """Ranks a training job shards over: [executor.resources.train] gpus x nodes, else the host's or the node's."""
    train = cfg.executor.resources.train
    per_node = train.gpus or (host_gpus if host_gpus is not None else
                              cfg.executor.slurm.gpus_per_node if cfg.executor.slurm is not None else 1)
    return max(1, per_node * train.nodes)


def _estimate_gib(settings: FamilyRecipe, model: Path, world: int, on_cpu: bool) -> float:
    """The estimate (trainers/memory.py) for a family's written values, in GiB; float32 and no CUDA reserve on the
    CPU, bfloat16 on GPUs."""
    # torch: only for a lab that sets these values
    from trainers.common import ACTIVATION_CHECKPOINTING_ABOVE, LoRASettings
    from trainers.memory import estimate, model_shape

    lora = None
    if settings.method == "lora":
        a = settings.lora
        lora = LoRASettings(r=a.r, alpha=a.alpha, dropout=a.dropout, target_modules=a.target_modules,
                            target_parameters=a.target_parameters, train_lm_head=a.fp32_head)
    shape = model_shape(model, lora)
    micro = settings.micro_batch if settings.batch_unit == "sequences" else max(1, settings.micro_batch // _seq_len(settings))
    est = estimate(shape, world_size=1 if on_cpu else world, micro_batch_size=micro, seq_len=_seq_len(settings),
                   compute_bytes=4 if on_cpu else 2,
                   activation_checkpointing=shape.total_params > ACTIVATION_CHECKPOINTING_ABOVE,
                   loss_chunk_tokens=1024, kl=settings.family == "klce")
    return (est.total - (est.reserve if on_cpu else 0)) / GIB


def local_gpu_memory_gib() -> float | None:
    """One GPU's memory on this host, GiB (the smallest of them), from nvidia-smi; None when it cannot be asked."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [int(line) for line in out.split() if line.strip().isdigit()]
    return min(sizes) / 1024 if sizes else None  # MiB
