"""The previous stage rule, re-applied to a decision-quality run's recorded sessions: what `best_of_stage` changed.

    .venv/bin/python bench/first_cleared.py --work /tmp/dq --seed-list 1,2,3,4,5,6,7,8,9,10

Before `best_of_stage`, the short protocol took its first-stage arms in screen order (the playbook's own screen
score against the parent): the first one was compared with the parent and promoted if it cleared, and the second
was compared only as a fallback when the first was rejected. This reads each session's recorded comparisons against
the parent in that order. A session that lacks a comparison the old rule would have read (a best-of-stage session
whose holdout leader cleared never compares the other arm) cannot be re-judged, and is said so. The old rule's dose
would have followed its own arm; the line says how many doses the session promoted (with none, the old rule's
nominee is its first-stage arm). True win rates come from the run's rows (WORK/seed-SEED.json, written by
bench/decision_quality.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.planners.stages import screen_score as _screen  # noqa: E402
from agent.summary import summarize  # noqa: E402
from memory.notebook import Notebook  # noqa: E402
from memory.state import fold  # noqa: E402

SESSION = "dq"


def first_cleared(work: Path, seed: int) -> dict:
    row = json.loads((work / f"seed-{seed}.json").read_text())
    truth = {c["id"]: c["vs_parent"]["win_rate"] for c in row["candidates"]}
    parent = row["parent"]
    with Notebook.open(work / f"lab-{seed}" / "notebook.db", readonly=True) as nb:
        s = summarize(nb, SESSION).model_copy(update={"incumbent": parent})  # the first stage's view
        promoted = [nb.artifact(c.artifact_id) for c in fold(nb, SESSION).changes]
    arms = sorted((c for c in s.checkpoints if c.origin.startswith("train:") and _screen(s, c) > 0),
                  key=lambda c: (-_screen(s, c), c.id))
    old: int | None = parent
    for arm in arms[:2]:  # one finalist and one fallback
        verdicts = [v for v in arm.verdicts if v.incumbent == parent]
        if not verdicts:
            old = None  # a comparison the old rule would read was never made
            break
        if verdicts[0].cleared:
            old = arm.id
            break
    new = row["policies"]["playbook"]["nominee"]
    return {"seed": seed, "first_cleared": old, "first_cleared_win_rate": truth.get(old), "best_of_stage": new,
            "best_of_stage_win_rate": truth[new], "doses_promoted": sum("merge" in a.recipe for a in promoted)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="the decision-quality run's WORK directory")
    p.add_argument("--seed-list", required=True, help="comma-separated seeds of that run")
    args = p.parse_args()
    rows = [first_cleared(args.work, int(s)) for s in args.seed_list.split(",")]
    for r in rows:
        old = ("not re-applicable (a comparison it reads was not made)" if r["first_cleared"] is None
               else f"{r['first_cleared']} {r['first_cleared_win_rate']:.3f}")
        print(f"seed {r['seed']}: first cleared {old}, best of stage {r['best_of_stage']} "
              f"{r['best_of_stage_win_rate']:.3f}, doses promoted {r['doses_promoted']}")
    both = [r for r in rows if r["first_cleared"] is not None]
    gain = {k: sum(r[f"{k}_win_rate"] - 0.5 for r in both) / len(both) if both else 0.0
            for k in ("first_cleared", "best_of_stage")}
    print(f"{len(both)} of {len(rows)} sessions re-judged; mean true gain there: first cleared "
          f"{gain['first_cleared']:+.4f}, best of stage {gain['best_of_stage']:+.4f}; sessions that differ: "
          f"{sum(r['first_cleared'] != r['best_of_stage'] for r in both)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
