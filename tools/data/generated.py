"""Dataset builders that generate with a model: the model's own answers, kept as training data.

    own_replay       the model's own answers to prompts of the lab's replay data ([[data]] chat sources): SFT rows a
                     KL-CE mix carries as KL-only replay (own-policy replay: the leash reads the policy's own
                     distribution, not another model's answers)
    loop_fix_pairs   preference pairs on the lab's own decisive train battles: the human-preferred answer chosen
                     over the model's own answer to the same prompt where that answer loops or does not stop within
                     the served cap (loop-fix pairs). Only the lab's feedback: no generated task, no toy-world data

Each is a plain function of one pydantic config, like every builder of tools/data/datasets.py, and goes through
the same leak audit and manifest. They run as jobs on the device their resources name (`device`, `dtype`), at
the model's served decoding. Generation is imported in the job only: the agent process never loads a model.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from evals.decoding import Decoding
from evals.types import Item
from tools.data.datasets import (
    DatasetError,
    DatasetManifest,
    ReplaySource,
    SourceFile,
    _BuildConfig,
    _decisive_train,
    _finish,
    read_chat_rows,
    references,
    served,
)


class _GeneratingConfig(_BuildConfig):
    model: Path = Field(description="The model whose own answers are generated (a checkpoint directory).")
    decoding: dict[str, Any] = Field(description="The model's served decoding (evals.decoding.Decoding as JSON).")
    system_prompt: str = Field(description="The serving system prompt the rows are rendered under ('' for none).")
    seed: int = Field(0, description="Sampling seed of the prompts and of the generation.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model generates (from the job's resources).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="The model's compute dtype.")
    batch_size: int = Field(64, ge=1, description="Prompts generated together.")


class OwnReplayConfig(_GeneratingConfig):
    sources: list[ReplaySource] = Field(min_length=1, description="Local chat datasets whose prompts are answered.")
    n: int = Field(gt=0, description="Prompts answered (seeded sample over every source's rows).")


class LoopFixConfig(_GeneratingConfig):
    n: int | None = Field(None, gt=0, description="Decisive train battles whose prompts the model answers (a seeded "
                          "sample, battle order kept); all of them when unset.")


def _answers(cfg: _GeneratingConfig, items: list[Item]) -> list[Any]:
    from evals.generate import generate as sample
    from evals.generate import load

    loaded = load(cfg.model, device=cfg.device, dtype=cfg.dtype)
    return sample(loaded, items, Decoding.model_validate(cfg.decoding), cfg.seed, batch_size=cfg.batch_size)


def build_own_replay(cfg: OwnReplayConfig) -> DatasetManifest:
    """SFT rows: prompts of the replay data answered by the model itself (its answers, not the data's)."""
    refs, _, _ = references(cfg)
    pool, files = [], []
    for src in cfg.sources:
        rows = read_chat_rows(src.path)
        pool += [(f"{src.name}:{i + 1}", r["messages"][:-1]) for i, r in enumerate(rows) if len(r["messages"]) > 1]
        files.append(SourceFile(role="replay", path=str(src.path), sha256=_sha(src.path)))
    picked = sorted(random.Random(f"{cfg.seed}:own_replay").sample(range(len(pool)), min(cfg.n, len(pool))))
    items = [Item(id=pool[i][0], messages=pool[i][1]) for i in picked if pool[i][1][-1]["role"] == "user"]
    if not items:
        raise DatasetError("own_replay: the replay sources hold no prompt ending in a user turn")
    answers = _answers(cfg, items)
    rows = [{"id": item.id, "messages": [*served([m.model_dump() for m in item.messages], cfg.system_prompt),
                                         {"role": "assistant", "content": a.text}]}
            for item, a in zip(items, answers, strict=True) if a.text.strip()]
    if not rows:
        raise DatasetError(f"own_replay: the model answered none of {len(items)} prompts with any text")
    stats = {"prompts": len(items), "answered": len(rows), "stopped": sum(a.stopped for a in answers)}
    return _finish("own_replay", "sft", cfg, rows, refs, files, stats)


def build_loop_fix_pairs(cfg: LoopFixConfig) -> DatasetManifest:
    """Pairs on the lab's decisive train battles (never a holdout's): the human-preferred answer chosen over the
    model's own answer to the battle's prompt where that answer loops (evals/loops.py) or runs to the served cap
    without stopping. The prompt keeps the battle's own system turn (the serving one only where it has none)."""
    from evals import loops

    refs, battles, split = references(cfg)
    decisive, _ = _decisive_train(battles, split)
    if cfg.n is not None and cfg.n < len(decisive):
        keep = set(random.Random(f"{cfg.seed}:loop_fix").sample(range(len(decisive)), cfg.n))
        decisive = [b for k, b in enumerate(decisive) if k in keep]
    if not decisive:
        raise DatasetError(f"loop_fix_pairs: {cfg.feedback} has no decisive train battle whose prompt the model "
                           "could answer")
    items = [Item(id=b.id, messages=tuple(b.messages)) for b in decisive]
    answers = _answers(cfg, items)
    looping = [o.values.get("looping", 0.0) > 0 for o in loops.score(items, answers)]
    rows, stats = [], {"prompts": len(items), "looping": sum(looping), "not_stopped": sum(not a.stopped for a in answers)}
    for b, a, loop in zip(decisive, answers, looping, strict=True):
        if (loop or not a.stopped) and a.text.strip() and a.text.strip() != b.preferred.strip():
            rows.append({"id": b.id, "prompt": served([m.model_dump() for m in b.messages], cfg.system_prompt),
                         "chosen": b.preferred, "rejected": a.text})
    if not rows:
        raise DatasetError(f"loop_fix_pairs: none of the model's {len(items)} answers looped or ran past the served "
                           "cap: nothing to fix")
    return _finish("loop_fix_pairs", "pairs", cfg, rows, refs, [], stats | {"pairs": len(rows)})


def _sha(path: Path) -> str:
    from core.util import file_sha256

    return file_sha256(path)


BUILDERS = {
    "own_replay": (OwnReplayConfig, build_own_replay),
    "loop_fix_pairs": (LoopFixConfig, build_loop_fix_pairs),
}
