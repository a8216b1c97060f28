"""Is the world worth researching? Recipe arms from the parent, each scored by ground truth; and job costs.

    python -m tools.world.measure --lab DIR --out DIR [--device cuda] [--n 2000] [--arms NAME,...] [--spread K]
                                  [--no-opponent] [--costs]

What it measures (DESIGN.md section 6; issue 12 item 5), with the project's own builders and trainers:

- the parent's true win rate against the opponent;
- recipe arms trained from the parent by `trainers.sft` (or `trainers.klce`) on data built by `tools.data.datasets`
  from the world's train split (winner SFT at several learning rates and repeat counts, synthetic verified
  SFT; `playbook-*`: the playbook's own first arms at its default settings, trained as tools/train.py
  trains them), each scored by `world truth` against the parent on the same fresh sample (and against
  the opponent unless --no-opponent);
- with --spread K: the dev-holdout win score of the parent and of each arm in K replicates, as the
  agent's calibration measures it (against the parent's reference answers, judged by the noisy oracle),
  and its spread between replicates: the noise the agent must see through;
- with --costs: wall and CPU seconds of one playbook-sized SFT arm (30 steps) and of eval jobs (the
  synthetic, loop and stop suites at the served decoding, K = 1 and 3), parts of the cost model
  (tools/world/cost.py).

Everything goes to OUT/measure.json (and is printed).
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.util import write_json_atomic
from tools.world import build as world
from tools.world.truth import OPPONENT, truth


class Arm(BaseModel):
    """One recipe setting."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    data: str = Field(description="'winner' (winner SFT on decisive train battles) or 'synthetic' (verified tasks).")
    lr: float = Field(description="Peak learning rate.")
    steps: int = Field(description="Optimizer steps (batch 8).")
    repeat: int = Field(1, description="Times each winner row is repeated (winner data only).")
    trainer: Literal["sft", "klce"] = Field("sft", description="The project's trainer: trainers.sft or trainers.klce.")
    as_agent: bool = Field(False, description="Train as the agent's train tool does (tools/train.py: no warm-up, "
                                              "max_len 512, klce's KL weight 0.1); else warm-up steps // 10, max_len 384.")


ARMS: dict[str, Arm] = {
    "winner-lr1e-3": Arm(data="winner", lr=1e-3, steps=150),
    "winner-lr3e-2": Arm(data="winner", lr=3e-2, steps=150),
    "winner-rep8": Arm(data="winner", lr=1e-3, steps=600, repeat=8),
    "synthetic-lr1e-3": Arm(data="synthetic", lr=1e-3, steps=150),
    # The playbook's own first arms at its default settings (agent/planners/playbook.py PlaybookSettings:
    # lr 1e-3, batch 8; 30 steps in the full protocol, 16 in the short one), trained as its train tool does.
    "playbook-sft-30": Arm(data="winner", lr=1e-3, steps=30, as_agent=True),
    "playbook-sft-16": Arm(data="winner", lr=1e-3, steps=16, as_agent=True),
    "playbook-klce-16": Arm(data="winner", lr=1e-3, steps=16, trainer="klce", as_agent=True),
    "playbook-sft-lr2e-3-30": Arm(data="winner", lr=2e-3, steps=30, as_agent=True),
    # A setting the agent's train tool accepts that truly hurts: a learning rate 30x the playbook's.
    "sft-lr3e-2-16": Arm(data="winner", lr=3e-2, steps=16, as_agent=True),
}


