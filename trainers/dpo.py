"""DPO with an NLL term on the chosen answer: `DPOConfig` and the `train` job.

Per pair, with summed token log-probs of the assistant answer (content + its end-of-turn token) under the
policy (pi) and the frozen reference (ref):

    L = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))  +  nll_weight * (-pi_c / n_c)

The first term is sigmoid DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7); the
second is the chosen answer's per-token negative log-likelihood (Pang et al. 2024, "Iterative
Reasoning Preference Optimization", eq. 3). The step loss is the mean over pairs.

Reference log-probs are computed once and cached to `<ref_cache_dir>/<key>.json`, the key hashing
the data file, the reference weights, the tokenizer and the rendering settings, so a rerun on the
same data and reference does not recompute them. A held-out split of pairs (chosen by row hash,
independent of file order) never trains; the result reports reward accuracy and mean reward margin
(reward = beta * (pi - ref)) on it.

Why not TRL's DPOTrainer (which has loss_type=["sigmoid","sft"]): its reference log-probs are
recomputed per run (no cache keyed by reference weights), and its resume contract differs from the
one all trainers here share (`trainers/loop.py`). TRL is the reference for the loss instead
(tests/trainers/test_trl_reference.py): on the same ids and mask the sigmoid term is TRL's; TRL's
"sft" term averages over all chosen tokens of the batch, ours over pairs (each pair weighs the same),
so the two agree when the chosen answers have equal lengths.

Command:

    .venv/bin/python -m trainers.dpo CONFIG.json
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from core.util import file_sha256, write_json_atomic
from trainers import data_cache, distributed, losses
from trainers.batch import Encoded, check_supervised, pad_batch
from trainers.common import (
    ConfigError,
    TrainConfig,
    TrainResult,
    check_lora_targets,
    finished_result,
    load_frozen,
    load_tokenizer,
    weights_sha256,
)
from trainers.loop import MicroLoss, run_job
from trainers.rows import PreferenceRow, read_rows

CACHE_FORMAT = 2  # bump when the rendering or the cached quantity changes


class DPOConfig(TrainConfig):
    """DPO + NLL; data rows are `trainers.rows.PreferenceRow`."""

    beta: float = Field(0.1, gt=0, description="DPO inverse temperature on the log-ratio margin.")
    nll_weight: float = Field(1.0, ge=0, description="Weight of the chosen answer's per-token NLL term.")
    reference_path: Path | None = Field(None, description="Frozen reference model directory; None = model_path.")
    ref_cache_dir: Path | None = Field(
        None, description="Where reference log-probs are cached; None = <data dir>/ref_logp_cache."
    )
    heldout_fraction: float = Field(0.1, ge=0, lt=1, description="Share of pairs held out for reward accuracy/margin.")
    max_prompt_length: int | None = Field(
        None, gt=0, description="Prompt tokens kept (the last ones: the prompt is cut from the left); None = all.")
    max_completion_length: int | None = Field(
        None, gt=0, description="Longest answer (content + end-of-turn tokens); a pair with a longer answer is "
        "dropped and counted (a preference voted on whole answers need not hold for cut ones); None = no limit.")

    @model_validator(mode="after")
    def _reference_exists(self) -> DPOConfig:
        if self.reference_path is not None and not (self.reference_path / "config.json").is_file():
            raise ValueError(f"reference_path: {self.reference_path} has no config.json")
        return self

    @property
    def reference(self) -> Path:
        return self.reference_path or self.model_path

    @property
    def cache_dir(self) -> Path:
        return self.ref_cache_dir or self.data_path.parent / "ref_logp_cache"


def split_heldout(rows: list[PreferenceRow], fraction: float) -> tuple[list[int], list[int]]:
    """(train, heldout) row indices: the ceil(fraction*n) rows with the smallest content hash are held out."""
    digests = [hashlib.sha256(r.model_dump_json().encode()).hexdigest() for r in rows]
    by_hash = sorted(range(len(rows)), key=lambda i: digests[i])
    k = math.ceil(fraction * len(rows))
    heldout = set(by_hash[:k])
    return [i for i in range(len(rows)) if i not in heldout], sorted(heldout)


def cache_key(config: DPOConfig) -> str:
    parts = {
        "format": CACHE_FORMAT, "data": file_sha256(config.data_path), "ref": weights_sha256(config.reference),
        "tokenizer": file_sha256(config.model_path / "tokenizer.json"), "system_prompt": config.system_prompt,
        "max_len": config.max_len, "dtype": config.compute_dtype,  # a BF16 reference gives other log-probs than FP32
        "max_prompt_length": config.max_prompt_length, "max_completion_length": config.max_completion_length,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@torch.no_grad()
def pair_logprobs(model, pairs: list[tuple[Encoded, Encoded]], pad_id: int, micro: int,
                  chunk: int = 1024) -> list[tuple[float, float]]:
    """(chosen, rejected) summed log-probs per pair; under several ranks each computes a share (frozen models are
    sharded, so every rank runs the same number of forwards) and all get every result."""
    def run(part):
        batch = pad_batch([c for c, _ in part] + [r for _, r in part], pad_id).to(model.device)
        logp = losses.sequence_logprobs(model, batch, chunk)
        return list(zip(logp[: len(part)].tolist(), logp[len(part):].tolist(), strict=True))

    return distributed.map_shared(run, pairs, micro)


def reference_logprobs(reference: Path, path: Path, pairs, pad_id: int, dtype: str, micro: int,
                       chunk: int = 1024) -> tuple[list[tuple[float, float]], bool]:
    """Reference log-probs per pair, cached at `path` (`cache_key`), and whether they came from the cache."""
    if path.is_file():
        return [None if x is None else tuple(x) for x in json.loads(path.read_text())["logps"]], True
    ref = load_frozen(reference, dtype)
    kept = [i for i, p in enumerate(pairs) if p is not None]
    computed = iter(pair_logprobs(ref, [pairs[i] for i in kept], pad_id, micro, chunk))
    logps = [next(computed) if p is not None else None for p in pairs]
    if distributed.setup().is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"reference": str(reference), "logps": logps})
    return logps, False


def chosen_nll(pi_c: torch.Tensor, n_c: torch.Tensor) -> torch.Tensor:
    """Per pair, the chosen answer's mean token NLL (Pang et al. 2024, eq. 3): every pair weighs the same,
    whatever its length (TRL's "sft" term instead averages over all chosen tokens of the batch)."""
    return -pi_c / n_c


class DPOObjective:
    """Sigmoid DPO + chosen NLL over the training pairs (loop rows index `train_ids`)."""

    def __init__(self, pairs, ref, train_ids: list[int], pad_id: int, beta: float, nll_weight: float,
                 chunk: int = 1024):
        self.pairs, self.ref, self.train_ids = pairs, ref, train_ids
        self.pad_id, self.beta, self.nll_weight, self.chunk = pad_id, beta, nll_weight, chunk
        self.n_rows = len(train_ids)

    def normalizer(self, rows: list[int]) -> float:
        return float(len(rows))

    def loss(self, model, rows: list[int], normalizer: float) -> MicroLoss:
        ids = [self.train_ids[i] for i in rows]
        chosen, rejected = [self.pairs[i][0] for i in ids], [self.pairs[i][1] for i in ids]
        host = pad_batch(chosen + rejected, self.pad_id)
        pos = losses.Positions.of(host)  # on the host: the forward never waits on the GPU (trainers/losses.py)
        batch = host.to(model.device)
        logp = losses.sequence_logprobs(model, batch, self.chunk, pos.to(model.device))
        pi_c, pi_r = logp[: len(ids)], logp[len(ids):]
        ref = torch.tensor([self.ref[i] for i in ids], device=logp.device)
        margin = self.beta * ((pi_c - ref[:, 0]) - (pi_r - ref[:, 1]))
        n_c = torch.tensor([c.supervised for c in chosen], dtype=torch.float32, device=logp.device)
        dpo = -F.logsigmoid(margin)
        nll = chosen_nll(pi_c, n_c)
        loss = (dpo + self.nll_weight * nll).sum() / normalizer
        dpo_d, nll_d, margin_d = dpo.detach(), nll.detach(), margin.detach()
        sums = torch.stack([dpo_d.sum(), nll_d.sum(), (margin_d > 0).float().sum(), margin_d.sum()]).tolist()
        metrics = {k: v / normalizer for k, v in zip(("dpo", "nll", "reward_accuracy", "reward_margin"), sums,
                                                     strict=True)}
        return MicroLoss(loss, host.tokens, pos.count, metrics)


def heldout_metrics(model, pairs, ref, heldout: list[int], pad_id: int, beta: float, micro: int,
                    chunk: int = 1024) -> dict[str, float]:
    """Reward accuracy and mean margin on held-out pairs (reward = beta * (pi - ref))."""
    if not heldout:
        return {}
    logps = pair_logprobs(model, [pairs[i] for i in heldout], pad_id, micro, chunk)
    margins = [beta * ((c - ref[i][0]) - (r - ref[i][1])) for i, (c, r) in zip(heldout, logps, strict=True)]
    return {"heldout_reward_accuracy": sum(m > 0 for m in margins) / len(margins),
            "heldout_reward_margin": sum(margins) / len(margins), "heldout_pairs": float(len(margins))}


def keep_pairs(ids: list[int], pairs: list) -> list[int]:
    return [i for i in ids if pairs[i] is not None]


def validate(config: DPOConfig) -> list[PreferenceRow]:
    """Every check that can fail before compute: data rows, the split, LoRA targets."""
    rows = read_rows(config.data_path, PreferenceRow)
    if not split_heldout(rows, config.heldout_fraction)[0]:
        raise ConfigError(f"heldout_fraction: {config.heldout_fraction} leaves no training pairs of {len(rows)}")
    if config.lora is not None:
        check_lora_targets(config.model_path, config.lora)
    return rows


def train(config: DPOConfig) -> TrainResult:
    """Runs (or resumes, or returns the finished result of) one DPO + NLL run."""
    rows = validate(config)
    done = finished_result(config)  # a requeued finished job does no compute
    if done is not None:
        return done
    tokenizer = load_tokenizer(config.model_path)
    pairs, _ = data_cache.encoded_pairs(rows, config.data_path, config.model_path, config.system_prompt,
                                        config.max_len, config.max_prompt_length, config.max_completion_length)
    kept = [p for p in pairs if p is not None]
    check_supervised([e for pair in kept for e in pair], config.data_path, config.max_len)
    # The split is drawn over all rows (stable whatever the length limits), then dropped pairs leave both sides.
    train_ids, heldout = (keep_pairs(ids, pairs) for ids in split_heldout(rows, config.heldout_fraction))
    if not train_ids:
        raise ConfigError(f"max_completion_length: {config.max_completion_length} drops every training pair")
    ref, cached = reference_logprobs(config.reference, config.cache_dir / f"{cache_key(config)}.json", pairs,
                                     tokenizer.pad_token_id, config.compute_dtype, config.micro_batch_size,
                                     config.loss_chunk_tokens)
    objective = DPOObjective(pairs, ref, train_ids, tokenizer.pad_token_id, config.beta, config.nll_weight,
                             config.loss_chunk_tokens)

    def final(model) -> dict[str, float]:
        extra = heldout_metrics(model, pairs, ref, heldout, tokenizer.pad_token_id, config.beta,
                                config.micro_batch_size, config.loss_chunk_tokens)
        return {**extra, "ref_logps_cached": float(cached), "dropped_pairs": float(len(pairs) - len(kept))}

    truncated = sum(c.truncated or r.truncated for c, r in kept)
    return run_job(config, objective, final_metrics=final, truncated_rows=truncated)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainers.dpo CONFIG.json`: runs DPO + NLL with the config file's settings."""
    from core.entry import run_main
    from trainers.common import ConfigError
    from trainers.rows import RowsError

    return run_main("python -m trainers.dpo", (DPOConfig, train), argv, bad_input=(ConfigError, RowsError))


if __name__ == "__main__":
    sys.exit(main())
