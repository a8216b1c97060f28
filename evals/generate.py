"""The generation engine: batched, left-padded generation at a candidate's served decoding.

A model is loaded once (`load`) and then answers every suite of a job. Prompts are rendered by the
one chat renderer (`core.chat.render_prompt`) with the decoding's system prompt, sorted by
length so each batch wastes little padding, left-padded (new tokens then line up at the right
edge) and decoded with exactly the served settings: greedy or temperature/top_p (top_k off, since
a served decoding has none), repetition penalty, max new tokens and stop ids.

`static_cache=True` runs the engine's own decode loop over a preallocated KV cache: the prompt is prefilled once,
then every decode
step's forward is one replay of a CUDA graph captured for the batch's shape (on CUDA; plain calls
on CPU), so decode stops paying Python and kernel-launch overhead per step, the bottleneck of
eager decoding, and nothing is compiled (capturing a shape costs two forward passes, not the
24-41 s of torch.compile of the whole model). On CUDA the step's attention is `evals.decode_attention`'s
split-KV kernel, which reads each row's cache only up to its current position; its RMSNorms and MLPs run
compiled (`fused_pieces`: one small compilation per module class, shared by all layers and shapes, in
place only while a step is captured); and the host checks for stops every
`STOP_CHECK_EVERY` steps instead of after each (each check waits for the GPU to drain, which left it
idle while the next step was launched). Sampled decoding then draws the random numbers of up to
STOP_CHECK_EVERY - 1 steps after a batch's last stop (output unchanged: those tokens are cut), so a
CUDA replicate is reproducible but its later batches' draws differ from `generate`'s. Prompt widths are rounded up
to a multiple of `WIDTH_BUCKET` so a few captured shapes serve a whole call. The choice of the next token is part
of the captured step (`_Sampler`): transformers' own repetition-penalty, temperature and top-p processors, then
argmax or `torch.multinomial`'s own single-draw algorithm, on static buffers, so a decode step is one replay with
no host work between steps; on the CPU the same step runs eagerly and its tokens are `generate`'s for the same
seed (tests/evals/test_engine_job.py). On CUDA the graph's random numbers come from the same seeded generator,
at other offsets than `generate`'s, so the draws differ from `generate`'s but keep its distribution.

Nemotron-H hybrids take the same loop with `static_cache=True` (what an eval job on CUDA sets; checked on an H200
against one full forward, bench/decode_hybrid_check.py): `evals.decode_hybrid` keeps their Mamba-2 convolution and SSM states in the
static cache beside the attention layers' KV cache, steps them with mamba-ssm's Triton decode kernels, and routes
the MoE layers through grouped-matmul experts, so a hybrid's step is one graph replay too. Where a kernel is missing
the Mamba layers fall back to transformers' PyTorch functions (said once); where the installed transformers has no
static cache for hybrids, `generate` serves them (said once).

Seeding: the global torch generator is seeded once per call; with the same items, decoding, seed
and batch size a replicate is reproducible. Different seeds give the sampling replicates of a
noise floor.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    StaticCache,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)
from transformers import PreTrainedTokenizerBase as Tokenizer

from core import loading
from core.chat import render, render_prompt
from evals import decode_attention, decode_hybrid
from evals.decoding import Decoding
from evals.types import Completion, Item, completion_from_text


@dataclass(frozen=True)
class Loaded:
    """A model and its tokenizer, loaded once per job; `decoders` keeps the static loop's captured decoders (one
    per shape and decoding) across the job's generate calls (its suites), the MAX_DECODERS most recently used."""

    model: PreTrainedModel
    tokenizer: Tokenizer
    device: torch.device
    decoders: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)


