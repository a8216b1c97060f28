"""The decision-quality benchmark on a reduced run: 3 world seeds at `--size test`, the test playbook.

Real parts throughout: three toy worlds (seed 0 is the test suite's shared world, copied), three real
sessions through run_agent.py, greedy holdout evals as real eval jobs, and the truth sample answered by
every checkpoint. The false-promotion count is then recomputed here from the notebooks alone (raw SQL on
the promote decisions and artifacts, the truth sample redrawn, the oracle applied to the cached answers)
and must match the benchmark's.
"""

from __future__ import annotations

import json
import math
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from evals.decoding import Decoding
from tools.world import oracle
from tools.world.decision_quality import answer_key
from tools.world.testing import session_world
from tools.world.truth import draw_sample

REPO = Path(__file__).resolve().parents[1]
TRUTH_N = 60
SEEDS = (0, 1, 2)
SESSION_KEYS = {"seed", "session", "lab", "status", "budget_gpuh", "spent_gpuh", "replay_reproduced", "parent", "candidates",
                "greedy_looks", "extra_eval_gpuh", "truth_generation_s", "policies", "build_s", "session_s", "judge_s"}
POLICY_KEYS = {"policy", "nominee", "nominee_name", "nominee_vs_parent", "nominee_truly_better", "nominee_truly_worse",
               "promotions", "n_promotions", "n_false", "gpuh", "true_improvement", "improvement_per_gpuh",
               "within_oracle_ci"}
SUMMARY_KEYS = {"sessions", "nominee_truly_worse_sessions", "nominee_truly_better_share", "promotions",
                "false_promotions", "false_promotion_share", "mean_true_improvement", "gpuh", "improvement_per_gpuh",
                "within_oracle_ci_share"}

