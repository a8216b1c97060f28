"""Resume state through `torch.distributed.checkpoint` (DCP), and the consolidated final model.

Resume state (`<run>/resume/`) is one DCP checkpoint of the trainable model weights and the AdamW state, keyed
by parameter name (so it reloads onto another number of ranks: DCP reshards), plus one `rank<r>.pt` per rank
with the scheduler, the loop counters (the data position is the step: the data order is a seeded permutation)
and that rank's RNG states. A save writes `resume.tmp/` and swaps it in only when every rank has written, so a
kill mid-save keeps the previous state. On a different number of ranks the RNG states cannot map one to one:
each rank then reseeds from (seed, step, rank), which only matters for dropout.

Frozen weights are not saved (they are the base model); only parameters with requires_grad are.

The final model is consolidated to Hugging Face safetensors shards of at most `MAX_SHARD_SIZE` (loadable with
`from_pretrained`), or for LoRA a peft adapter directory, written by rank 0 with its weights manifest (each
file's sha256, size and mtime: `trainers.common.weights_sha256` then reads it instead of the files).

A snapshot (`<run>/snapshots/step-<n>/`, TrainConfig.snapshot_steps) is the same consolidated model at step n,
with `snapshot.json` (step, learning rate so far, loss), written beside and swapped in like resume state.
"""

from __future__ import annotations

import random
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from core.util import write_json_atomic
from trainers import distributed
from trainers.common import SAFETENSORS_DTYPES, write_weights_manifest

MAX_SHARD_SIZE = "2GB"  # per safetensors file of the consolidated model
SNAPSHOT_INFO = "snapshot.json"  # beside a snapshot's weights: its step, learning rate so far and loss
_TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
# Setting only trainable weights leaves the frozen ones "missing" to load_state_dict; dcp.load above already
# refused a checkpoint lacking any trainable key, so the set is not strict.
_SET_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


def _rank_file(root: Path, rank: int) -> Path:
    return root / f"rank{rank}.pt"


def save(resume_dir: Path, model, optimizer, extra: dict) -> None:
    """Collective: every rank calls it at the same step. `extra` (scheduler, loop counters) is per rank."""
    env = distributed.setup()
    tmp = resume_dir.with_name("resume.tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_ONLY)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.save({**extra, "world_size": env.world_size, "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
               _rank_file(tmp, env.rank))
    distributed.barrier()
    if env.is_main:
        _swap_in(tmp, resume_dir)
    distributed.barrier()


def _swap_in(tmp: Path, final: Path) -> None:
    """Replaces `final` by the complete `tmp`; the previous one is kept as `.old` meanwhile, so a kill at any point
    leaves a whole copy of one of them."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load(resume_dir: Path, model, optimizer, seed: int) -> dict:
    """Restores weights and optimizer (resharded to this job's ranks) and RNG; returns this rank's `extra`."""
    env = distributed.setup()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_ONLY)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=resume_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_SET_TRAINABLE)
    own = _rank_file(resume_dir, env.rank)
    blob = torch.load(own if own.is_file() else _rank_file(resume_dir, 0), weights_only=False)
    if blob["world_size"] == env.world_size:
        torch.set_rng_state(blob["torch_rng"])
        random.setstate(blob["python_rng"])
        if blob["cuda_rng"]:
            torch.cuda.set_rng_state_all(blob["cuda_rng"])
    else:
        step_seed = seed * 1_000_003 + blob["loop"]["step"] * 1_009 + env.rank
        torch.manual_seed(step_seed)
        random.seed(step_seed)
    return blob


def trainable_full_state(model) -> dict[str, torch.Tensor]:
    """Name -> full (unsharded) CPU tensor of every trainable parameter, on rank 0 (collective)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = full.detach().cpu()
    return out


@contextmanager
def _served_cache_settings(model):
    """Training turns the KV cache off (`use_cache = False` in the config and, through it, the generation config);
    a checkpoint saved that way decodes without a cache wherever it is loaded: the eval engine's `generate` path and
    any server re-run the whole prefix at every token (6.4x slower measured on the toy world's Nemotron-H arms).
    The saved files say `use_cache = true`; the live model goes back to training settings after the save."""
    configs = [c for c in (getattr(model, "config", None), getattr(model, "generation_config", None)) if c is not None]
    before = [getattr(c, "use_cache", None) for c in configs]
    for c in configs:
        c.use_cache = True
    try:
        yield
    finally:
        for c, value in zip(configs, before, strict=True):
            c.use_cache = value


def stored_dtype(model_dir: Path, default: torch.dtype) -> torch.dtype:
    """The floating dtype a checkpoint's weights are stored in (its first floating tensor's, from the safetensors
    headers), else `default`. A trained arm is saved in its parent's: one GPU trains in bfloat16, and an arm of a
    float32 parent saved in bfloat16 could not be merged with it (the H200 session's dose merge refused the pair,
    trainers.merge.check_compatible), nor served as its parent is."""
    from safetensors import safe_open

    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                found = SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
                if found is not None and found.is_floating_point:
                    return found
    return default


def save_final(model, tokenizer, out_dir: Path, save_dtype: torch.dtype) -> None:
    """Collective: the consolidated model (full weights in `save_dtype`, or the peft adapter) on rank 0."""
    with _served_cache_settings(model):
        _save_final(model, tokenizer, out_dir, save_dtype)


def _save_final(model, tokenizer, out_dir: Path, save_dtype: torch.dtype) -> None:
    from peft import PeftModel

    env = distributed.setup()
    if not env.distributed:
        state = None
        if not isinstance(model, PeftModel) and any(p.is_floating_point() and p.dtype != save_dtype
                                                    for p in model.parameters()):
            state = {k: v.to(save_dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.save_pretrained(out_dir, state_dict=state, max_shard_size=MAX_SHARD_SIZE)
        tokenizer.save_pretrained(out_dir)
        write_weights_manifest(out_dir)
        return
    if isinstance(model, PeftModel):
        state = trainable_full_state(model)  # only the adapter (and head copy) travels, never the frozen base
        if env.is_main:
            model.save_pretrained(out_dir, state_dict=state)
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if env.is_main:
            _plain_model(model.config, state, save_dtype).save_pretrained(out_dir, max_shard_size=MAX_SHARD_SIZE)
    if env.is_main:
        tokenizer.save_pretrained(out_dir)
        write_weights_manifest(out_dir)
    distributed.barrier()


def save_snapshot(model, tokenizer, out_dir: Path, save_dtype: torch.dtype, info: dict) -> None:
    """Collective: the model now, written as `save_final` writes the final one, with `info` in `SNAPSHOT_INFO`.
    It goes to `<out_dir>.tmp` and is swapped in when complete: a kill mid-write leaves no partial snapshot, and
    the resumed run (whose state is older than this step) writes it again."""
    env = distributed.setup()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    save_final(model, tokenizer, tmp, save_dtype)
    if env.is_main:
        write_json_atomic(tmp / SNAPSHOT_INFO, info)
        _swap_in(tmp, out_dir)
    distributed.barrier()


def _plain_model(config, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """An unsharded model holding `state` (assigned, not copied), so save_pretrained writes the architecture's own
    checkpoint layout (e.g. Nemotron-H's `backbone.*` names and per-expert tensors) exactly as a single process does."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                          strict=True, assign=True)
    return plain
