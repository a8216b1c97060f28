"""The toy world's parts for the seeds' recipes, built with the rest of the world (tools/world/build.py):

- a reward model trained on the world's battles: a tiny Llama with a one-output classification head
  (`core.tiny.build_reward_model`), fitted to the votes with the Bradley-Terry loss
  -log sigmoid(r(chosen) - r(rejected)) (Ouyang et al. 2022, "Training language models to follow instructions with
  human feedback", section 3.5) on every decisive battle. With `[judge] kind = "reward_model"` and its path in
  lab.toml it scores the judge suites as reward-proxy suites (agent/runner.py; evals/reward_proxy.py). It has seen
  the battles a session holds out: a proxy of the votes, not an independent judge (the card says so of any
  reward-proxy number);
- a verified item pool apart from every other prompt pool of the world (the leak index they share keeps them
  disjoint), checked by the synthetic suite's scorer: the lab's own verified data for RFT (lab.toml [[data]]
  kind = "verified"), never an eval file.

The battle-margin suite needs no part of its own: a `battle_margin` suite without a file scores the session's dev
battles (tools/ingest.py writes them at the split).
"""

from __future__ import annotations

import random
from pathlib import Path

from tools.data.leak import DEFAULT_NGRAM, Reference, ReferenceIndex
from tools.world.tasks import WORLD_FAMILIES, WorldTask, draw_mix, hash_seed

REWARD_MODEL = "world/models/reward"
VERIFIED_POOL = "world/data/verified.jsonl"
# Families the synthetic suite's scorer checks (the world's synthetic suite draws from these too).
VERIFIED_FAMILIES = WORLD_FAMILIES[:6]
REWARD_STEPS = 120
REWARD_BATCH = 16
REWARD_LR = 1e-3


def verified_pool(seed: int, n: int, taken: list[WorldTask]) -> list[WorldTask]:
    """`n` checkable tasks none of whose prompts the leak audit matches against the world's other pools (`taken`)."""
    index = ReferenceIndex([Reference(source="world", key=t.id, text=t.prompt()) for t in taken], DEFAULT_NGRAM)
    return draw_mix(n, hash_seed(seed, "verified"), index, "verified", VERIFIED_FAMILIES)


def _pairs(battles: list[dict]) -> list[tuple[list[dict], str, str]]:
    """(conversation, chosen, rejected) of every decisive battle."""
    out = []
    for b in battles:
        if b["vote"] in ("own", "other"):
            chosen, rejected = (b["own"], b["other"]) if b["vote"] == "own" else (b["other"], b["own"])
            out.append((b["messages"], chosen, rejected))
    return out


def train_reward_model(tokenizer_dir: Path, out: Path, battles: list[dict], seed: int) -> dict[str, float]:
    """Build the tiny reward model into `out` and fit it to the battles' votes; returns its pairwise accuracy on
    them before and after (what the build records in world.json)."""
    import torch
    import torch.nn.functional as F

    from core import loading, tiny

    tiny.build_reward_model(tokenizer_dir, out, seed=seed % 2**31)
    tok = loading.load_tokenizer(out)
    model = loading.load_sequence_classifier(out, dtype=torch.float32)
    pairs = _pairs(battles)

    def rewards(batch: list[tuple[list[dict], str, str]], side: int) -> torch.Tensor:
        # The reward model reads the conversation as its chat template renders it, as evals/reward_proxy.py does.
        texts = [tok.apply_chat_template([*m, {"role": "assistant", "content": p[side - 1]}], tokenize=False)
                 for m, *p in batch]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        return model(**enc).logits[:, 0]

    def accuracy() -> float:
        with torch.inference_mode():
            return sum(float((rewards(pairs[i:i + 64], 1) > rewards(pairs[i:i + 64], 2)).sum())
                       for i in range(0, len(pairs), 64)) / max(len(pairs), 1)

    before = accuracy()
    torch.manual_seed(seed % 2**31)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=REWARD_LR)
    model.train()
    for _ in range(REWARD_STEPS):
        batch = rng.sample(pairs, min(REWARD_BATCH, len(pairs)))
        loss = -F.logsigmoid(rewards(batch, 1) - rewards(batch, 2)).mean()  # Bradley-Terry on the votes
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    after = accuracy()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"pairs": float(len(pairs)), "accuracy_before": before, "accuracy_after": after}