# Three real toy-world sessions (18-32 min each on the shared 2-core machine): a benchmark, not a suite test.
pytestmark = [pytest.mark.slow, pytest.mark.bench]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory) -> tuple[dict, Path]:
    work = tmp_path_factory.mktemp("dq")
    shared = session_world(tmp_path_factory)  # seed 0, already built for the other world tests
    (work / "world-0").mkdir()
    shutil.copytree(shared / "world", work / "world-0" / "world")
    shutil.copy(shared / "lab.toml", work / "world-0" / "lab.toml")
    out = work / "out.json"
    # The budget is not under test: the toy world charges measured seconds x a factor, and on a loaded 2-core
    # machine the test sessions' evals measured about 10x their idle seconds (at 200gpuh the launcher refused
    # the parent's calibration on a forecast of 287 GPU-h).
    proc = subprocess.run([sys.executable, str(REPO / "bench/decision_quality.py"), "--seeds", str(len(SEEDS)),
                           "--first-seed", str(SEEDS[0]), "--size", "test", "--protocol", "test", "--budget", "5000gpuh",
                           "--truth-n", str(TRUTH_N), "--work", str(work), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), work


def test_json_has_every_field_and_the_baselines(bench_run):
    result, _ = bench_run
    assert {"command", "config", "host", "wall_s", "sessions", "summary", "goals", "table"} <= set(result)
    assert [s["seed"] for s in result["sessions"]] == list(SEEDS)
    for s in result["sessions"]:
        assert SESSION_KEYS <= set(s), SESSION_KEYS - set(s)
        assert set(s["policies"]) == {"playbook", "greedy", "last_arm", "oracle_best"}
        for p in s["policies"].values():
            assert POLICY_KEYS <= set(p), POLICY_KEYS - set(p)
            assert 0.0 <= p["nominee_vs_parent"]["win_rate"] <= 1.0
        # the ceiling is the best candidate by truth: no policy's nominee beats it
        best = s["policies"]["oracle_best"]["nominee_vs_parent"]["win_rate"]
        assert all(p["nominee_vs_parent"]["win_rate"] <= best for p in s["policies"].values())
        assert str(s["parent"]) in s["greedy_looks"]  # the greedy baseline's looks ran as extra eval jobs
        assert s["extra_eval_gpuh"] > 0
    assert set(result["summary"]) == {"playbook", "greedy", "last_arm", "oracle_best"}
    for summary in result["summary"].values():
        assert SUMMARY_KEYS <= set(summary)
    assert [g["goal"] for g in result["goals"]] == ["nominee_truly_worse_sessions", "nominee_truly_better_share",
                                                     "false_promotion_share", "improvement_per_gpuh_vs_greedy",
                                                     "within_oracle_ci_share"]
    assert result["table"].count("\n") == 5  # header, rule, four policies


def _promotions(db: Path) -> list[tuple[int, int]]:
    """(previous, new) of every change of incumbent, straight from the decision rows."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT payload FROM decision WHERE kind = 'promote' ORDER BY seq").fetchall()
    payloads = [json.loads(r[0]) for r in rows]
    return [(p["previous"], p["artifact_id"]) for p in payloads if p.get("action") == "incumbent"]


def _key(db: Path, artifact: int, lab_served: dict) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        sha, recipe = conn.execute("SELECT sha256, recipe FROM artifact WHERE id = ?", (artifact,)).fetchone()
    decoding = json.loads(recipe).get("served_decoding", lab_served)
    return answer_key(sha, Decoding.model_validate(decoding))


def _false(lab: Path, cache: Path, new: str, old: str) -> bool:
    """Not truly better: the 95% CI of the new incumbent's points against the old one reaches 0.5."""
    from evals.judge import judged_prompt

    tasks, _ = draw_sample(lab, TRUTH_N, 0)
    prompts = [judged_prompt(t.item("truth")) for t in tasks]
    a, b = (json.loads((cache / f"{k}.json").read_text())["answers"] for k in (new, old))
    points = []
    for p, x, y in zip(prompts, a, b, strict=True):
        verdict = oracle.true_verdict(p, x, y)[0]
        points.append({"A": 1.0, "B": 0.0}.get(verdict, 0.5))
    mean = sum(points) / len(points)
    sd = math.sqrt(sum((q - mean) ** 2 for q in points) / (len(points) - 1))
    return mean - 1.96 * sd / math.sqrt(len(points)) <= 0.5


def test_false_promotions_recomputed_from_the_notebooks(bench_run):
    result, work = bench_run
    total = 0
    for s in result["sessions"]:
        lab = Path(s["lab"])
        db = lab / "notebook.db"
        promotions = _promotions(db)
        recorded = s["policies"]["playbook"]["promotions"]
        assert [(p["from"], p["to"]) for p in recorded] == promotions
        parent_served = next(c for c in s["candidates"] if c["id"] == s["parent"])["key"]
        served = _served(db, s["parent"])
        assert _key(db, s["parent"], served) == parent_served
        cache = work / f"judge-{s['seed']}" / f"truth-n{TRUTH_N}-s0"
        false = sum(_false(lab, cache, _key(db, new, served), _key(db, old, served)) for old, new in promotions)
        assert false == s["policies"]["playbook"]["n_false"]
        total += false
        for name in ("greedy", "last_arm", "oracle_best"):  # the baselines' promotions, classified here again
            rows = s["policies"][name]["promotions"]
            again = sum(_false(lab, cache, _key(db, r["to"], served), _key(db, r["from"], served)) for r in rows)
            assert again == s["policies"][name]["n_false"], name
    assert total == result["summary"]["playbook"]["false_promotions"]


def _served(db: Path, parent: int) -> dict:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (recipe,) = conn.execute("SELECT recipe FROM artifact WHERE id = ?", (parent,)).fetchone()
    return json.loads(recipe)["served_decoding"]


def test_greedy_baseline_rewalked_from_its_looks(bench_run):
    result, _ = bench_run
    for s in result["sessions"]:
        looks = {int(k): v["win_score"] for k, v in s["greedy_looks"].items()}
        inc, walked = s["parent"], []
        for c in s["candidates"]:
            if c["origin"].startswith(("train:", "merge:")) and looks[c["id"]] > looks[inc]:
                walked.append((inc, c["id"]))
                inc = c["id"]
        assert [(p["from"], p["to"]) for p in s["policies"]["greedy"]["promotions"]] == walked
        assert s["policies"]["greedy"]["nominee"] == inc
