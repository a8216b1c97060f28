"""Ground truth: a checkpoint's true win rate against another on a fresh sample, judged by the noise-free oracle.

    python run_agent.py world truth CHECKPOINT [--lab DIR] [--vs OTHER|opponent] [--n 2000] [--seed S]

The sample is drawn from the world's generators with a seed derived apart from every pool of the build
("truth", S), excluding every prompt of the world's feedback file (all splits), its eval suite files and
its replay data, and is then leak-audited against all of them (tools/data/leak.py); a sample that fails the
audit is refused. Both sides answer at the world's served decoding, each with its own
sampling seed (so a checkpoint against itself is two independent draws and scores 50% within its
CI). The noise-free oracle (tools/world/oracle.py) judges each pair; a win counts 1, a tie or both-bad
0.5, a loss 0 (the points of evals.judge). The 95% CI is the normal interval of the per-prompt mean.

The agent never sees these numbers; the session report and the decision-quality benchmark do.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from pydantic import Field

from core.placement import Placement, measured
from core.versions import Versions
from core.wall import Wall
from memory.records import TruthFamily, TruthFigures
from tools.data.leak import DEFAULT_NGRAM, Reference, ReferenceIndex, audit, prompt_text
from tools.world import opponent, oracle
from tools.world.build import (
    AUDITED_FILES,
    FEEDBACK,
    PARENT,
    TOKENIZER,
    WorldError,
    load_spec,
    one_thread,
    served_decoding,
)
from tools.world.tasks import WORLD_FAMILIES, WorldTask, draw_mix, hash_seed, is_correct, solve

OPPONENT = "opponent"
_POINTS = {"win": 1.0, "tie": 0.5, "both_bad": 0.5, "loss": 0.0}


# The figures are the notebook's own model (memory.records), so a `truth` decision keeps exactly what this reports.
FamilyTruth = TruthFamily


class TruthResult(TruthFigures):
    """What `world truth` reports."""

    checkpoint: str = Field(description="The checkpoint measured.")
    other: str = Field(description="What it was measured against: a checkpoint path or 'opponent'.")
    placement: Placement | None = Field(None, description="Where the answers were generated: device, dtype, device "
                                        "name and tokens/s over both models' answers.")
    versions: Versions | None = Field(None, description="The versions of torch, transformers, peft, trl and mamba-ssm the job ran with (stamped by the job wrapper, tools/jobs/jobrun.py).")
    wall: Wall | None = Field(None, description="Start-up, work and write-out seconds of the job (core/wall.py; completed by the job wrapper, tools/jobs/jobrun.py).")


def world_references(lab: Path) -> list[Reference]:
    """Every prompt of the world the truth sample must avoid: all battles, suite files and replay data."""
    refs = []
    for line in (lab / FEEDBACK).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            refs.append(Reference(source="feedback", key=row["id"], text=prompt_text(row["messages"])))
    for source, rel in AUDITED_FILES:
        for k, line in enumerate((lab / rel).read_text(encoding="utf-8").splitlines()):
            if line.strip():
                refs.append(Reference(source=source, key=str(k), text=prompt_text(json.loads(line)["messages"])))
    return refs


def draw_sample(lab: Path, n: int, seed: int) -> tuple[list[WorldTask], list[Reference]]:
    """A fresh truth sample and the references it was drawn apart from."""
    spec = load_spec(lab)
    refs = world_references(lab)
    index = ReferenceIndex(refs, DEFAULT_NGRAM)
    return draw_mix(n, hash_seed(spec.seed, "truth", seed), index, "truth"), refs


def _answers(path: Path, items, decoding, seed: int, device: str, dtype: str = "float32",
             stats: dict | None = None) -> list[str]:
    from evals.generate import generate, load

    with one_thread():  # see tools.world.build.one_thread
        began = time.perf_counter()
        loaded = load(path, device=device, dtype=dtype)
        start = time.perf_counter()
        if stats is not None:  # the loads are the job's start-up (core/wall.py)
            stats["load_s"] = stats.get("load_s", 0.0) + start - began
        comps = generate(loaded, items, decoding, seed=seed, batch_size=64 if device == "cpu" else 512)
    if stats is not None:  # generated tokens and seconds, for the job's placement
        stats["tokens"] = stats.get("tokens", 0) + sum(c.n_tokens for c in comps)
        stats["seconds"] = stats.get("seconds", 0.0) + time.perf_counter() - start
    return [c.text for c in comps]


def _outcome(prompt: str, mine: str, theirs: str) -> str:
    verdict, _ = oracle.true_verdict(prompt, mine, theirs)
    return {"A": "win", "B": "loss", "tie": "tie", "both_bad": "both_bad"}[verdict]


def _ci(points: list[float]) -> tuple[float, float, float]:
    n = len(points)
    mean = sum(points) / n
    var = sum((p - mean) ** 2 for p in points) / (n - 1) if n > 1 else 0.0
    half = 1.96 * math.sqrt(var / n)
    return mean, mean - half, mean + half


def truth(lab: Path, checkpoint: Path, other: str | None = None, n: int = 2000, seed: int = 0,
          device: str = "cpu", dtype: str = "float32") -> TruthResult:
    """The checkpoint's true win rate against `other` (a checkpoint path, 'opponent', or None = the parent)."""
    from evals.judge import judged_prompt

    began, began_at = time.perf_counter(), time.time()
    tasks, refs = draw_sample(lab, n, seed)
    result = audit([t.prompt() for t in tasks], refs, DEFAULT_NGRAM, ids=[t.id for t in tasks])
    if not result.passed:
        raise WorldError(f"truth sample: leak audit failed ({len(result.hits)} hits); refusing to score it")
    items = [t.item("truth") for t in tasks]
    prompts = [judged_prompt(i) for i in items]
    decoding = served_decoding(lab / TOKENIZER, load_spec(lab).sizes)
    other_name = other or str(lab / PARENT)
    stats: dict = {}
    mine = _answers(checkpoint, items, decoding, hash_seed(seed, "truth-a") % 2**31, device, dtype, stats)
    if other_name == OPPONENT:
        theirs = [opponent.answer(p) for p in prompts]
    else:
        theirs = _answers(Path(other_name), items, decoding, hash_seed(seed, "truth-b") % 2**31, device, dtype, stats)
    outcomes = [_outcome(p, a, b) for p, a, b in zip(prompts, mine, theirs, strict=True)]
    solved = [solve(p) for p in prompts]
    right = [is_correct(s, a) for s, a in zip(solved, mine, strict=True)]
    other_right = [is_correct(s, b) for s, b in zip(solved, theirs, strict=True)]
    points = [_POINTS[o] for o in outcomes]
    win_rate, low, high = _ci(points)
    per_family = {}
    for family in WORLD_FAMILIES:
        idx = [k for k, t in enumerate(tasks) if t.family == family]
        if idx:
            per_family[family] = FamilyTruth(
                n=len(idx), accuracy=sum(right[k] for k in idx) / len(idx),
                other_accuracy=sum(other_right[k] for k in idx) / len(idx),
                win_rate=sum(points[k] for k in idx) / len(idx))
    return TruthResult(
        checkpoint=str(checkpoint), other=other_name, n=len(tasks), seed=seed, win_rate=win_rate, ci_low=low,
        ci_high=high, outcomes={o: outcomes.count(o) for o in _POINTS}, accuracy=sum(right) / len(right),
        other_accuracy=sum(other_right) / len(other_right), per_family=per_family, audit_passed=result.passed,
        audit_sha256=result.sha256(), audit_references=result.references,
        placement=measured(device, dtype, stats.get("tokens", 0), stats.get("seconds", 0.0)),
        wall=Wall(startup_s=stats["load_s"], work_s=time.perf_counter() - began - stats["load_s"], write_s=0.0,
                  parts={"load": stats["load_s"]}, began_at=began_at))


def render(result: TruthResult) -> str:
    lines = [
        f"{result.checkpoint} vs {result.other}: true win rate {result.win_rate:.1%} "
        f"(95% CI {result.ci_low:.1%} .. {result.ci_high:.1%}), n = {result.n}, truth seed {result.seed}",
        "outcomes: " + ", ".join(f"{k} {v}" for k, v in result.outcomes.items()),
        f"accuracy: {result.accuracy:.1%} (other {result.other_accuracy:.1%})",
        f"leak audit: {'passed' if result.audit_passed else 'FAILED'} against "
        + ", ".join(f"{k} {v}" for k, v in result.audit_references.items()) + f" (sha256 {result.audit_sha256[:16]})",
        f"{'family':<18}{'n':>6}{'accuracy':>10}{'other':>8}{'win':>8}",
    ]
    for family, f in result.per_family.items():
        lines.append(f"{family:<18}{f.n:>6}{f.accuracy:>10.1%}{f.other_accuracy:>8.1%}{f.win_rate:>8.1%}")
    return "\n".join(lines)
