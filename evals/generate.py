"""The generation engine: batched, left-padded generation at a candidate's served decoding.

A model is loaded once (`load`) and then answers every suite of a job. Prompts are rendered by the
one chat renderer (`core.chat.render_prompt`) with the decoding's system prompt, sorted by
length so each batch wastes little padding, left-padded (new tokens then line up at the right
edge) and decoded with exactly the served settings: greedy or temperature/top_p (top_k off, since
a served decoding has none), repetition penalty, max new tokens and stop ids.

`static_cache=True` runs the engine's own decode loop over a preallocated KV cache (attention-only
models; recurrent ones keep `model.generate`): the prompt is prefilled once, then every decode
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
CUDA replicate is reproducible but its later batches' draws differ from `generate`'s. Prompt widths are rounded up to a multiple of `WIDTH_BUCKET` so a few
captured shapes serve a whole call. Logits go through transformers' own repetition-penalty,
temperature and top-p processors and `torch.multinomial`, step for step as `generate` does, so the
tokens are `generate`'s up to floating-point reassociation (tests/evals/test_engine_job.py).

Seeding: the global torch generator is seeded once per call; with the same items, decoding, seed
and batch size a replicate is reproducible. Different seeds give the sampling replicates of a
noise floor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    StaticCache,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)
from transformers import PreTrainedTokenizerBase as Tokenizer

from core.chat import render, render_prompt
from evals import decode_attention
from evals.decoding import Decoding
from evals.types import Completion, Item, completion_from_text


@dataclass(frozen=True)
class Loaded:
    """A model and its tokenizer, loaded once per job; `decoders` keeps the static loop's captured shapes across
    the job's generate calls (its suites), the MAX_DECODERS most recently used."""

    model: PreTrainedModel
    tokenizer: Tokenizer
    device: torch.device
    decoders: OrderedDict = field(default_factory=OrderedDict, repr=False, compare=False)


def load(path: str | Path, device: str = "cpu", dtype: str = "float32") -> Loaded:
    """Load a causal LM checkpoint directory (weights and tokenizer) for evaluation."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    # A checkpoint saved mid-training may say use_cache = false; generate() would then re-run the whole prefix at
    # every token (the model's generation config overrides a passed config's defaults).
    model.config.use_cache = True
    model.generation_config.use_cache = True
    return Loaded(model=model, tokenizer=tokenizer, device=torch.device(device))


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
# static-cache loop serves these; others (Mamba hybrids keep recurrent state) go through `generate`.
STATIC_LOOP_MODEL_TYPES = {"llama", "qwen2", "qwen3"}


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


def generate(loaded: Loaded, items: Sequence[Item], decoding: Decoding, seed: int,
             batch_size: int = 64, static_cache: bool = False) -> list[Completion]:
    """One completion per item, in item order, at `decoding` with sampling seed `seed`."""
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id
    if pad_id is None:
        raise ValueError("tokenizer has no pad token; left padding needs one")
    system = decoding.system_prompt or None
    prompts = [render_prompt(tok, item.messages, system) for item in items]
    stops = stop_ids(loaded, decoding)
    config = generation_config(decoding, stops, pad_id)
    order = sorted(range(len(items)), key=lambda i: len(prompts[i]))
    out: dict[int, Completion] = {}
    own_loop = static_cache and loaded.model.config.model_type in STATIC_LOOP_MODEL_TYPES
    torch.manual_seed(seed)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        ids, mask = _left_pad([prompts[i] for i in batch], pad_id, loaded.device,
                              WIDTH_BUCKET if static_cache else 1)
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


class _Decoder:
    """A static KV cache for one (batch, width) shape and one decode step over it, replayed as a CUDA graph.

    The step reads its token, position and cache slot from fixed buffers and its attention from an
    additive [B, 1, 1, L] mask (a 4D mask reaches attention as is, with no host-side mask building),
    so one capture serves every step of every batch of this shape. On CUDA the model's attention becomes
    `evals.decode_attention` (`own_attention`; one-token steps take its kernel, prefill stays on SDPA)."""

    def __init__(self, model: PreTrainedModel, batch: int, width: int, new_tokens: int, own_attention: bool = True,
                 fuse: bool = True):
        self.model, self.width, device = model, width, model.device
        self.fused = fusable(model) if device.type == "cuda" and fuse else []
        if device.type == "cuda" and own_attention:
            model.set_attn_implementation(decode_attention.register())
        length = width + new_tokens
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.slot = torch.full((1,), width, dtype=torch.long, device=device)
        self.bias = torch.zeros((batch, 1, 1, length), dtype=model.dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if device.type == "cuda":
            self._capture()

    def _forward(self) -> torch.Tensor:
        return self.model(input_ids=self.token, attention_mask=self.bias, position_ids=self.position,
                          past_key_values=self.cache, cache_position=self.slot, use_cache=True).logits

    def _capture(self) -> None:
        # Warm-up on a side stream first (lazy cache and library initialisation must not be captured);
        # what it writes into the cache is cleared by the reset before each batch's prefill.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with fused_pieces(self.fused):
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fills the cache with the prompts; returns the last logits (float32) and each row's last position."""
        self.cache.reset()
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as `generate` derives them
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                         cache_position=torch.arange(self.width, device=ids.device), use_cache=True,
                         logits_to_keep=1)
        self.bias.fill_(torch.finfo(self.bias.dtype).min)
        self.bias[:, 0, 0, : self.width].masked_fill_(mask.bool(), 0)
        return out.logits[:, -1].to(copy=True, dtype=torch.float32), positions[:, -1:]

    def step(self, token: torch.Tensor, position: torch.Tensor, t: int) -> torch.Tensor:
        """Feeds `token` at decode step t (cache slot width + t); returns the next logits (float32)."""
        self.token.copy_(token[:, None])
        self.position.copy_(position)
        self.slot.fill_(self.width + t)
        self.bias[:, 0, 0, self.width + t] = 0
        if self.graph is None:
            return self._forward()[:, -1].float()
        self.graph.replay()
        return self.logits[:, -1].float()


