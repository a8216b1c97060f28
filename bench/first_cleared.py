"""The previous stage rule, re-applied to a decision-quality run's recorded sessions: what `best_of_stage` changed.

    .venv/bin/python bench/first_cleared.py --work /tmp/dq --seed-list 1,2,3,4,5,6,7,8,9,10

Before `best_of_stage`, the short protocol promoted its best-screened finalist as soon as it cleared the bars and
judged the second arm only as a fallback when the first was rejected. Both rules compare the same arms against the
parent in the same order, so the old rule's first-stage choice is read from the comparisons a best-of-stage
session recorded: the first one against the parent that cleared. Its dose would have followed its own arm; the
line says how many doses the session promoted (with none, the old rule's nominee is its first-stage arm). True
win rates come from the run's rows (WORK/seed-SEED.json, written by bench/decision_quality.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory.notebook import Notebook  # noqa: E402

SESSION = "dq"


def first_cleared(work: Path, seed: int) -> dict:
    row = json.loads((work / f"seed-{seed}.json").read_text())
    truth = {c["id"]: c["vs_parent"]["win_rate"] for c in row["candidates"]}
    with Notebook.open(work / f"lab-{seed}" / "notebook.db", readonly=True) as nb:
        against_parent = [c for c in nb.comparisons(SESSION) if c.incumbent == row["parent"]]
        promoted = [nb.artifact(d.payload.get("artifact_id")) for d in nb.decisions(SESSION, kind="promote")
                    if d.payload.get("action") == "incumbent"]
    old = next((c.candidate for c in against_parent if c.promoted), row["parent"])
    new = row["policies"]["playbook"]["nominee"]
    return {"seed": seed, "first_cleared": old, "first_cleared_win_rate": truth[old], "best_of_stage": new,
            "best_of_stage_win_rate": truth[new], "doses_promoted": sum("merge" in a.recipe for a in promoted)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="the decision-quality run's WORK directory")
    p.add_argument("--seed-list", required=True, help="comma-separated seeds of that run")
    args = p.parse_args()
    rows = [first_cleared(args.work, int(s)) for s in args.seed_list.split(",")]
    for r in rows:
        print(f"seed {r['seed']}: first cleared {r['first_cleared']} {r['first_cleared_win_rate']:.3f}, best of stage "
              f"{r['best_of_stage']} {r['best_of_stage_win_rate']:.3f}, doses promoted {r['doses_promoted']}")
    gain = {k: sum(r[f"{k}_win_rate"] - 0.5 for r in rows) / len(rows) for k in ("first_cleared", "best_of_stage")}
    print(f"mean true gain: first cleared {gain['first_cleared']:+.4f}, best of stage {gain['best_of_stage']:+.4f}; "
          f"sessions that differ: {sum(r['first_cleared'] != r['best_of_stage'] for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
