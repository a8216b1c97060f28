"""The generation engine: batched, left-padded generation at a candidate's served decoding.

A model is loaded once (`load`) and then answers every suite of a job. Prompts are rendered by the
one chat renderer (`core.chat.render_prompt`) with the decoding's system prompt, sorted by
length so each batch wastes little padding, left-padded (new tokens then line up at the right
edge) and decoded with exactly the served settings: greedy or temperature/top_p (top_k off, since
a served decoding has none), repetition penalty, max new tokens and stop ids.

`static_cache=True` (GPU) uses a preallocated KV cache, which transformers compiles with CUDA graphs
("reduce-overhead"): decode then stops paying Python and kernel-launch overhead per step, the
bottleneck of eager decoding (bench/gen_throughput.py). Prompt widths are rounded up to a
multiple of `WIDTH_BUCKET` so a few compiled shapes serve a whole job. Outputs are the same
tokens under greedy decoding up to floating-point reassociation.

Seeding: the global torch generator is seeded once per call; with the same items, decoding, seed
and batch size a replicate is reproducible. Different seeds give the sampling replicates of a
noise floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer

from core.chat import render, render_prompt
from evals.decoding import Decoding
from evals.types import Completion, Item, completion_from_text


@dataclass(frozen=True)
class Loaded:
    """A model and its tokenizer, loaded once per job."""

    model: PreTrainedModel
    tokenizer: Tokenizer
    device: torch.device


def load(path: str | Path, device: str = "cpu", dtype: str = "float32") -> Loaded:
    """Load a causal LM checkpoint directory (weights and tokenizer) for evaluation."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return Loaded(model=model, tokenizer=tokenizer, device=torch.device(device))


def stop_ids(loaded: Loaded, decoding: Decoding) -> list[int]:
    """The served stop ids; a decoding without any falls back to the checkpoint's generation config."""
    if decoding.stop_token_ids:
        return list(decoding.stop_token_ids)
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        raise ValueError("decoding has no stop_token_ids and the checkpoint's generation config no eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos)


WIDTH_BUCKET = 64


def generation_config(decoding: Decoding, stops: list[int], pad_id: int, static_cache: bool = False) -> GenerationConfig:
    # top_k=0: a served decoding has no top-k, and transformers would otherwise default it to 50.
    sampled = {} if decoding.greedy else {"temperature": decoding.temperature, "top_p": decoding.top_p, "top_k": 0}
    return GenerationConfig(
        do_sample=not decoding.greedy, repetition_penalty=decoding.repetition_penalty,
        max_new_tokens=decoding.max_new_tokens, eos_token_id=stops, pad_token_id=pad_id, **sampled,
        **({"cache_implementation": "static"} if static_cache else {}),
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
    config = generation_config(decoding, stops, pad_id, static_cache)
    order = sorted(range(len(items)), key=lambda i: len(prompts[i]))
    out: dict[int, Completion] = {}
    torch.manual_seed(seed)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        ids, mask = _left_pad([prompts[i] for i in batch], pad_id, loaded.device,
                              WIDTH_BUCKET if static_cache else 1)
        with torch.inference_mode():
            seqs = loaded.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        for row, i in enumerate(batch):
            new = seqs[row, ids.shape[1]:].tolist()
            out[i] = _record(items[i].id, new, stops, tok)
    return [out[i] for i in range(len(items))]


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
