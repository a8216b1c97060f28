"""CUDA graphs over one region of a training step, forward and backward, for steps the host cannot keep fed.

Why: on an H200 the Nemotron-H bench step (0.89B hybrid, 2 x 4096, LoRA) ran 98.5-130.8 ms across three calls
while its kernels took 79.5 ms; mamba-ssm's Triton chunk-scan autograd functions alone spent 30-34 ms of host
time a step for the 6 Mamba layers (bench/README.md, hybrid LoRA). Each of their ~20 kernels per layer and pass is
launched from Python. A graph replay launches all of a region's forward (or backward) kernels in one call.

`GraphedRegion(fn, params, state)` wraps `fn(*inputs)` (tensors or None in, one tensor out) whose trainable
weights are `params()`. A call with gradients on:

- replays the captured graphs when its key equals theirs;
- captures new ones (after two eager warm-ups on a side stream, which also run Triton's autotuning) when its key
  equals the previous call's: fixed shapes (rows padded or packed to max_len) capture at the second step, and
  shapes that change every step stay eager, as before;
- runs `fn` eagerly otherwise, and always when gradients are off (evaluation, scoring passes, checkpointing's
  first pass), when the last replay's backward is still due (a second forward before the first one's backward
  would overwrite the activations saved in the graph's memory), or inside another capture or a compile trace.

The key: each input's shape, dtype, strides and requires_grad; each parameter's address, dtype and
requires_grad (an optimizer updating weights in place keeps it; a reassigned `.data` does not); and `state()`
(training mode, adapters enabled or merged: branches that a graph would freeze). The output and the gradients
are copied out of the graph's memory, so nothing autograd holds is overwritten by a later replay; a second backward
over a replayed forward (retain_graph) after a newer replay raises instead of reading overwritten activations.

Each process logs autograd's warning once that an AccumulateGrad node's stream does not match its producer's
(seen on the H200 in every run with graphs, the tests' too; likely because the warm-ups run on a side stream and
the capture on its own, so gradient accumulators made there meet the capture's nodes). Losses and gradients equal eager's
(tests/trainers/test_step_graphs.py on the GPU); what the extra stream wait costs was not measured.

The graphs keep their region's activations in a private memory pool between steps, so they are for steps without
activation checkpointing (whose point is not to keep them); `trainers.common.graph_mamba_mixers` says where they
are used.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

Action = Literal["eager", "capture", "replay"]
WARMUPS = 2


def decide(key: tuple, graph_key: tuple | None, last_key: tuple | None, usable: bool) -> Action:
    """What a call does: replay the graphs of its key, capture them on the second call in a row with one key, or
    run eagerly (`usable` False: gradients off, a replay's backward due, or no CUDA input)."""
    if not usable:
        return "eager"
    if key == graph_key:
        return "replay"
    return "capture" if key == last_key else "eager"


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


@dataclass
class _Graphs:
    """One capture: the forward and backward graphs and the static tensors they read and write."""

    key: tuple
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]
    output: torch.Tensor
    grad_output: torch.Tensor
    grads: tuple[torch.Tensor | None, ...]  # of the inputs that require grad, then of the trainable params


class _Token:
    """Lives as long as a replay's autograd node: while it does and its backward has not run, no replay."""


class GraphedRegion:
    """`fn` replayed from CUDA graphs where its calls repeat (module docstring)."""

    def __init__(self, fn: Callable[..., torch.Tensor], params: Callable[[], Sequence[torch.nn.Parameter]],
                 state: Callable[[], tuple] = tuple):
        self.fn, self.params, self.state = fn, params, state
        self.graphs: _Graphs | None = None
        self.last_key: tuple | None = None
        self.pending: weakref.ref | None = None  # the token of the replay whose backward is due
        self.generation = 0  # bumped by every replay and capture
        self.counts: Counter[str] = Counter()

    def __call__(self, *inputs: torch.Tensor | None) -> torch.Tensor:
        params = list(self.params())
        trainable = [p for p in params if p.requires_grad]
        usable = self._usable(inputs, trainable)
        key = (tuple(tensor_key(t) for t in inputs), tuple((p.data_ptr(), p.dtype, p.requires_grad) for p in params),
               self.state(), torch.is_autocast_enabled("cuda")) if usable else ()
        action = decide(key, self.graphs.key if self.graphs else None, self.last_key, usable)
        if usable:  # calls that could not use a graph (no-grad passes, a re-entrant forward) do not count as sightings
            self.last_key = key
        self.counts[action] += 1
        if action == "eager":
            return self.fn(*inputs)
        if action == "capture":
            self.graphs = None  # frees the old pool before the new capture
            self.generation += 1
            self.graphs = self._capture(key, inputs, trainable)
        return _Replay.apply(self, len(inputs), *inputs, *trainable)

    def _usable(self, inputs: Sequence[torch.Tensor | None], trainable: list) -> bool:
        due = self.pending is not None and self.pending() is not None
        first = next((t for t in inputs if t is not None), None)
        wants_grad = bool(trainable) or any(t is not None and t.requires_grad for t in inputs)
        return (torch.is_grad_enabled() and wants_grad and not due and first is not None and first.is_cuda
                and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling())

    def _capture(self, key: tuple, inputs: Sequence[torch.Tensor | None], trainable: list) -> _Graphs:
        static = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        wrt = [t for t in static if t is not None and t.requires_grad] + trainable
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-ups: autotuning, lazy init and workspaces happen outside the capture
            for _ in range(WARMUPS):
                out = self.fn(*static)
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(forward, capture_error_mode="thread_local"):
            output = self.fn(*static)
        grad_output = torch.empty_like(output)
        with torch.cuda.graph(backward, pool=forward.pool(), capture_error_mode="thread_local"):
            grads = torch.autograd.grad(output, wrt, grad_output, allow_unused=True)
        return _Graphs(key, forward, backward, static, output.detach(), grad_output, grads)


class _Replay(torch.autograd.Function):
    """One replay of a region's graphs as an autograd node: inputs copied in, output and gradients copied out."""

    @staticmethod
    def forward(ctx, region: GraphedRegion, n_inputs: int, *tensors: torch.Tensor | None) -> torch.Tensor:
        graphs = region.graphs
        for static, given in zip(graphs.inputs, tensors[:n_inputs], strict=True):
            if static is not None and static.data_ptr() != given.data_ptr():
                static.copy_(given)
        graphs.forward.replay()
        region.generation += 1
        ctx.region, ctx.generation, ctx.n_inputs = region, region.generation, n_inputs
        ctx.token = _Token()
        region.pending = weakref.ref(ctx.token)
        return graphs.output.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        region = ctx.region
        if ctx.generation != region.generation:
            raise RuntimeError("a CUDA-graphed region was replayed again before this backward: its saved activations "
                               "are gone (a second backward with retain_graph over a graphed step is not supported)")
        graphs = region.graphs
        graphs.grad_output.copy_(grad_output)
        graphs.backward.replay()
        region.pending = None
        grads = iter(None if g is None else g.clone() for g in graphs.grads)
        inputs = [next(grads) if t is not None and t.requires_grad else None for t in graphs.inputs]
        return (None, None, *inputs, *grads)
