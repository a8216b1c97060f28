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

A prompt is answered only when it fits (`prompt_limit`): its rendered tokens plus the served max_new_tokens within
the model's context (config.json max_position_embeddings), and, with a [train] max_len, below it (a row whose prompt
fills max_len trains on nothing). The others are skipped and counted in the manifest (`too_long`), before sampling,
so `n` counts prompts that fit; `length_refusal` says, before the job is submitted, when none would fit.
"""

from __future__ import annotations

import json
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
    max_len: int | None = Field(None, gt=1, description="The [train] max_len the rows train under (a prompt must "
                                "leave room for its answer); None: the model's context only.")


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


def prompt_limit(cfg: _GeneratingConfig) -> tuple[int, str] | None:
    """(the most prompt tokens a generated row may have, why), or None when the model states no context and no
    max_len is given. Read from the model's config.json: no weights are loaded."""
    try:
        context = json.loads((Path(cfg.model) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        context = None
    limits = []
    if isinstance(context, int) and not isinstance(context, bool) and context > 0:
        new_tokens = Decoding.model_validate(cfg.decoding).max_new_tokens
        limits.append((context - new_tokens, f"the model's context of {context} tokens (config.json "
                                             f"max_position_embeddings) less the served max_new_tokens {new_tokens}"))
    if cfg.max_len is not None:
        limits.append((cfg.max_len - 1, f"[train] max_len {cfg.max_len} less one answer token"))
    return min(limits) if limits else None


def fitting(cfg: _GeneratingConfig, items: list[Item]) -> list[bool]:
    """Whether each item's prompt, rendered as the job renders it (the served system prompt, the model's template),
    fits `prompt_limit`."""
    found = prompt_limit(cfg)
    if found is None or not items:
        return [True] * len(items)
    from core.chat import render_prompt
    from core.loading import load_tokenizer

    tok, limit = load_tokenizer(cfg.model), found[0]
    # Work bound: a prompt of more characters than 64 per token of the limit is over it whatever its tokens.
    return [sum(len(m.content) for m in item.messages) <= 64 * max(limit, 1)
            and len(render_prompt(tok, item.messages, cfg.system_prompt or None)) <= limit for item in items]


def _replay_pool(cfg: OwnReplayConfig) -> tuple[list[Item | None], list[SourceFile]]:
    """Every row's prompt (its turns before the answer) of the replay sources, as an item, None where it does not
    end in a user turn (the sample is drawn over all of them), with the source files."""
    pool, files = [], []
    for src in cfg.sources:
        rows = read_chat_rows(src.path)
        pool += [Item(id=f"{src.name}:{i + 1}", messages=r["messages"][:-1]) if r["messages"][-2]["role"] == "user"
                 else None for i, r in enumerate(rows) if len(r["messages"]) > 1]
        files.append(SourceFile(role="replay", path=str(src.path), sha256=_sha(src.path)))
    return pool, files


def _loop_fix_pool(cfg: LoopFixConfig) -> list:
    _, battles, split = references(cfg)
    return _decisive_train(battles, split)[0]


def length_refusal(builder: str, config: dict[str, Any]) -> str | None:
    """Before the job is submitted: the reason no prompt of the builder's pool fits `prompt_limit` (None when some
    do; the job skips the others and counts them)."""
    config_type, _ = BUILDERS[builder]
    cfg = config_type.model_validate(config)
    found = prompt_limit(cfg)
    if found is None:
        return None
    items = ([i for i in _replay_pool(cfg)[0] if i is not None] if builder == "own_replay" else
             [Item(id=b.id, messages=tuple(b.messages)) for b in _loop_fix_pool(cfg)])
    if not items or any(fitting(cfg, items)):
        return None
    return (f"{builder}: none of the {len(items)} prompts fits: each one's tokens exceed {found[0]}, {found[1]}; "
            "nothing to generate")


def build_own_replay(cfg: OwnReplayConfig) -> DatasetManifest:
    """SFT rows: prompts of the replay data answered by the model itself (its answers, not the data's)."""
    refs, _, _ = references(cfg)
    pool, files = _replay_pool(cfg)
    prompts = [item for item in pool if item is not None]
    fits = dict(zip((i.id for i in prompts), fitting(cfg, prompts), strict=True))
    too_long = sum(not ok for ok in fits.values())
    pool = [item for item in pool if item is None or fits[item.id]]  # prompts past the limit are never drawn
    picked = sorted(random.Random(f"{cfg.seed}:own_replay").sample(range(len(pool)), min(cfg.n, len(pool))))
    items = [pool[i] for i in picked if pool[i] is not None]
    if not items:
        raise DatasetError(f"own_replay: none of the {too_long} replay prompts fits {prompt_limit(cfg)[1]}" if too_long
                           else "own_replay: the replay sources hold no prompt ending in a user turn")
    answers = _answers(cfg, items)
    rows = [{"id": item.id, "messages": [*served([m.model_dump() for m in item.messages], cfg.system_prompt),
                                         {"role": "assistant", "content": a.text}]}
            for item, a in zip(items, answers, strict=True) if a.text.strip()]
    if not rows:
        raise DatasetError(f"own_replay: the model answered none of {len(items)} prompts with any text")
    stats = {"prompts": len(items), "answered": len(rows), "stopped": sum(a.stopped for a in answers),
             "too_long": too_long}
    return _finish("own_replay", "sft", cfg, rows, refs, files, stats)


def build_loop_fix_pairs(cfg: LoopFixConfig) -> DatasetManifest:
    """Pairs on the lab's decisive train battles (never a holdout's): the human-preferred answer chosen over the
    model's own answer to the battle's prompt where that answer loops (evals/loops.py) or runs to the served cap
    without stopping. The prompt keeps the battle's own system turn (the serving one only where it has none)."""
    from evals import loops

    refs, battles, split = references(cfg)
    decisive, _ = _decisive_train(battles, split)
    fits = fitting(cfg, [Item(id=b.id, messages=tuple(b.messages)) for b in decisive])
    too_long, decisive = fits.count(False), [b for b, ok in zip(decisive, fits, strict=True) if ok]
    if cfg.n is not None and cfg.n < len(decisive):
        keep = set(random.Random(f"{cfg.seed}:loop_fix").sample(range(len(decisive)), cfg.n))
        decisive = [b for k, b in enumerate(decisive) if k in keep]
    if not decisive:
        fit = f" within {prompt_limit(cfg)[1]} ({too_long} longer)" if too_long else ""
        raise DatasetError(f"loop_fix_pairs: {cfg.feedback} has no decisive train battle whose prompt the model "
                           f"could answer{fit}")
    items = [Item(id=b.id, messages=tuple(b.messages)) for b in decisive]
    answers = _answers(cfg, items)
    looping = [o.values.get("looping", 0.0) > 0 for o in loops.score(items, answers)]
    rows, stats = [], {"prompts": len(items), "looping": sum(looping), "not_stopped": sum(not a.stopped for a in answers),
                       "too_long": too_long}
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
