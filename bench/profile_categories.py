"""Where a step's time goes, by category: torch.profiler events attributed to the model's parts.

`labelled(model, phase)` opens a `torch.profiler.record_function` range around each call of the parts that tell a
category apart (`mod:mamba`, `mod:attention`, `mod:experts`, `mod:gate`, `mod:shared_experts`, `mod:norm`,
`mod:head`, `mod:embed`), and `phase(name)` one around a phase of a training step (`phase:forward`,
`phase:backward`, `phase:optimizer`). `categorize(prof, ...)` then walks the recorded events: each GPU kernel is
attributed to the CPU event that launched it and that event's ancestors (their names: the ranges above and the
autograd node of a backward op), and `classify` names its category from those names, the kernel's name and whether
an input of the launching op has the vocabulary's width (the head and loss). On the CPU there are no kernels: each
op's own CPU time is classified the same way, which is how the categorizer is checked without a GPU
(tests/test_bench_profile.py). What no kernel accounts for in the measured wall time is the launch gaps.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch.autograd.profiler import record_function

GEMM = re.compile(r"gemm|gemv|matmul|nvjet|xmma|cutlass|cublas|wgmma|aten::(mm|bmm|addmm|baddbmm|linear|_grouped_mm)\b"
                  r"|grouped_mm|_mm_|splitk", re.I)
MAMBA_KERNEL = re.compile(r"chunk_scan|chunk_state|state_passing|bmm_chunk|chunk_cumsum|ssd|selective|state_update"
                          r"|causal_conv|conv1d|conv_update|mamba", re.I)
ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|sdpa|scaled_dot_product|decode_attn", re.I)
ROUTING = re.compile(r"topk|top_k|sort|scatter|gather|histc|bincount|cumsum|index|sigmoid|masked_fill|nonzero|argsort",
                     re.I)
COMM = re.compile(r"nccl|all_gather|allgather|reduce_scatter|reducescatter|all_reduce|foreach_copy|chunk_cat"
                  r"|split_with_sizes_copy|fsdp", re.I)

KINDS = {"NemotronHMamba2Mixer": "mamba", "NemotronHAttention": "attention", "NemotronHExperts": "experts",
         "NemotronHTopkRouter": "gate", "NemotronHRMSNorm": "norm", "NemotronHRMSNormGated": "norm"}


def kind_of(name: str, module: torch.nn.Module) -> str | None:
    """The category-bearing kind of a named module (peft wrappers count as what they wrap), or None."""
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "shared_experts":
        return "shared_experts"
    if leaf == "lm_head":
        return "head"
    if leaf in ("embeddings", "embed_tokens"):
        return "embed"
    return KINDS.get(type(base).__name__.removeprefix("FSDP")) or KINDS.get(type(module).__name__.removeprefix("FSDP"))


@contextmanager
def labelled(model: torch.nn.Module) -> Iterator[None]:
    """A `mod:<kind>` profiler range around every call of each category-bearing module (hooks; removed after)."""
    handles, stacks = [], {}

    def enter(kind):
        def pre(module, args):
            rf = record_function(f"mod:{kind}")
            rf.__enter__()
            stacks.setdefault(id(module), []).append(rf)
        return pre

    def leave(module, args, output):
        stack = stacks.get(id(module))
        if stack:
            stack.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        kind = kind_of(name, module)
        if kind is not None:
            handles.append(module.register_forward_pre_hook(enter(kind)))
            handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def phase(name: str) -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(record_function(f"phase:{name}"))
        yield


def classify(kernel: str, names: list[str], vocab_input: bool = False, mode: str = "decode") -> str:
    """The category of one kernel (or, on the CPU, one op): `kernel` its name, `names` the names of the CPU event
    that launched it and of that event's ancestors, innermost first; `vocab_input`: an input of the launching op (or
    an ancestor) has the vocabulary's width; `mode` "decode" or "train"."""
    mods = [n[4:] for n in names if n.startswith("mod:")]
    phases = [n[6:] for n in names if n.startswith("phase:")]
    kind = mods[0] if mods else None
    where = phases[0] if phases else None
    text = " ".join([kernel, *names])
    if kind == "embed":
        return "embedding"
    if mode == "train":
        if where == "optimizer":
            return "optimizer (clip, AdamW)"
        if vocab_input or kind == "head":
            return "head + loss (131k vocabulary)"
        # Backward ops run inside the autograd engine's evaluate_function (on CUDA in its own thread, so the
        # phase range is no ancestor); a module's forward there is the checkpointed forward run again.
        if mods and any(n.startswith("autograd::engine::evaluate_function") for n in names):
            return "recomputation (checkpointed forward)"
        if COMM.search(text):
            return "FSDP gathers and copies"
    elif kind == "head" or vocab_input:
        return "head"
    if kind == "experts" or (mode == "train" and re.search(r"grouped|baddbmm", text, re.I)):
        if re.search(r"baddbmm", text, re.I):
            return "expert adapters (B @ A folded)" if mode == "train" else "expert GEMMs"
        if GEMM.search(kernel) or re.search(r"grouped", text, re.I):
            return "expert GEMMs"
        return "routing / top-k / scatter"
    if kind == "gate":
        return "routing / top-k / scatter"
    if kind == "shared_experts":
        return "shared expert GEMMs" if GEMM.search(kernel) else "norms / elementwise"
    if MAMBA_KERNEL.search(kernel) or (kind == "mamba" and MAMBA_KERNEL.search(names[0] if names else "")):
        return "Mamba scan" if mode == "train" else "Mamba state update"
    if kind == "attention" or ATTENTION_KERNEL.search(kernel) or (mode == "train" and ATTENTION_KERNEL.search(text)):
        return "attention"
    if kind == "mamba" and GEMM.search(kernel):
        return "Mamba projections"
    if GEMM.search(kernel):
        return "other GEMMs (projections, adapters)"
    return "norms / elementwise"