def _split(lab: Path, out: Path) -> Path:
    """The split the agent's ingest makes (the world's lab.toml [feedback] settings), and its dev prompts
    as eval items (out/items-dev.jsonl, what the judged holdout suite scores), as tools/ingest.py writes them."""
    from evals.types import Item
    from tools.data.splits import SplitConfig, split_file

    feedback = tomllib.loads((lab / "lab.toml").read_text(encoding="utf-8"))["feedback"]
    settings = {k: feedback[k] for k in ("dev_fraction", "sealed_fraction", "stratify_by", "reserve_fraction")
                if k in feedback}
    battles, split = split_file(lab / world.FEEDBACK, SplitConfig(**settings))
    items = [Item(id=b.id, messages=tuple(b.messages)) for b in battles if split.assignment[b.id] == "dev"]
    (out / "items-dev.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in items), encoding="utf-8")
    path = out / "split.json"
    path.write_text(split.model_dump_json(indent=1) + "\n", encoding="utf-8")
    return path


def holdout_spread(lab: Path, out: Path, checkpoint: Path, name: str, replicates: int) -> dict:
    """The dev-holdout win score of `checkpoint` in `replicates` replicates, as the agent's calibration
    measures it (tools/evaluate.py): against the parent's reference answers (one generation at seed 0),
    judged by the world's noisy oracle; and the spread (max - min) the agent must see through."""
    from evals.job import CallableJudgeSpec, EvalJobConfig, SuiteSpec, run

    decoding = world.served_decoding(lab / world.TOKENIZER, world.load_spec(lab).sizes)
    items = out / "items-dev.jsonl"
    reference = out / "eval-reference" / "completions-holdout-reference-r0.jsonl"
    with world.one_thread():
        if not reference.is_file():
            run(EvalJobConfig(checkpoint=lab / world.PARENT, decoding=decoding, output_dir=reference.parent,
                              suites=(SuiteSpec(name="holdout-reference", scorer="loops", items_path=items),)))
        result = run(EvalJobConfig(
            checkpoint=checkpoint, decoding=decoding, replicates=replicates, output_dir=out / f"eval-holdout-{name}",
            judge=CallableJudgeSpec(kind="callable", target="tools.world.oracle:judge"),
            suites=(SuiteSpec(name="holdout", scorer="judge", items_path=items, incumbent_completions=reference),)))
    scores = [r.metrics["win_score"] for r in result.suites]
    return {"items": sum(1 for _ in items.open(encoding="utf-8")), "win_score": scores,
            "spread": max(scores) - min(scores)}


def _data(lab: Path, out: Path, split: Path, arm: Arm) -> Path:
    from tools.data.datasets import (
        SyntheticVerifiedConfig,
        WinnerSFTConfig,
        build_synthetic_verified,
        build_winner_sft,
    )

    common = {"tokenizer": lab / world.TOKENIZER, "feedback": lab / world.FEEDBACK, "split": split,
              "eval_suites": [lab / world.SYNTHETIC_SUITE, lab / world.LOOPS_SUITE],
              "system_prompt": world.SYSTEM_PROMPT}
    path = out / f"data-{arm.data}-r{arm.repeat}.jsonl"
    if path.is_file():
        return path
    if arm.data == "winner":
        build_winner_sft(WinnerSFTConfig(out=path, repeat=arm.repeat, **common))
    else:
        from evals.synthetic import FAMILIES

        build_synthetic_verified(SyntheticVerifiedConfig(out=path, counts={f: 100 for f in FAMILIES}, seed=4242,
                                                         **common))
    return path


def _train(lab: Path, out: Path, name: str, arm: Arm, data: Path) -> tuple[Path, float]:
    from trainers import klce, sft

    common = {"model_path": lab / world.PARENT, "data_path": data, "output_dir": out / f"run-{name}",
              "system_prompt": world.SYSTEM_PROMPT, "lr": arm.lr, "steps": arm.steps, "batch_size": 8,
              "micro_batch_size": 8, "seed": 0, "log_every": max(1, arm.steps // 5),
              "max_len": 512 if arm.as_agent else 384, "warmup_steps": 0 if arm.as_agent else max(1, arm.steps // 10)}
    if arm.trainer == "klce":
        result = klce.train(klce.KLCEConfig(**common, kl_coef=0.1))
    else:
        result = sft.train(sft.SFTConfig(**common))
    return result.model_dir, result.wall_time_s


def eval_job_seconds(lab: Path, out: Path, replicates: int) -> dict[str, float]:
    """Wall and CPU seconds of one eval job of the parent on the synthetic, loops and stop suites."""
    from evals.job import EvalJobConfig, SuiteSpec, run

    spec = world.load_spec(lab)
    suites = (SuiteSpec(name="synthetic", scorer="synthetic", items_path=lab / world.SYNTHETIC_SUITE),
              SuiteSpec(name="loops", scorer="loops", items_path=lab / world.LOOPS_SUITE),
              SuiteSpec(name="stop", scorer="length_stop", items_path=lab / world.LOOPS_SUITE))
    config = EvalJobConfig(checkpoint=lab / world.PARENT, decoding=world.served_decoding(lab / world.TOKENIZER, spec.sizes),
                           suites=suites, replicates=replicates, output_dir=out / f"eval-job-k{replicates}")
    with world.one_thread(), _clock() as took:
        run(config)
    return took


@contextmanager
def _clock() -> Iterator[dict[str, float]]:
    """Wall and process-CPU seconds of the block. CPU seconds are what a quiet core's wall clock shows
    (the jobs run one thread); on a shared machine the wall clock runs several times longer."""
    took: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    yield took
    took.update(wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu)


def costs(lab: Path, out: Path, split: Path) -> dict[str, dict[str, float]]:
    """The parts of tools/world/cost.py's model: a playbook-sized SFT arm (30 steps) and eval jobs K = 1, 3.
    Job start (imports) is not in these: it is measured on its own (see cost.py)."""
    arm = Arm(data="winner", lr=1e-3, steps=30)
    data = _data(lab, out, split, arm)
    with world.one_thread(), _clock() as train:
        _train(lab, out, "cost-arm", arm, data)
    return {"sft_arm_30_steps": train, "eval_job_k1": eval_job_seconds(lab, out, 1),
            "eval_job_k3": eval_job_seconds(lab, out, 3)}


def main(argv: list[str] | None = None) -> None:
    """Run the arms (and costs) and write OUT/measure.json."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--lab", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--costs", action="store_true", help="only time one SFT arm and two eval jobs (CPU)")
    p.add_argument("--spread", type=int, default=0, metavar="K",
                   help="also the dev-holdout win score in K replicates (parent and each arm) and its spread")
    p.add_argument("--no-opponent", action="store_true", help="arms: skip the truth against the opponent")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"lab": str(args.lab), "n": args.n, "device": args.device}
    split = _split(args.lab, args.out)
    if args.costs:
        report["costs"] = costs(args.lab, args.out, split)
    else:
        parent = truth(args.lab, args.lab / world.PARENT, OPPONENT, args.n, device=args.device)
        report["parent_vs_opponent"] = parent.model_dump(mode="json")
        print(f"parent vs opponent: {parent.win_rate:.3f} [{parent.ci_low:.3f}, {parent.ci_high:.3f}]", flush=True)
        if args.spread:
            report["parent_holdout"] = holdout_spread(args.lab, args.out, args.lab / world.PARENT, "parent", args.spread)
            print(f"parent dev holdout: {report['parent_holdout']}", flush=True)
        write_json_atomic(args.out / "measure.json", report)
        for name in [a for a in args.arms.split(",") if a]:
            arm = ARMS[name]
            data = _data(args.lab, args.out, split, arm)
            with world.one_thread():  # as the world's jobs run (two threads cost 15x the CPU on a shared machine)
                model, train_s = _train(args.lab, args.out, name, arm, data)
            result = truth(args.lab, model, None, args.n, device=args.device)
            vs_opp = None if args.no_opponent else truth(args.lab, model, OPPONENT, args.n, device=args.device).win_rate
            report[name] = {"arm": arm.model_dump(), "train_s": train_s, "vs_parent": result.model_dump(mode="json"),
                            "vs_opponent_win_rate": vs_opp}
            if args.spread:
                report[name]["holdout"] = holdout_spread(args.lab, args.out, model, name, args.spread)
            print(f"{name}: vs parent {result.win_rate:.3f} [{result.ci_low:.3f}, {result.ci_high:.3f}], "
                  f"accuracy {result.accuracy:.3f} (parent {result.other_accuracy:.3f}), vs opponent {vs_opp}, "
                  f"holdout {report[name].get('holdout')}", flush=True)
            write_json_atomic(args.out / "measure.json", report)
    write_json_atomic(args.out / "measure.json", report)
    print(json.dumps({k: v for k, v in report.items() if k != "parent_vs_opponent"}, indent=1)[:4000])


if __name__ == "__main__":
    main()