def _decode_static(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig,
                   stops: list[int], decoders: OrderedDict,
                   check_every: int | None = None) -> torch.Tensor:
    """`generate`'s sampling loop (processors, multinomial or argmax, pad after a stop) over a _Decoder; the host
    checks for the end every `check_every` steps (None: STOP_CHECK_EVERY when the step is a graph replay, else 1)."""
    batch, width = ids.shape
    n_new = config.max_new_tokens
    key = (batch, width, n_new)
    if key not in decoders:
        while len(decoders) >= MAX_DECODERS:
            decoders.popitem(last=False)
        decoders[key] = _Decoder(model, batch, width, n_new)
    decoders.move_to_end(key)
    decoder, procs = decoders[key], _processors(config)
    seqs = torch.full((batch, width + n_new), config.pad_token_id, dtype=torch.long, device=ids.device)
    seqs[:, :width] = ids
    stop_t = torch.tensor(stops, device=ids.device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=ids.device)
    logits, position = decoder.prefill(ids, mask)
    if check_every is None:
        check_every = STOP_CHECK_EVERY if decoder.graph is not None else 1
    alive = torch.ones(n_new, dtype=torch.bool, device=ids.device)  # alive[t]: some row still running after step t
    for t in range(n_new):
        scores = procs(seqs[:, : width + t], logits)
        if config.do_sample:
            token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            token = scores.argmax(dim=-1)
        token = torch.where(unfinished, token, config.pad_token_id)
        seqs[:, width + t] = token
        unfinished &= ~torch.isin(token, stop_t)
        alive[t] = unfinished.any()  # on the device: no wait here
        if t == n_new - 1 or (t + 1) % check_every == 0:
            done = (~alive[: t + 1]).nonzero()
            if t == n_new - 1 or len(done):  # cut at the first step after which every row had stopped
                return seqs[:, width : width + (int(done[0]) if len(done) else t) + 1]
        logits = decoder.step(token, position + 1 + t, t)
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
