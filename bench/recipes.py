"""The five seeds' recipes in the demo world: each recipe's whole session, its nominee's true win rate against the
parent (the world's ground truth on a fresh sample, with its 95% CI), its GPU-hours and what it promoted.

    OMP_NUM_THREADS=1 .venv/bin/python bench/recipes.py [--work /tmp/recipes] [--size demo] [--budget 60gpuh]
        [--parallel 2] [--recipes aspen,brook,delta,ember,islet] [--out bench/results/recipes-demo.json]

The world is built once in WORK/world (`run_agent.py world build`); each recipe runs on its own copy, made ready
for it by tools/world/recipe_labs.py (delta: the world's reward model as the judge; ember: a battle-margin
suite), as `run_agent.py --budget B --lab WORK/lab-R --recipe R`. The ground truth is the session's own `truth`
decision ([truth] n of the world's lab.toml: 300 prompts at the demo size), measured after the nomination and
never shown to the agent.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memory.notebook import Notebook  # noqa: E402
from memory.state import fold  # noqa: E402
from tools.world.recipe_labs import prepare  # noqa: E402

SESSION = "r1"
RECIPES = ("aspen", "brook", "delta", "ember", "islet")


def _world(work: Path, size: str) -> Path:
    world = work / "world"
    subprocess.run([sys.executable, str(REPO / "run_agent.py"), "world", "build", "--lab", str(world), "--size", size],
                   check=True, cwd=REPO)
    return world


def _session(world: Path, work: Path, recipe: str, budget: str) -> dict[str, Any]:
    lab = work / f"lab-{recipe}"
    if not (lab / "notebook.db").exists():
        shutil.copytree(world, lab, dirs_exist_ok=True, ignore=shutil.ignore_patterns("notebook.db*", "lab.lock"))
        prepare(lab, recipe)
    log = work / f"session-{recipe}.log"
    start = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "--budget", budget, "--lab", str(lab),
                             "--recipe", recipe, "--session", SESSION, "--quiet"], stdout=out, stderr=subprocess.STDOUT,
                            cwd=REPO).returncode
    return {"recipe": recipe, "rc": rc, "wall_s": round(time.monotonic() - start, 1)} | _read(lab)


def _read(lab: Path) -> dict[str, Any]:
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        s, ledger = nb.session(SESSION), nb.ledger(SESSION)
        state = fold(nb, SESSION)
        promoted = [nb.artifact(c.artifact_id).name for c in state.changes]
        truth = nb.decisions(SESSION, kind="truth")
        figures = truth[-1].payload if truth else None
        return {"status": s.status, "gpuh": round(ledger.spent_gpuh, 3), "promoted": promoted,
                "nominee": nb.artifact(state.nominee).name if state.nominee is not None else None,
                "truth": None if figures is None else {"n": figures.n, "win_rate": round(figures.win_rate, 4),
                                                       "ci_low": round(figures.ci_low, 4),
                                                       "ci_high": round(figures.ci_high, 4)}}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| recipe | true win rate vs parent [95% CI] (n) | GPU-h | promoted | nominee |", "|---|---|---|---|---|"]
    for r in rows:
        t = r["truth"]
        truth = f"{t['win_rate']:.3f} [{t['ci_low']:.3f}, {t['ci_high']:.3f}] ({t['n']})" if t else "not measured"
        lines.append(f"| {r['recipe']} | {truth} | {r['gpuh']:.1f} | {', '.join(r['promoted']) or 'nothing'} | "
                     f"{r['nominee'] or 'none'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/recipes"))
    p.add_argument("--size", choices=["demo", "test"], default="demo")
    p.add_argument("--budget", default="60gpuh")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--out", type=Path, default=REPO / "bench/results/recipes-demo.json")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    world = _world(args.work, args.size)
    names = [r for r in args.recipes.split(",") if r]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(lambda r: _session(world, args.work, r, args.budget), names))
    result = {"command": " ".join([Path(sys.executable).name, "bench/recipes.py", *(argv or sys.argv[1:])]),
              "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}", "size": args.size,
              "budget": args.budget, "sessions": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(rows))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
