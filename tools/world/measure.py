"""Is the world worth researching? Recipe arms from the parent, each scored by ground truth; and job costs.

    python -m tools.world.measure --lab DIR --out DIR [--device cuda] [--n 2000] [--arms NAME,...] [--costs]

What it measures (DESIGN.md section 6; issue 12 item 5), with the project's own builders and trainers:

- the parent's true win rate against the opponent;
- recipe arms trained from the parent by `trainers.sft` on data built by `tools.datasets` from the world's
  train split (winner SFT at several learning rates and repeat counts, synthetic verified SFT), each
  scored by `world truth` against the parent on the same fresh sample;
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


ARMS: dict[str, Arm] = {
    "winner-lr1e-3": Arm(data="winner", lr=1e-3, steps=150),
    "winner-lr3e-2": Arm(data="winner", lr=3e-2, steps=150),
    "winner-rep8": Arm(data="winner", lr=1e-3, steps=600, repeat=8),
    "synthetic-lr1e-3": Arm(data="synthetic", lr=1e-3, steps=150),
}


def _split(lab: Path, out: Path) -> Path:
    from tools.splits import SplitConfig, split_file

    # The split the agent's ingest makes: the world's lab.toml [feedback] settings.
    feedback = tomllib.loads((lab / "lab.toml").read_text(encoding="utf-8"))["feedback"]
    settings = {k: feedback[k] for k in ("dev_fraction", "sealed_fraction", "stratify_by")}
    _, split = split_file(lab / world.FEEDBACK, SplitConfig(**settings))
    path = out / "split.json"
    path.write_text(split.model_dump_json(indent=1) + "\n", encoding="utf-8")
    return path


def _data(lab: Path, out: Path, split: Path, arm: Arm) -> Path:
    from tools.datasets import (
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
    from trainers.sft import SFTConfig, train

    config = SFTConfig(model_path=lab / world.PARENT, data_path=data, output_dir=out / f"run-{name}",
                       system_prompt=world.SYSTEM_PROMPT, lr=arm.lr, steps=arm.steps, batch_size=8,
                       micro_batch_size=8, max_len=384, warmup_steps=max(1, arm.steps // 10), seed=0,
                       log_every=max(1, arm.steps // 5))
    result = train(config)
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
        write_json_atomic(args.out / "measure.json", report)
        for name in [a for a in args.arms.split(",") if a]:
            arm = ARMS[name]
            data = _data(args.lab, args.out, split, arm)
            with world.one_thread():  # as the world's jobs run (two threads cost 15x the CPU on a shared machine)
                model, train_s = _train(args.lab, args.out, name, arm, data)
            result = truth(args.lab, model, None, args.n, device=args.device)
            vs_opp = truth(args.lab, model, OPPONENT, args.n, device=args.device)
            report[name] = {"arm": arm.model_dump(), "train_s": train_s, "vs_parent": result.model_dump(mode="json"),
                            "vs_opponent_win_rate": vs_opp.win_rate}
            print(f"{name}: vs parent {result.win_rate:.3f} [{result.ci_low:.3f}, {result.ci_high:.3f}], "
                  f"accuracy {result.accuracy:.3f} (parent {result.other_accuracy:.3f}), "
                  f"vs opponent {vs_opp.win_rate:.3f}", flush=True)
            write_json_atomic(args.out / "measure.json", report)
    write_json_atomic(args.out / "measure.json", report)
    print(json.dumps({k: v for k, v in report.items() if k != "parent_vs_opponent"}, indent=1)[:4000])


if __name__ == "__main__":
    main()
