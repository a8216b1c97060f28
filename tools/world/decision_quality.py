"""Ground truth for judging a session's decisions: one fresh truth sample per world, answered once by each
checkpoint, so that any two of them are compared without generating again.

`world truth` (tools/world/truth.py) scores one checkpoint against one other; the decision-quality benchmark
needs every promotion (new incumbent vs the one it replaced), every candidate against the parent and each
baseline's nominee, a dozen pairs per session. A `TruthBank` draws the same sample `world truth --n N
--seed S` draws (the same generators, seed and leak audit), has each (weights, served decoding) answer it
once at its own sampling seed, caches the answers on disk, and judges any pair with the noise-free oracle
(win 1, tie or both-bad 0.5, loss 0; a 95% normal CI of the per-prompt mean, as `world truth` reports).

A pair of the same key (the same weights served the same way) is the same answers: every prompt ties and
the win rate is exactly 0.5, so such a "promotion" is never truly better.

`redraw_feedback` makes the benchmark's sessions cheap to set up: instead of a full world build per
session (tokenizer, pretraining, stage-1 SFT), every session gets a copy of one built world whose
feedback file is drawn afresh (new battle prompts, disjoint from the world's other pools under the leak
audit, answered by the same parent, voted by the same noisy oracle with a new seed). The parent, suites
and opponent stay; what differs between sessions is the feedback the agent learns and selects from,
its split, its sampling seeds and so its decisions.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from core.util import file_sha256, write_atomic, write_json_atomic
from evals.decoding import Decoding
from tools.data.leak import DEFAULT_NGRAM, Reference, ReferenceIndex, audit
from tools.world import oracle
from tools.world.build import (
    COMMIT,
    FEEDBACK,
    MANIFEST,
    PARENT,
    TOKENIZER,
    WORLD_DIR,
    WorldError,
    battles,
    draw_pools,
    load_spec,
    one_thread,
    served_decoding,
)
from tools.world.tasks import draw_mix, hash_seed
from tools.world.truth import draw_sample

SAMPLE = "sample.json"  # in a bank's cache: the truth sample's task ids, in order
_POINTS = {"A": 1.0, "B": 0.0, "tie": 0.5, "both_bad": 0.5}


class PairTruth(BaseModel):
    """The true win rate of `a` against `b` on the bank's sample."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    a: str = Field(description="Key of the side scored.")
    b: str = Field(description="Key of the side it was scored against.")
    n: int = Field(description="Prompts in the sample.")
    win_rate: float = Field(description="Mean points per prompt of `a` (win 1, tie/both-bad 0.5, loss 0).")
    ci_low: float = Field(description="Lower bound of the 95% CI of win_rate.")
    ci_high: float = Field(description="Upper bound of the 95% CI of win_rate.")

    @property
    def truly_better(self) -> bool:
        """`a` beats `b` at the sample's CI (the interval lies above 0.5)."""
        return self.ci_low > 0.5

    @property
    def truly_worse(self) -> bool:
        """`a` loses to `b` at the sample's CI (the interval lies below 0.5)."""
        return self.ci_high < 0.5


def mean_ci(points: list[float]) -> tuple[float, float, float]:
    """Mean and the 95% normal interval of per-prompt points (the interval `world truth` reports)."""
    n = len(points)
    mean = sum(points) / n
    var = sum((p - mean) ** 2 for p in points) / (n - 1) if n > 1 else 0.0
    half = 1.96 * math.sqrt(var / n)
    return mean, mean - half, mean + half


def answer_key(weights_sha256: str, decoding: Decoding) -> str:
    """One side of a truth pair: these weights served with this decoding."""
    return f"{weights_sha256[:16]}-{decoding.fingerprint()[:12]}"


class TruthBank:
    """Answers of every checkpoint asked about, on one leak-audited truth sample of the world in `lab`."""

    def __init__(self, lab: Path, cache: Path, n: int = 2000, seed: int = 0, device: str = "cpu"):
        from evals.judge import judged_prompt

        tasks, refs = draw_sample(lab, n, seed)
        result = audit([t.prompt() for t in tasks], refs, DEFAULT_NGRAM, ids=[t.id for t in tasks])
        if not result.passed:
            raise WorldError(f"truth sample: leak audit failed ({len(result.hits)} hits); refusing to score it")
        self.n, self.seed, self.device = len(tasks), seed, device
        self.items = [t.item("truth") for t in tasks]
        self.prompts = [judged_prompt(i) for i in self.items]
        # The sample depends on the lab (it avoids the lab's own battles), so each lab's bank has its own cache.
        self.cache = cache / f"truth-n{n}-s{seed}"
        self.cache.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.cache / SAMPLE, {"n": self.n, "seed": seed, "ids": [t.id for t in tasks]})
        self.generation_s = 0.0

    def path_of(self, key: str) -> Path:
        """Where the answers of `key` are cached (JSON: key, checkpoint, answers in sample order; the sample's
        ids are in SAMPLE next to it)."""
        return self.cache / f"{key}.json"

    def answers(self, key: str, checkpoint: Path, decoding: Decoding) -> list[str]:
        """The answers of `checkpoint` served with `decoding`, generated once per key."""
        path = self.path_of(key)
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))["answers"]
        import time

        from evals.generate import generate, load

        start = time.monotonic()
        with one_thread():  # see tools.world.build.one_thread
            loaded = load(checkpoint, device=self.device)
            texts = [c.text for c in generate(loaded, self.items, decoding, seed=hash_seed(self.seed, "bank", key) % 2**31,
                                              batch_size=64 if self.device == "cpu" else 512)]
        self.generation_s += time.monotonic() - start
        write_atomic(path, json.dumps({"key": key, "checkpoint": str(checkpoint), "answers": texts}) + "\n")
        return texts

    def pair(self, a: str, b: str) -> PairTruth:
        """`a` against `b`; both must have answered (`answers`) before."""
        mine, theirs = (json.loads(self.path_of(k).read_text(encoding="utf-8"))["answers"] for k in (a, b))
        points = [_POINTS[_verdict(p, x, y)] for p, x, y in zip(self.prompts, mine, theirs, strict=True)]
        win, low, high = mean_ci(points)
        return PairTruth(a=a, b=b, n=len(points), win_rate=win, ci_low=low, ci_high=high)


