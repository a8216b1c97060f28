"""Tool `ingest`: validate and split the lab's feedback into train / dev / sealed (and a reserve, where lab.toml's
[feedback] reserve_fraction asks for one), as a job.

The split itself runs as a job (`split_job`, it reads the battles and writes the split file), so
the agent process never handles battle text; the agent records the split (ids only) in the
notebook. Battles of the lab's previous split keep their assignment (tools/data/splits.py, rule 4).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.util import write_atomic
from evals.types import Battle, Item
from tools.context import ToolContext, ToolOutcome, invoke, record_once
from tools.data.splits import Split, SplitConfig, split_file

NAME = "ingest"


class Args(BaseModel):
    """Ingest the lab's feedback file (the one lab.toml names; no other file can be ingested)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    reason: str = Field("", description="Why now (free text, kept in the decision).")


class SplitJob(BaseModel):
    """Config of the split job."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    feedback: Path = Field(description="The battles file.")
    config: SplitConfig = Field(description="Split fractions and stratification.")
    pinned: dict[str, str] = Field(default_factory=dict, description="Battle id -> split of the lab's previous split.")
    out_dir: Path = Field(description="Directory the split JSON is written to (split-<sha256[:16]>.json).")


Holdout = Literal["dev", "sealed", "reserve"]


def split_job(cfg: SplitJob) -> Split:
    """Load (all or nothing), split, write the split file and the holdouts' prompts as eval items
    (what judge suites score: dev for selection, sealed for the confirmation, the reserve for a comparison that buys
    evidence with it), and their decisive battles as items carrying the battle (what battle_margin and reward_proxy
    suites score); return the split."""
    battles, split = split_file(cfg.feedback, cfg.config, pinned=cfg.pinned or None)
    out = cfg.out_dir / f"split-{split.sha256[:16]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for which in [h for h in ("dev", "sealed", "reserve") if h in split.counts]:
        items = [Item(id=b.id, messages=tuple(b.messages)) for b in battles if split.assignment[b.id] == which]
        write_atomic(cfg.out_dir / f"items-{which}-{split.sha256[:16]}.jsonl",
                     "".join(i.model_dump_json() + "\n" for i in items))
        # Ties and both-bad votes name no preferred answer: the battle suites read the decisive votes only.
        decisive = [Item(id=b.id, messages=tuple(b.messages), battle=Battle(
                        chosen=b.own if b.vote == "own" else b.other, rejected=b.other if b.vote == "own" else b.own,
                        recorded=b.own))
                    for b in battles if split.assignment[b.id] == which and b.vote in ("own", "other")]
        write_atomic(cfg.out_dir / f"battles-{which}-{split.sha256[:16]}.jsonl",
                     "".join(i.model_dump_json() + "\n" for i in decisive))
    write_atomic(out, split.model_dump_json(indent=1) + "\n")
    return split


def split_path(ctx: ToolContext, sha256: str) -> Path:
    """Where the split of this sha256 lies (what dataset builders read)."""
    return ctx.paths.splits / f"split-{sha256[:16]}.json"


def holdout(sealed: bool, reserve: bool = False) -> Holdout:
    """Which holdout a suite reads: its sealed split, the reserve (evidence bought for a comparison), or dev."""
    return "sealed" if sealed else "reserve" if reserve else "dev"


def holdout_items(ctx: ToolContext, sealed: bool, reserve: bool = False) -> Path | None:
    """The session's dev (sealed, reserve) battle prompts as eval items, once ingested (the reserve's only when the
    split holds one)."""
    split = ctx.nb.latest_split()
    if split is None or holdout(sealed, reserve) not in split.counts:
        return None
    return ctx.paths.splits / f"items-{holdout(sealed, reserve)}-{split.sha256[:16]}.jsonl"


def holdout_battles(ctx: ToolContext, sealed: bool, reserve: bool = False) -> Path | None:
    """The session's dev (sealed, reserve) decisive battles as eval items carrying the battle, once ingested."""
    split = ctx.nb.latest_split()
    if split is None or holdout(sealed, reserve) not in split.counts:
        return None
    return ctx.paths.splits / f"battles-{holdout(sealed, reserve)}-{split.sha256[:16]}.jsonl"


def split_config(ctx: ToolContext) -> SplitConfig:
    """The split the session's ingest makes: the lab's [feedback] fractions, reserve and stratification."""
    lab = ctx.lab
    return SplitConfig(dev_fraction=lab.dev_fraction, sealed_fraction=lab.sealed_fraction, stratify_by=lab.stratify_by,
                       reserve_fraction=lab.reserve_fraction)


def counts_line(sizes: dict[str, int]) -> str:
    """'train a, dev b, sealed c' (', reserve d' with a reserve): the split's sizes, as ingest reports them."""
    return ", ".join(f"{name} {sizes[name]}" for name in ("train", "dev", "sealed", "reserve") if name in sizes)


def _body(ctx: ToolContext, args: Args) -> ToolOutcome:
    lab = ctx.lab
    config = split_config(ctx)
    # The lab's split from before this session: one this session recorded itself (an ingest interrupted between
    # recording its split and closing its tool call, then resumed or restored) would change the job's arguments,
    # hence its key, and a second ingest job would run.
    previous = ctx.nb.latest_split(before_session=ctx.session)
    job_cfg = SplitJob(feedback=lab.feedback, config=config, pinned=previous.assignment if previous else {},
                       out_dir=ctx.paths.splits)
    split, key = ctx.wait("ingest", split_job, job_cfg, estimate_gpuh=0.0)
    known = ctx.nb.latest_split(split.source_sha256)
    if known is None or known.sha256 != split.sha256:
        known = ctx.nb.record_split(source_path=str(lab.feedback), source_sha256=split.source_sha256,
                                    config=config.model_dump(mode="json"), counts=split.counts,
                                    assignment=dict(split.assignment), session=ctx.session)
    sizes = {name: sum(votes.values()) for name, votes in split.counts.items()}
    summary = f"feedback split {known.sha256[:12]}: {counts_line(sizes)}"
    # With a reserve: the open suites that read the dev holdout's prompts, which a reserve look extends with the
    # reserve's (the policy draws it only for p bars on them: a suite with its own items has no reserve).
    extends = {"reserve_suites": [s.name for s in lab.open_suites if s.file is None]} if "reserve" in sizes else {}
    record_once(ctx, "ingest", summary, {"split_id": known.id, "sha256": known.sha256,
                                         "counts": sizes, "job_key": key} | extends)
    return ToolOutcome(tool=NAME, status="done", summary=summary, data={"split_id": known.id, "sha256": known.sha256})


def run(ctx: ToolContext, args: Args, decision_seq: int | None = None) -> ToolOutcome:
    return invoke(ctx, NAME, args, _body, decision_seq)
