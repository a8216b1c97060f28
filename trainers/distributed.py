"""One process per GPU: the process group, FSDP2 sharding, sharded loading and the few collectives the loop needs.

How a job becomes distributed (read once, in `read_env`):

- torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), set by `torchrun` or by
  the local executor when a job asks for several tasks, win;
- else a Slurm step of several tasks (SLURM_NTASKS > 1) is read through
  `submitit.helpers.TorchDistributedEnvironment`, which exports the same variables from SLURM_*;
- else the job is one plain process: no process group, no sharding (what the CPU unit tests run in-process).

With a group, the backend is NCCL on GPUs and gloo on CPU. The policy and every frozen model (DPO reference,
KL-CE parent) are wrapped with FSDP2 (`fully_shard`) per decoder block and at the root: each rank holds 1/world
of every weight, gathered block by block for forward and backward. On GPU in bfloat16 the sharded parameters
stay float32 (master weights, and so AdamW state) and `MixedPrecisionPolicy` computes in bfloat16 with float32
gradient reduction; frozen weights are stored in bfloat16 (they never take an update).

Loading never holds a full model per rank: rank 0 reads the checkpoint (transformers' own loader, which knows
each architecture's checkpoint layout), the other ranks build the model on the meta device, and after sharding
rank 0 broadcasts one tensor at a time into everyone's shards (`set_model_state_dict(..., full_state_dict=True,
broadcast_from_rank0=True)`, the torchtitan/torchtune recipe): one host copy per node, on rank 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

# How long a collective may wait for the slowest rank before the job fails (tools/jobs/failures.py classifies the
# backend's timeout message as nccl_timeout); the launcher may set TRAINER_COLLECTIVE_TIMEOUT_S.
COLLECTIVE_TIMEOUT_S = 600.0


class DistEnv(BaseModel):
    """Where this process sits in its job."""

    model_config = ConfigDict(frozen=True)
    rank: int = Field(0, ge=0, description="Global rank of this process.")
    world_size: int = Field(1, ge=1, description="Processes in the job (one per GPU).")
    local_rank: int = Field(0, ge=0, description="Rank on this node (selects the GPU).")
    source: str = Field("single", description="Where the rank came from: single, torchrun or slurm.")
    collective_timeout_s: float = Field(COLLECTIVE_TIMEOUT_S, gt=0, description="Seconds a collective waits for "
                                        "the slowest rank before the job fails.")

    @property
    def distributed(self) -> bool:
        """True when the job runs under a process group (even a group of one, as torchrun starts it)."""
        return self.source != "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env(environ: Mapping[str, str]) -> DistEnv:
    """The job's layout from its environment: torchrun variables first, then a multi-task Slurm step."""
    timeout = float(environ.get("TRAINER_COLLECTIVE_TIMEOUT_S", COLLECTIVE_TIMEOUT_S))
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return DistEnv(rank=int(environ["RANK"]), world_size=int(environ["WORLD_SIZE"]),
                       local_rank=int(environ.get("LOCAL_RANK", "0")), source="torchrun", collective_timeout_s=timeout)
    if int(environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in environ:
        return DistEnv(rank=int(environ["SLURM_PROCID"]), world_size=int(environ["SLURM_NTASKS"]),
                       local_rank=int(environ.get("SLURM_LOCALID", "0")), source="slurm", collective_timeout_s=timeout)
    return DistEnv()


_ENV: DistEnv | None = None


def setup() -> DistEnv:
    """Joins the job's process group (once per process) and returns where this process sits."""
    global _ENV
    if _ENV is not None:
        return _ENV
    env = read_env(os.environ)
    if env.source == "slurm":
        from submitit.helpers import TorchDistributedEnvironment

        # Exports MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK from SLURM_* for init_process_group's env://.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    if env.distributed and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(device(env))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=timedelta(seconds=env.collective_timeout_s))
    _ENV = env
    return env


def teardown() -> None:
    """Leaves the process group (end of a job), so a later job in the same process starts clean."""
    global _ENV
    if dist.is_initialized():
        dist.destroy_process_group()
    _ENV = None


def device(env: DistEnv | None = None) -> torch.device:
    """This rank's device: its node-local GPU, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    env = env or setup()
    return torch.device("cuda", env.local_rank % torch.cuda.device_count())


def rank_share(rows: list[int], env: DistEnv) -> list[int]:
    """This rank's contiguous share of one optimizer step's rows (batch_size is a multiple of world_size)."""
    per = len(rows) // env.world_size
    return rows[env.rank * per : (env.rank + 1) * per]


def all_sum(values: list[float]) -> list[float]:
    """Elementwise sum over ranks (float64 on the wire, so counts stay exact); identity without a group."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_wire_device())
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any (the preemption flag is agreed on before saving)."""
    return all_sum([float(flag)])[0] > 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(value):
    """Rank 0's value on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def map_shared(fn, items: list, per_call: int) -> list:
    """`fn(part) -> results` over `items` in parts of at most `per_call`, each rank computing its contiguous share;
    every rank returns all results in order. Shares are padded with a repeated item so that every rank calls `fn`
    equally often (a sharded model's forward is a collective), and the padding's results are discarded."""
    env = setup()
    if env.world_size == 1 or not items:
        return [r for s in range(0, len(items), per_call) for r in fn(items[s : s + per_call])]
    per = -(-len(items) // env.world_size)
    mine = items[env.rank * per : (env.rank + 1) * per]
    padded = mine + [items[-1]] * (per - len(mine))
    results = [r for s in range(0, per, per_call) for r in fn(padded[s : s + per_call])][: len(mine)]
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, results)
    return [r for part in gathered for r in part]


def _wire_device() -> torch.device:
    return device() if dist.get_backend() == "nccl" else torch.device("cpu")


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one: every module held in the model's layer ModuleList."""
    lists = [m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and name.endswith("layers")]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no '*.layers' ModuleList to shard by decoder block")
    return list(lists[0])


def shard(model: torch.nn.Module, compute_dtype: torch.dtype | None) -> torch.nn.Module:
    """FSDP2 per decoder block, then the root (embeddings, final norm, head); compute in `compute_dtype`
    (None: the parameters' own dtype) with float32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def load_sharded(build, load_full, compute_dtype: torch.dtype | None, env: DistEnv) -> torch.nn.Module:
    """A sharded model on this rank's device without a full copy per rank.

    `build()` returns the (possibly peft-wrapped) model skeleton; `load_full()` the same model with its
    weights, called on rank 0 only. Buffers (rotary tables, router biases) are not sharded: they are
    broadcast from rank 0 as they are.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = load_full() if env.is_main else None
    with torch.device("meta"):
        model = build()
    if full is not None:
        _same_trainability(model, full)
    shard(model, compute_dtype)
    model.to_empty(device=device(env))
    state = full.state_dict() if full is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full_buffers = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if full is not None:
            buf.copy_(full_buffers[name])
        dist.broadcast(buf, src=0)
    del full
    return model


def _same_trainability(skeleton: torch.nn.Module, full: torch.nn.Module) -> None:
    """The meta skeleton and rank 0's loaded model must agree on names and which parameters train."""
    a = {n: p.requires_grad for n, p in skeleton.named_parameters()}
    b = {n: p.requires_grad for n, p in full.named_parameters()}
    if a != b:
        raise RuntimeError(f"skeleton and loaded model differ: {sorted(set(a.items()) ^ set(b.items()))[:5]}")