def _verdict(prompt: str, a: str, b: str) -> str:
    found = oracle.true_verdict(prompt, a, b)
    if found is None:  # every truth prompt comes from the world's generators, so the oracle can solve it
        raise WorldError(f"truth sample prompt the oracle cannot solve: {prompt[:60]!r}")
    return found[0]


# ---- one world, many feedback draws -------------------------------------------------------------------

REDRAW = "world/redraw.json"


class Redraw(BaseModel):
    """world/redraw.json: which built world this lab copies and which feedback draw it holds."""

    model_config = ConfigDict(extra="forbid")
    world_manifest_sha256: str = Field(description="sha256 of the copied world's manifest.json.")
    feedback_seed: int = Field(description="Seed of the battle prompts, the parent's sampling and the votes.")
    battles: int = Field(description="Battles written (those with an empty parent answer are dropped).")
    dropped: int = Field(description="Battles dropped for an empty parent answer.")
    votes: dict[str, int] = Field(description="Battles per vote.")


def redraw_feedback(world: Path, lab: Path, feedback_seed: int) -> Redraw:
    """`lab` becomes a copy of the built world in `world` with its feedback drawn afresh for `feedback_seed`
    (done once: a lab holding this draw of this world is kept; one holding a notebook of another draw is
    refused, never replaced). The copy has no manifest commit, so no build takes it for the world itself;
    its world.json counts the new votes."""
    if not (world / WORLD_DIR / COMMIT).is_file():
        raise WorldError(f"{world}: not a finished world build (no {WORLD_DIR}/{COMMIT})")
    want = file_sha256(world / WORLD_DIR / MANIFEST)
    found = lab / REDRAW
    if found.is_file():
        known = Redraw.model_validate_json(found.read_text(encoding="utf-8"))
        if (known.world_manifest_sha256, known.feedback_seed) == (want, feedback_seed):
            return known
    if (lab / "notebook.db").exists():  # a session's record is never wiped for a new draw
        raise WorldError(f"{lab}: holds a notebook made on another world or feedback draw than {world} seed "
                         f"{feedback_seed}; move it away or use another directory")
    lab.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".redraw-", dir=lab.parent))
    try:
        shutil.copytree(world / WORLD_DIR, stage / WORLD_DIR)
        shutil.copy(world / "lab.toml", stage / "lab.toml")
        (stage / WORLD_DIR / COMMIT).unlink()
        info = _redraw_into(stage, feedback_seed, want)
        shutil.rmtree(lab, ignore_errors=True)
        stage.rename(lab)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return info


def _redraw_into(stage: Path, feedback_seed: int, manifest_sha256: str) -> Redraw:
    spec = load_spec(stage)
    pools = draw_pools(spec.seed, spec.sizes)
    # every pool but the battles, so the new battle prompts are disjoint from suites, replay and pretraining
    kept = pools.synthetic + pools.loops + pools.stage1 + pools.pretrain
    index = ReferenceIndex([Reference(source="world", key=t.id, text=t.prompt()) for t in kept], DEFAULT_NGRAM)
    tasks = draw_mix(spec.sizes.battles, hash_seed(spec.seed, "feedback-redraw", feedback_seed), index, "battles")
    decoding = served_decoding(stage / TOKENIZER, spec.sizes)
    with one_thread():  # see tools.world.build.one_thread
        rows, dropped = battles(stage / PARENT, tasks, decoding, hash_seed(feedback_seed, "redraw-gen") % 2**31,
                                spec.oracle_noise)  # a variant's voters vote its redraws too
    write_atomic(stage / FEEDBACK, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows))
    votes = {v: sum(r["vote"] == v for r in rows) for v in ("own", "other", "tie", "both_bad")}
    write_json_atomic(stage / WORLD_DIR / "world.json",
                      json.loads(spec.model_copy(update={"votes": votes, "battles_dropped": dropped}).model_dump_json()))
    info = Redraw(world_manifest_sha256=manifest_sha256, feedback_seed=feedback_seed, battles=len(rows),
                  dropped=dropped, votes=votes)
    write_atomic(stage / REDRAW, info.model_dump_json(indent=1) + "\n")
    return info