def _ancestry(event) -> list[str]:
    names, e = [], event
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    return names


def _vocab_input(event, vocab: int | None) -> bool:
    if not vocab:
        return False
    e = event
    while e is not None:
        for shape in getattr(e, "input_shapes", None) or []:
            if isinstance(shape, list | tuple) and vocab in shape:
                return True
        e = e.cpu_parent
    return False


def categorize(prof, steps: int, wall_s: float, mode: str = "decode", vocab: int | None = None,
               top: int = 4) -> dict:
    """Per-category time per step (ms) from a finished profiler, its top kernels, and the launch gaps (the measured
    wall time per step less the kernel time per step; on the CPU, less the classified op time)."""
    events = prof.events()
    rows: list[tuple[str, str, float]] = []  # (category, kernel, microseconds)
    cpu = torch.autograd.DeviceType.CPU
    on_gpu = any(e.device_type != cpu for e in events)
    unlinked = 0.0
    if on_gpu:  # each kernel, attributed to the op (or range) that launched it: the profiler's correlation link
        by_id = {e.id: e for e in events if e.device_type == cpu}
        for e in events:
            if e.device_type == cpu:
                continue
            us = e.time_range.end - e.time_range.start
            launcher = by_id.get(getattr(e, "linked_correlation_id", 0))
            names = _ancestry(launcher) if launcher is not None else []
            unlinked += us if launcher is None else 0.0
            vocab_input = launcher is not None and _vocab_input(launcher, vocab)
            rows.append((classify(e.name, names, vocab_input, mode), e.name, us))
    else:
        for e in events:
            if e.device_type == cpu and not e.name.startswith(("mod:", "phase:")) and e.self_cpu_time_total > 0:
                rows.append((classify(e.name, _ancestry(e), _vocab_input(e, vocab), mode), e.name,
                             e.self_cpu_time_total))
    table: dict[str, dict] = {}
    for cat, name, us in rows:
        entry = table.setdefault(cat, {"ms_per_step": 0.0, "kernels": {}})
        entry["ms_per_step"] += us / 1e3 / steps
        entry["kernels"][name] = entry["kernels"].get(name, 0.0) + us / 1e3 / steps
    attributed = sum(v["ms_per_step"] for v in table.values())
    wall_ms = wall_s * 1e3 / steps
    for entry in table.values():
        tops = sorted(entry["kernels"].items(), key=lambda kv: -kv[1])[:top]
        entry["top"] = [{"name": n[:100], "ms_per_step": round(t, 4)} for n, t in tops]
        entry["share_of_wall"] = entry["ms_per_step"] / wall_ms if wall_ms else None
        del entry["kernels"]
    out = {"unit": "ms per step", "steps": steps, "wall_ms_per_step": wall_ms,
           "timed_on": "gpu kernels" if on_gpu else "cpu ops (self time)",
           "categories": dict(sorted(table.items(), key=lambda kv: -kv[1]["ms_per_step"])),
           "attributed_ms_per_step": attributed,
           # On the CPU the profiler's own cost inflates every op's time: no gaps to tell there.
           "launch_gaps_ms_per_step": wall_ms - attributed if on_gpu else None}
    if on_gpu:  # kernels whose launching op the profiler did not link: classified by their name alone
        out["unlinked_kernels_ms_per_step"] = unlinked / 1e3 / steps
    return out


def render(table: dict) -> str:
    lines = [f"  wall {table['wall_ms_per_step']:.3f} ms/step ({table['timed_on']})"]
    for cat, v in table["categories"].items():
        lines.append(f"  {v['ms_per_step']:9.3f} ms  {100 * (v['share_of_wall'] or 0):5.1f}%  {cat}")
    if table["launch_gaps_ms_per_step"] is not None:
        lines.append(f"  {table['launch_gaps_ms_per_step']:9.3f} ms  launch gaps (wall - kernels)")
    return "\n".join(lines)