def load(path: str | Path, device: str = "cpu", dtype: str = "float32") -> Loaded:
    """Load a causal LM checkpoint directory (weights and tokenizer) for evaluation, or a PEFT adapter directory
    through its adapter (`adapter_model`)."""
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        tokenizer, model = loading.load_tokenizer(path), adapter_model(path, dtype).to(device).eval()
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json)")
    else:
        tokenizer = loading.load_tokenizer(path)
        model = loading.load_causal_lm(path, dtype=getattr(torch, dtype)).to(device).eval()
    # A checkpoint saved mid-training may say use_cache = false; generate() would then re-run the whole prefix at
    # every token (the model's generation config overrides a passed config's defaults).
    model.config.use_cache = True
    model.generation_config.use_cache = True
    return Loaded(model=model, tokenizer=tokenizer, device=torch.device(device))


ADAPTER_CONFIG = "adapter_config.json"


def adapter_model(path: Path, dtype: str) -> PreTrainedModel:
    """A LoRA arm evaluated through its adapter: the base its adapter_config.json names, with the adapter folded into
    the weights in memory (peft's merge_and_unload), so the engine's decode paths see a plain model. The tokenizer is
    the adapter directory's own (the trainer saves it with the chat template it trained under)."""
    base_dir = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path") or ""
    if not (Path(base_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{path}: the adapter's base {base_dir!r} is no local model directory")
    base = loading.load_causal_lm(base_dir, dtype=getattr(torch, dtype))
    return loading.load_adapter(base, path).merge_and_unload()


def stop_ids(loaded: Loaded, decoding: Decoding) -> list[int]:
    """The served stop ids; a decoding without any falls back to the checkpoint's generation config."""
    if decoding.stop_token_ids:
        return list(decoding.stop_token_ids)
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        raise ValueError("decoding has no stop_token_ids and the checkpoint's generation config no eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos)


WIDTH_BUCKET = 32
# Captured decoder shapes kept per loaded model: each holds a static KV cache (1.9 GB at batch 128 x 448 positions
# on the 1B shape) and a CUDA graph; capturing one again costs two forwards, a capture and, with a new shape for the
# compiled pieces, a recompilation.
MAX_DECODERS = 4
# Graph-replayed decoding asks the GPU whether every row has stopped once per this many steps (see the docstring).
STOP_CHECK_EVERY = 16
# Plain decoder-only attention models, whose whole state is one KV cache per layer: the engine's own
# static-cache loop serves these with `static_cache=True`; so it does hybrids (evals.decode_hybrid).
STATIC_LOOP_MODEL_TYPES = {"llama", "qwen2", "qwen3"}
_log = logging.getLogger(__name__)


def uses_own_loop(model: PreTrainedModel, static_cache: bool) -> bool:
    """Whether `generate` decodes this model with the engine's static loop (see the module docstring)."""
    if model.config.model_type in STATIC_LOOP_MODEL_TYPES:
        return static_cache
    if not decode_hybrid.is_hybrid(model) or not static_cache:
        return False
    if not decode_hybrid.supported(model):
        _no_hybrid_loop(transformers.__version__)
        return False
    return True


@functools.cache
def _no_hybrid_loop(version: str) -> None:
    _log.warning("hybrid decode: transformers %s has no static cache for Mamba layers (5.24 has); hybrids decode "
                 "through model.generate", version)


def generation_config(decoding: Decoding, stops: list[int], pad_id: int) -> GenerationConfig:
    # top_k=0: a served decoding has no top-k, and transformers would otherwise default it to 50.
    sampled = {} if decoding.greedy else {"temperature": decoding.temperature, "top_p": decoding.top_p, "top_k": 0}
    return GenerationConfig(
        do_sample=not decoding.greedy, repetition_penalty=decoding.repetition_penalty,
        max_new_tokens=decoding.max_new_tokens, eos_token_id=stops, pad_token_id=pad_id, **sampled,
    )


def _left_pad(prompts: list[list[int]], pad_id: int, device: torch.device,
              bucket: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    width = -(-max(len(p) for p in prompts) // bucket) * bucket
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _record(item_id: str, new_tokens: list[int], stops: list[int], tokenizer: Tokenizer) -> Completion:
    """Cut at the first stop id; text excludes it, the token count includes it."""
    cut = next((i for i, tok in enumerate(new_tokens) if tok in stops), None)
    kept = new_tokens if cut is None else new_tokens[:cut]
    text = tokenizer.decode(kept, skip_special_tokens=False)
    n = len(new_tokens) if cut is None else cut + 1
    return completion_from_text(item_id, text, n, stopped=cut is not None)


class PromptTooLong(ValueError):
    """Prompts that, with the answer's max_new_tokens, do not fit the model's context: nothing was generated."""


def check_context(loaded: Loaded, items: Sequence[Item], prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Refuse before generating when a rendered prompt plus max_new_tokens exceeds the model's context
    (config.max_position_embeddings): the cache for it would be sized past what the model was built for (a
    10.8 MB prompt once asked for 28.7 GB). A lab's suites are checked the same way before its session opens
    (agent/inputs.py); this catches what reaches a job otherwise. The first line of the message is the
    project's own (tools/jobs/failures.py reads only that); the item ids, public text, follow escaped."""
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    if not isinstance(context, int):
        return
    over = [(item.id, len(p)) for item, p in zip(items, prompts, strict=True) if len(p) + max_new_tokens > context]
    if over:
        listed = ", ".join(f"{i!r} ({n} tokens)" for i, n in over[:20]) + (f" and {len(over) - 20} more" if len(over) > 20 else "")
        raise PromptTooLong(f"{len(over)} of {len(items)} prompt(s) plus max_new_tokens {max_new_tokens} exceed the "
                            f"model's context of {context} tokens; nothing generated\nitems: {listed}")


def generate(loaded: Loaded, items: Sequence[Item], decoding: Decoding, seed: int,
             batch_size: int = 64, static_cache: bool = False) -> list[Completion]:
    """One completion per item, in item order, at `decoding` with sampling seed `seed`."""
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id
    if pad_id is None:
        raise ValueError("tokenizer has no pad token; left padding needs one")
    system = decoding.system_prompt or None
    prompts = [render_prompt(tok, item.messages, system) for item in items]
    check_context(loaded, items, prompts, decoding.max_new_tokens)
    stops = stop_ids(loaded, decoding)
    config = generation_config(decoding, stops, pad_id)
    order = sorted(range(len(items)), key=lambda i: len(prompts[i]))
    out: dict[int, Completion] = {}
    own_loop = uses_own_loop(loaded.model, static_cache)
    torch.manual_seed(seed)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        ids, mask = _left_pad([prompts[i] for i in batch], pad_id, loaded.device,
                              WIDTH_BUCKET if static_cache or own_loop else 1)
        with torch.inference_mode():
            if own_loop:
                new_ids = _decode_static(loaded.model, ids, mask, config, stops, loaded.decoders)
            else:
                new_ids = loaded.model.generate(input_ids=ids, attention_mask=mask,
                                                generation_config=config)[:, ids.shape[1]:]
        for row, i in enumerate(batch):
            out[i] = _record(items[i].id, new_ids[row].tolist(), stops, tok)
    return [out[i] for i in range(len(items))]


def _processors(config: GenerationConfig) -> LogitsProcessorList:
    """transformers' own processors, in the order `generate` applies them for a served decoding."""
    procs = LogitsProcessorList()
    if config.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.do_sample and config.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(config.temperature))
    if config.do_sample and config.top_p < 1.0:
        procs.append(TopPLogitsWarper(config.top_p))
    return procs


# Per module class, its forward compiled once (torch.compile caches by code and guards, so every layer and
# every captured shape of a process shares it).
_COMPILED: dict[tuple[type, str], object] = {}


def fusable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's RMSNorms and MLPs: at one token per row each is a chain of small elementwise kernels (the
    norm's float32 cast, square, mean, rsqrt, scale and cast back; SiLU x up) with no state across steps, unlike
    attention and its KV cache (whose per-layer index would make the compiler specialise on every layer)."""
    return [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]


@contextmanager
def fused_pieces(modules: list[torch.nn.Module], backend: str = "inductor") -> Iterator[None]:
    """Inside, each module's forward is its class's compiled forward (an instance attribute, removed on exit);
    what a CUDA graph captures inside keeps the compiled kernels after the exit."""
    for m in modules:
        fn = _COMPILED.setdefault((type(m), backend), torch.compile(type(m).forward, backend=backend))
        m.forward = partial(fn, m)
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from `probs`: `torch.multinomial(probs, 1)`'s own algorithm for a single draw (the
    argmax of probs / q with q ~ Exp(1), the exponential race; PyTorch's Distributions.cpp), so the same generator
    state gives the same tokens and leaves the same state, without multinomial's validity checks of the input,
    which read a device value on the host: a captured step may not wait for the device."""
    q = torch.empty_like(probs).exponential_(1)
    return torch.div(probs, q, out=q).argmax(dim=-1)


class _Sampler:
    """The served decoding's choice of the next token, computed on static buffers alone so that a CUDA graph can
    capture it with the decode step (a whole step is then one replay; its dozen small sampling kernels were
    launched one by one from the host before): transformers' own processors (repetition penalty, temperature,
    top-p), then argmax or `_draw`. The penalty is taken over the decoder's whole sequence buffer, whose positions
    not generated yet hold the row's last prompt token: the penalised set is then exactly the prompt and the
    tokens generated so far, as `generate` penalises them (the processor penalises a set: repeats change nothing)."""

    def __init__(self, config: GenerationConfig, stops: list[int]):
        self.procs, self.do_sample, self.pad = _processors(config), config.do_sample, config.pad_token_id
        self.stops = list(stops)
        self.key = (config.do_sample, config.temperature, config.top_p, config.repetition_penalty, tuple(stops),
                    self.pad)

    def __call__(self, seqs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        scores = self.procs(seqs, logits)
        return _draw(torch.softmax(scores, dim=-1)) if self.do_sample else scores.argmax(dim=-1)


class _Decoder:
    """A static KV cache for one (batch, width, new tokens) shape and one decode step over it, replayed as a CUDA
    graph.

    The step reads its token, position and cache slot from fixed buffers and its attention from an additive
    [B, 1, 1, L] mask (a 4D mask reaches attention as is, with no host-side mask building), so one capture serves
    every step of every batch of this shape. With a `sampler` the captured step also chooses the next token and
    does the loop's bookkeeping on the device (`_choose`: sequence buffer, stop flags, the next step's inputs);
    without one it is the forward alone, fed by `feed` (the benchmarks' checks). On CUDA the model's attention
    becomes `evals.decode_attention` (`own_attention`; one-token steps take its kernel, prefill stays on SDPA).
    On a hybrid, the cache also holds each Mamba layer's convolution window and SSM state, and the prefill, the
    capture and eager steps run inside `_kernels` (the mixers' cached forward on `evals.decode_hybrid`'s kernels,
    grouped-matmul experts on CUDA)."""

    def __init__(self, model: PreTrainedModel, batch: int, width: int, new_tokens: int,
                 sampler: _Sampler | None = None, own_attention: bool = True, fuse: bool = True):
        self.model, self.width, self.sampler, device = model, width, sampler, model.device
        self.fused = fusable(model) if device.type == "cuda" and fuse else []
        self.hybrid = decode_hybrid.kernels_for(device) if decode_hybrid.is_hybrid(model) else None
        if device.type == "cuda" and own_attention:
            model.set_attn_implementation(decode_attention.register())
        length = width + new_tokens
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.slot = torch.full((1,), width, dtype=torch.long, device=device)  # the cache slot `token` goes to
        self.bias = torch.zeros((batch, 1, 1, length), dtype=model.dtype, device=device)
        self.seqs = torch.zeros((batch, length), dtype=torch.long, device=device)
        self.col = torch.full((1,), width, dtype=torch.long, device=device)  # the column the next choice goes to
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.alive = torch.ones(new_tokens, dtype=torch.bool, device=device)  # alive[t]: a row still runs after t
        self.stop_t = torch.tensor(sampler.stops if sampler else [], dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits = None
        # A captured step with a choice ends by opening the next slot, so it needs two new tokens at least.
        self.capture_s = 0.0  # seconds its warm-up and graph capture took (an eval job's start-up, core/wall.py)
        if device.type == "cuda" and new_tokens > 1:
            began = time.perf_counter()
            self._capture()
            self.capture_s = time.perf_counter() - began

    def _forward(self) -> torch.Tensor:
        mask = self.bias if self.hybrid is None else decode_hybrid.decode_masks(self.bias)
        return self.model(input_ids=self.token, attention_mask=mask, position_ids=self.position,
                          cache=self.cache, cache_position=self.slot, use_cache=True).logits

    @contextmanager
    def _kernels(self, fused: bool = False, step: bool = True) -> Iterator[None]:
        """What a step runs inside: the compiled pieces (`fused`: while capturing) and, on a hybrid, the mixers'
        cached forward and, on CUDA, experts a capture can run (`step`). A prefill keeps the model's own experts:
        float32's capturable ones (batched) gather each token's expert weights, 114 GiB for the float32 check's 8
        prompts on 30B-A3B (the H100, 2026-12-05)."""
        with ExitStack() as stack:
            if fused:
                stack.enter_context(fused_pieces(self.fused))
            if self.hybrid is not None:
                stack.enter_context(decode_hybrid.bind(self.model, self.hybrid))
                if self.model.device.type == "cuda" and step:
                    stack.enter_context(decode_hybrid.use_capturable_experts(self.model))
            yield

    def _step(self) -> torch.Tensor:
        logits = self._forward()
        if self.sampler is not None:
            self._choose(logits[:, -1].float())
        return logits

    def _choose(self, logits: torch.Tensor) -> None:
        """Chooses the token at column `col` from float32 `logits`, as `generate` does (pad once a row has stopped),
        records it and whether any row still runs, and makes it the next forward's input: device ops only."""
        token = torch.where(self.unfinished, self.sampler(self.seqs, logits), self.sampler.pad)
        self.seqs.index_copy_(1, self.col, token[:, None])
        self.unfinished &= ~(token[:, None] == self.stop_t).any(-1)
        self.alive.index_copy_(0, self.col - self.width, self.unfinished.any()[None])
        self.col.add_(1)
        self._next_inputs(token)

    def _next_inputs(self, token: torch.Tensor) -> None:
        self.token.copy_(token[:, None])
        self.slot.add_(1)
        self.position.add_(1)
        self.bias.index_fill_(-1, self.slot, 0)

    def _capture(self) -> None:
        # Warm-up on a side stream first (lazy cache and library initialisation must not be captured); what it
        # writes (cache, buffers) is reset by the next prefill. Each warm-up starts at the first decode slot. The
        # warm-up's draws would move the seeded generator on: its state is put back, so a call that captures
        # draws what a call reusing the capture draws (a replicate does not depend on what was captured before).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with self._kernels(fused=True), torch.random.fork_rng(devices=[self.model.device]):
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.slot.fill_(self.width)
                    self.col.fill_(self.width)
                    self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.slot.fill_(self.width)
            self.col.fill_(self.width)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._step()

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Fills the cache with the prompts and resets the step's buffers; returns the last logits (float32)."""
        self.cache.reset()
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as `generate` derives them
        with self._kernels(step=False):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache,
                             cache_position=torch.arange(self.width, device=ids.device), use_cache=True,
                             logits_to_keep=1)
        self.bias.fill_(torch.finfo(self.bias.dtype).min)
        self.bias[:, 0, 0, : self.width].masked_fill_(mask.bool(), 0)
        self.position.copy_(positions[:, -1:])
        self.slot.fill_(self.width - 1)  # _next_inputs moves it to the first decode slot
        self.col.fill_(self.width)
        self.seqs[:, : self.width] = ids
        self.seqs[:, self.width :] = ids[:, -1:]  # a token already in each row: see _Sampler
        self.unfinished.fill_(True)
        self.alive.fill_(True)
        return out.logits[:, -1].to(copy=True, dtype=torch.float32)

    def choose(self, logits: torch.Tensor) -> None:
        """The first new token, from the prefill's logits (outside the graph)."""
        self._choose(logits)

    def advance(self) -> None:
        """One decode step: the forward of the last chosen token and, with a sampler, the choice of the next."""
        if self.graph is None:
            with self._kernels():
                self.logits = self._step()
        else:
            self.graph.replay()

    def feed(self, token: torch.Tensor) -> torch.Tensor:
        """Without a sampler: the forward of `token` at the next slot; returns its logits (float32)."""
        self._next_inputs(token)
        self.advance()
        # A copy: the graph writes its output in place at every replay, and `.float()` of float32 logits (the
        # hybrid upcasts its logits) would return a view of that one buffer.
        return self.logits[:, -1].to(dtype=torch.float32, copy=True)


def _decode_static(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig,
                   stops: list[int], decoders: OrderedDict,
                   check_every: int | None = None) -> torch.Tensor:
    """`generate`'s sampling loop (processors, multinomial or argmax, pad after a stop) over a _Decoder whose step
    also chooses the token; the host checks for the end every `check_every` steps (None: STOP_CHECK_EVERY when the
    step is a graph replay, else 1)."""
    batch, width = ids.shape
    n_new = config.max_new_tokens
    sampler = _Sampler(config, stops)
    key = (batch, width, n_new, sampler.key)
    if key not in decoders:
        while len(decoders) >= MAX_DECODERS:
            decoders.popitem(last=False)
        decoders[key] = _Decoder(model, batch, width, n_new, sampler)
    decoders.move_to_end(key)
    decoder = decoders[key]
    decoder.choose(decoder.prefill(ids, mask))
    if check_every is None:
        check_every = STOP_CHECK_EVERY if decoder.graph is not None else 1
    for t in range(n_new):
        if t:
            decoder.advance()
        if t == n_new - 1 or (t + 1) % check_every == 0:
            done = (~decoder.alive[: t + 1]).nonzero()
            if t == n_new - 1 or len(done):  # cut at the first step after which every row had stopped
                return decoder.seqs[:, width : width + (int(done[0]) if len(done) else t) + 1].clone()
    raise AssertionError("unreachable: the loop returns at its last step")


def answer_logprobs(loaded: Loaded, items: Sequence[Item], answers: Sequence[str], decoding: Decoding,
                    batch_size: int = 16) -> list[float]:
    """Summed log-probability of each answer (its content and end-of-turn token) after its prompt.

    The conversation is rendered by the one renderer with the served system prompt; its loss mask
    marks exactly the answer tokens, so the sum covers what the model would have to generate.
    """
    tok = loaded.tokenizer
    system = decoding.system_prompt or None
    rows = [render(tok, [*item.messages, {"role": "assistant", "content": answer}], system)
            for item, answer in zip(items, answers, strict=True)]
    sums: list[float] = []
    for start in range(0, len(rows), batch_size):
        sums.extend(_batch_logprobs(loaded, rows[start:start + batch_size], tok.pad_token_id))
    return sums


def _batch_logprobs(loaded: Loaded, rows: list, pad_id: int) -> list[float]:
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    target = torch.zeros_like(ids)
    for k, r in enumerate(rows):
        n = len(r.input_ids)
        ids[k, :n] = torch.tensor(r.input_ids)
        mask[k, :n] = 1
        target[k, :n] = torch.tensor(r.loss_mask)
    ids, mask, target = ids.to(loaded.device), mask.to(loaded.device), target.to(loaded.device)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids, attention_mask=mask).logits.float()
    # Token t is predicted by position t-1.
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (logp * target[:, 1:]).sum(dim=1).tolist()
