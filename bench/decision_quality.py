"""Decision quality: how often the agent's promotions are real, against naive policies, in the toy world.

    .venv/bin/python bench/decision_quality.py [--seeds 10] [--first-seed 1] [--size test|demo] [--budget 60gpuh]
        [--protocol short|test|full] [--world-seed 0 | --world-per-seed] [--truth-n 2000] [--work DIR] [--parallel 1]
        [--out bench/results/decision_quality.json]
    .venv/bin/python bench/decision_quality.py --variants noisy-judge,small-holdout,harmful-arms,strong-parent,misleading-screens
        [--seeds 10] [--first-seed 201] [--size test] ... [--out bench/results/decision_quality-variants.json]
    .venv/bin/python bench/decision_quality.py --merge A.json B.json ... --out bench/results/decision_quality-variants.json

`--variants` runs `--seeds` judged sessions per world variant (tools/world/variants.py), each on its own world:
the seed's default world is built once in WORK/world-SEED and each variant of it in WORK/VARIANT/world-SEED,
sharing the default's trained parts where the variant keeps them (`build(..., reuse=)`, the same bytes as a build
of its own). A variant world whose feedback the agent's input checks refuse (a test-size file of 64 battles whose
split is too skewed, most often) opens no session: it is recorded under `refused` and the next seed is taken
(at most 3 x `--seeds` seeds). The result is `{"variants": {NAME: {"summary": {policy: {...}}, "goals": [...],
"truth_table": {...}, "sessions": [...], "refused": [...]}}}`; the issue 33 figures per policy are
`sessions`, `nominee_truly_worse_sessions`, `false_promotion_share`, `truly_better_share_where_oracle_better`,
`oracle_gain_capture` (mean nominee gain / oracle-best gain where the oracle-best is truly better) and
`parent_kept_share`, each share with its 95% Wilson interval over sessions, beside the truth sample's
resolution (`truth_resolution`: the mean and largest 95% CI half-width of the nominee-vs-parent comparisons,
and the smallest true gain the sample detects with 80% power, 2.8 standard errors).

The world (seed `--world-seed`) is built once, in WORK/world. Each session seed gets its own copy of it
with the feedback drawn afresh (WORK/lab-SEED, tools/world/decision_quality.redraw_feedback: new battle
prompts, the parent's answers and the oracle's votes at that seed), so a seed costs a battle generation,
not a world build. With `--world-per-seed` each session seed gets its own world instead, built with that
seed in WORK/world-SEED (its own pretraining, parent, opponent, suites and feedback; a world build per seed,
about 160 CPU-s at the demo size), so that the arms' true effects differ between sessions too. Its bars get the p-value family the protocol really uses
(`PlaybookSettings.comparisons()`). One playbook session runs on it (`run_agent.py --budget B --protocol
P`, a real session with real jobs; a finished session found there is reused), then its decisions are
judged against the world's ground truth: a fresh truth sample, never seen by the agent, answered by every
checkpoint the session made (tools/world/decision_quality.TruthBank, the sample `world truth` draws) and
judged pairwise by the noise-free oracle.

Four policies are applied to the same session's candidates (no extra training):

- playbook: the session's own promotions and nominee (the parent when it nominated nothing), read from the
  notebook; `agent.replay` re-derives the session's decisions from the recorded evals and must reproduce them
  (`replay_reproduced`);
- greedy: walk the trained and merged candidates in the order the session made them and promote whenever the
  dev-holdout win score at greedy decoding beats the incumbent's (no noise floor, no bars). The session
  evaluated at served decoding only, so each greedy look is an extra eval job (the holdout judge suite against
  the parent's reference completions), run by this benchmark and charged apart (`extra_gpuh`);
- last_arm: nominate the last trained arm (its final checkpoint, not a mid-way snapshot; one promotion,
  parent -> it);
- oracle_best: the candidate with the highest true win rate against the parent (the ceiling).

Per promotion: the new incumbent against the one it replaced on the truth sample; a false promotion is one
that is not truly better (its 95% CI does not lie above 0.5). Per session and policy: nominee against
parent (truly better / truly worse at the CI), the true improvement (win rate - 0.5) per GPU-hour (the
session's settled GPU-hours, plus the policy's extra evals), and whether the nominee is within the CI of the
oracle-best (the oracle-best does not truly beat it head to head). The summary checks issue 16's goals.

A second accounting sits beside the goal's (`own_gpuh`, "gain per own GPU-h"): each policy charged only what
it needs itself. The playbook pays its whole session; greedy pays for making the candidates (ingest, builds,
training, merges), the parent's reference answers and its looks; last_arm only for making them. It shows what
the playbook's rigor (calibrations, screens, judged evals, sealed confirmation) costs per unit of true gain.

Since every policy picks from the same candidates and the goal's accounting charges them the same session,
the goal's ratio is bounded: playbook / greedy <= (oracle-best gain / greedy gain) x (1 + greedy's extra evals /
session GPU-h). The playbook can only beat greedy by more where greedy's picks lose true gain.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.config import load_lab_config, parse_budget  # noqa: E402
from agent.inputs import check_inputs  # noqa: E402
from agent.planners.playbook import PROTOCOLS, PlaybookSettings  # noqa: E402
from agent.runner import lab_spec  # noqa: E402
from agent.summary import summarize  # noqa: E402
from core.util import file_sha256  # noqa: E402
from evals.decoding import Decoding  # noqa: E402
from memory.notebook import Notebook  # noqa: E402
from memory.state import fold  # noqa: E402
from tools.session import registered_bars, verdicts_of  # noqa: E402
from tools.world.build import build  # noqa: E402
from tools.world.decision_quality import PairTruth, TruthBank, answer_key, redraw_feedback  # noqa: E402
from tools.world.variants import VARIANT_NAMES  # noqa: E402

SESSION = "dq"
POLICIES = ("playbook", "greedy", "last_arm", "oracle_best")
GOALS = {
    "nominee_truly_worse_sessions": "== 0",
    "nominee_truly_better_share": ">= 0.90",
    "false_promotion_share": "<= 0.05",
    "improvement_per_gpuh_vs_greedy": ">= 1.5",
    "within_oracle_ci_share": ">= 0.70",
}


# ---- one session --------------------------------------------------------------------------------


def session_command(lab: Path, budget: str, protocol: str) -> list[str] | None:
    """run_agent.py's arguments for the playbook session on `lab`: a new session, or the resumption of an
    interrupted one (a benchmark killed midway goes on where it stopped); None when a finished one is there."""
    command = ["--budget", budget, "--lab", str(lab), "--session", SESSION, "--protocol", protocol, "--quiet"]
    if (lab / "notebook.db").exists():
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            states = [s.status for s in nb.sessions() if s.name == SESSION]
        if states and states[0] != "open":
            return None
        command = ["resume", SESSION, "--lab", str(lab), "--quiet"] if states else command
    return [sys.executable, str(REPO / "run_agent.py"), *command]


def run_sessions(labs: dict[int, Path], budget: str, protocol: str, work: Path, parallel: int) -> dict[int, float]:
    """Each seed's session, `parallel` at a time; returns their wall seconds (0 for one found finished)."""
    pending, running, walls = list(labs), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            seed = pending.pop(0)
            command = session_command(labs[seed], budget, protocol)
            if command is None:
                walls[seed] = 0.0
                continue
            log = open(work / f"session-{seed}.log", "a")
            proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            running[seed] = (proc, log, time.monotonic())
        time.sleep(1.0)
        for seed, (proc, log, start) in [(k, v) for k, v in running.items() if v[0].poll() is not None]:
            del running[seed]
            log.close()
            if proc.returncode not in (0, 1):  # 1: the session ended failed, which is a result to judge
                raise SystemExit(f"session on {labs[seed]} exited {proc.returncode}; see {work}/session-{seed}.log")
            walls[seed] = time.monotonic() - start
    return walls


def session_facts(nb: Notebook, lab: Path) -> dict[str, Any]:
    """What the session decided, from its notebook: candidates in the order made, promotions, nominee."""
    served = lab_spec(load_lab_config(lab)).served
    s = summarize(nb, SESSION)
    cands = []
    for c in s.checkpoints:
        a = nb.artifact(c.id)
        decoding = Decoding.model_validate(a.recipe["served_decoding"]) if "served_decoding" in a.recipe else served
        cands.append({"id": c.id, "name": c.name, "origin": c.origin, "path": a.path, "sha256": a.sha256,
                      "snapshot": "snapshot" in a.recipe,  # a run's mid-way save (trajectory selection), not an arm
                      "decoding": decoding.model_dump(mode="json"), "key": answer_key(a.sha256, decoding)})
    state = fold(nb, SESSION)
    promotions = [(c.previous, c.artifact_id) for c in state.changes]
    parent = state.parent
    return {"parent": parent, "candidates": cands, "promotions": promotions,
            # a session that nominated nothing (every bundle refused, or it failed) ships nothing: the parent stays
            "nominee": state.nominee if state.nominee is not None else parent,
            "nominated": state.nominee is not None,
            "spent_gpuh": state.ledger.spent_gpuh, "making_gpuh": _making_gpuh(nb),
            "parent_reference_gpuh": _parent_reference_gpuh(nb), "status": nb.session(SESSION).status,
            "budget_gpuh": nb.session(SESSION).budget_gpuh}


# Job kinds that score rather than make: what a policy that needs no evaluation of its own does not pay for.
SCORING_KINDS = {"eval", "reference", "truth", "bundle"}


def _making_gpuh(nb: Notebook) -> float:
    """GPU-hours of the jobs that made the session's data and candidates (ingest, dataset builds, training,
    merges): what any policy walking these candidates pays before it looks at one."""
    return sum(j.gpu_hours or 0.0 for j in nb.jobs(session=SESSION) if j.kind not in SCORING_KINDS)


def _parent_reference_gpuh(nb: Notebook) -> float:
    """GPU-hours of the parent's reference answers (the session's first reference job, its calibration's), which
    the greedy looks are judged against."""
    refs = [j for j in nb.jobs(session=SESSION) if j.kind == "reference"]
    return (refs[0].gpu_hours or 0.0) if refs else 0.0


def replay_reproduced(lab: Path) -> bool:
    """Whether `agent.replay` re-derives the session's decision sequence exactly from the recorded evals."""
    from agent.errors import SessionError
    from agent.replay import replay

    try:
        return replay(lab, SESSION).same
    except SessionError:
        return False


# ---- greedy looks (extra eval jobs) ---------------------------------------------------------------


def greedy_looks(lab: Path, facts: dict[str, Any], work: Path) -> dict[int, dict[str, float]]:
    """Dev-holdout win score at greedy decoding of the parent and every weights candidate (cached per lab)."""
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "greedy.json"
    looks = {int(k): v for k, v in json.loads(cache.read_text()).items()} if cache.is_file() else {}
    ids = [facts["parent"]] + [c["id"] for c in facts["candidates"] if _weights(c)]
    missing = [i for i in ids if i not in looks]
    if missing:
        looks |= _run_greedy(lab, facts, missing)
        cache.write_text(json.dumps({str(k): v for k, v in looks.items()}, indent=1))
    return looks


def _weights(c: dict[str, Any]) -> bool:
    return c["origin"].startswith(("train:", "merge:"))


def _run_greedy(lab: Path, facts: dict[str, Any], ids: list[int]) -> dict[int, dict[str, float]]:
    from evals.job import run as run_eval
    from tools.context import ToolContext
    from tools.evaluate import MissingReference, eval_job, references_of
    from tools.paths import LabPaths

    config = load_lab_config(lab)
    factor = config.executor.simulated_gpuh_per_device_s or 1 / 3600
    out = {}
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        ctx = ToolContext(nb=nb, session=SESSION, paths=LabPaths(root=lab), lab=lab_spec(config), jobs=None)
        reference = references_of(ctx, facts["parent"])
        suite = next(s.name for s in ctx.lab.open_suites if s.judged)
        for i in ids:
            served = next(Decoding.model_validate(c["decoding"]) for c in facts["candidates"] if c["id"] == i)
            greedy = served.model_copy(update={"temperature": 0.0, "top_p": 1.0})
            try:
                cfg = eval_job(ctx, i, [suite], greedy, False, 1, reference)
            except MissingReference:  # the parent's calibration failed: no reference answers, no greedy look
                return {}
            result, seconds = _look(cfg, run_eval)
            out[i] = {"win_score": result.suites[0].metrics["win_score"], "device_s": seconds, "gpuh": seconds * factor}
    return out


def _look(cfg, run_eval):
    """Run one greedy look, or read back its result when an earlier run of the bench finished it (the job
    writes result.json last; a folder without one is an interrupted look, and judgments are written once)."""
    import shutil

    from evals.job import EvalResult

    done = cfg.output_dir / "result.json"
    if done.is_file():
        result = EvalResult.model_validate_json(done.read_text())
        return result, result.load_s + result.generation_s
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    start = time.monotonic()
    result = run_eval(cfg)
    return result, time.monotonic() - start


# ---- policies -----------------------------------------------------------------------------------


def policy_greedy(facts: dict[str, Any], looks: dict[int, dict[str, float]]) -> tuple[list[tuple[int, int]], int]:
    """Promote each weights candidate, in the order made, whose greedy holdout score beats the incumbent's."""
    inc, promotions = facts["parent"], []
    for c in facts["candidates"]:
        if _weights(c) and c["id"] in looks and looks[c["id"]]["win_score"] - looks[inc]["win_score"] > 0:
            promotions.append((inc, c["id"]))
            inc = c["id"]
    return promotions, inc


def policy_last_arm(facts: dict[str, Any]) -> tuple[list[tuple[int, int]], int]:
    trained = [c["id"] for c in facts["candidates"] if c["origin"].startswith("train:") and not c["snapshot"]]
    return ([(facts["parent"], trained[-1])], trained[-1]) if trained else ([], facts["parent"])


def policy_oracle_best(facts: dict[str, Any], vs_parent: dict[int, PairTruth]) -> tuple[list[tuple[int, int]], int]:
    best = max(vs_parent, key=lambda i: (vs_parent[i].win_rate, -i))
    return ([(facts["parent"], best)] if best != facts["parent"] else []), best


# ---- truth ----------------------------------------------------------------------------------------


def judge_policy(name: str, promotions: list[tuple[int, int]], nominee: int, facts: dict[str, Any],
                 bank: TruthBank, keys: dict[int, str], vs_parent: dict[int, PairTruth], gpuh: float,
                 own_gpuh: float | None) -> dict[str, Any]:
    rows = []
    for prev, new in promotions:
        t = bank.pair(keys[new], keys[prev])
        rows.append({"from": prev, "to": new, "win_rate": t.win_rate, "ci_low": t.ci_low, "ci_high": t.ci_high,
                     "truly_better": t.truly_better, "false": not t.truly_better})
    nom = vs_parent[nominee]
    best = max(vs_parent, key=lambda i: (vs_parent[i].win_rate, -i))
    # within the CI of the ceiling: the oracle-best does not truly beat the nominee head to head
    beaten = bank.pair(keys[best], keys[nominee]).truly_better
    return {
        "policy": name, "nominee": nominee, "nominee_name": _name(facts, nominee),
        "nominee_vs_parent": {"win_rate": nom.win_rate, "ci_low": nom.ci_low, "ci_high": nom.ci_high},
        "nominee_truly_better": nom.truly_better, "nominee_truly_worse": nom.truly_worse,
        "promotions": rows, "n_promotions": len(rows), "n_false": sum(r["false"] for r in rows),
        "gpuh": gpuh, "true_improvement": nom.win_rate - 0.5,
        "improvement_per_gpuh": (nom.win_rate - 0.5) / gpuh if gpuh > 0 else 0.0,
        "own_gpuh": own_gpuh, "within_oracle_ci": not beaten,
    }


def _name(facts: dict[str, Any], artifact: int) -> str:
    return next(c["name"] for c in facts["candidates"] if c["id"] == artifact)


def judge_session(seed: int, lab: Path, work: Path, truth_n: int, truth_seed: int, device: str) -> dict[str, Any]:
    """Judge one finished session; its greedy looks and truth answers are cached in `work`."""
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        facts = session_facts(nb, lab)
    reproduced = replay_reproduced(lab)
    looks = greedy_looks(lab, facts, work)
    bank = TruthBank(lab, work, n=truth_n, seed=truth_seed, device=device)
    keys = {}
    for c in facts["candidates"]:
        bank.answers(c["key"], Path(c["path"]), Decoding.model_validate(c["decoding"]))
        keys[c["id"]] = c["key"]
    vs_parent = {i: bank.pair(k, keys[facts["parent"]]) for i, k in keys.items()}
    extra = sum(v["gpuh"] for v in looks.values())
    spent = facts["spent_gpuh"]
    # (promotions, nominee, GPU-h charged as the issue states: the session's plus the policy's extra evals,
    #  GPU-h the policy itself needs: making the candidates plus its own looks; None for the oracle, which reads truth)
    making = facts["making_gpuh"]
    chosen = {"playbook": (facts["promotions"], facts["nominee"], spent, spent),
              "greedy": (*policy_greedy(facts, looks), spent + extra, making + facts["parent_reference_gpuh"] + extra),
              "last_arm": (*policy_last_arm(facts), spent, making),
              "oracle_best": (*policy_oracle_best(facts, vs_parent), spent, None)}
    policies = {name: judge_policy(name, p, n, facts, bank, keys, vs_parent, g, own)
                for name, (p, n, g, own) in chosen.items()}
    cands = [{k: c[k] for k in ("id", "name", "origin", "key")} | {"vs_parent": vs_parent[c["id"]].model_dump(
        include={"win_rate", "ci_low", "ci_high"})} for c in facts["candidates"]]
    return {"seed": seed, "session": SESSION, "lab": str(lab), "status": facts["status"],
            "budget_gpuh": facts["budget_gpuh"], "spent_gpuh": spent, "making_gpuh": making,
            "replay_reproduced": reproduced, "parent": facts["parent"], "candidates": cands,
            "greedy_looks": {str(k): v for k, v in looks.items()}, "extra_eval_gpuh": extra,
            "truth_cache": str(bank.cache), "truth_generation_s": bank.generation_s, "policies": policies}


# ---- summary --------------------------------------------------------------------------------------


def summarize_policy(sessions: list[dict[str, Any]], name: str) -> dict[str, Any]:
    ps = [s["policies"][name] for s in sessions]
    promotions = sum(p["n_promotions"] for p in ps)
    false = sum(p["n_false"] for p in ps)
    gpuh = sum(p["gpuh"] for p in ps)
    return {**_hard_world_figures(sessions, name),
        "sessions": len(ps), "nominee_truly_worse_sessions": sum(p["nominee_truly_worse"] for p in ps),
        "nominee_truly_better_share": sum(p["nominee_truly_better"] for p in ps) / len(ps),
        "promotions": promotions, "false_promotions": false,
        "false_promotion_share": false / promotions if promotions else 0.0,
        "mean_true_improvement": sum(p["true_improvement"] for p in ps) / len(ps), "gpuh": gpuh,
        "improvement_per_gpuh": sum(p["true_improvement"] for p in ps) / gpuh if gpuh > 0 else 0.0,
        "within_oracle_ci_share": sum(p["within_oracle_ci"] for p in ps) / len(ps),
        **_own(ps),
    }


def _own(ps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Gain per GPU-hour the policy itself needs (None for the oracle): a second accounting beside the goal's."""
    if any(p.get("own_gpuh") is None for p in ps):
        return {"own_gpuh": None, "improvement_per_own_gpuh": None}
    own = sum(p["own_gpuh"] for p in ps)
    return {"own_gpuh": own, "improvement_per_own_gpuh": sum(p["true_improvement"] for p in ps) / own if own > 0 else 0.0}


def check_goals(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    play, greedy = summary["playbook"], summary["greedy"]
    ratio = (play["improvement_per_gpuh"] / greedy["improvement_per_gpuh"]
             if greedy["improvement_per_gpuh"] > 0 else None)
    measured = {k: play[k] for k in GOALS if k in play} | {"improvement_per_gpuh_vs_greedy": ratio}
    out = []
    for goal, rule in GOALS.items():
        op, target = rule.split()
        value = measured[goal]
        met = value is not None and {"==": value == float(target), ">=": value >= float(target),
                                     "<=": value <= float(target)}[op]
        out.append({"goal": goal, "target": rule, "measured": value, "met": bool(met)})
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    head = ("| policy | sessions | nominee truly better | nominee truly worse | promotions | false | "
            "mean true gain | gain per GPU-h | gain per own GPU-h | within oracle CI |")
    lines = [head, "|" + "---|" * 10]
    for name, p in summary.items():
        lines.append(f"| {name} | {p['sessions']} | {p['nominee_truly_better_share']:.0%} | "
                     f"{p['nominee_truly_worse_sessions']} | {p['promotions']} | {p['false_promotions']} "
                     f"({p['false_promotion_share']:.0%}) | {p['mean_true_improvement']:+.3f} | "
                     f"{p['improvement_per_gpuh']:+.4f} | {_signed(p.get('improvement_per_own_gpuh'))} | "
                     f"{p['within_oracle_ci_share']:.0%} |")
    return "\n".join(lines)


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


# ---- issue 33: the figures that must hold when the world is hard -----------------------------------

# The goals of issue 33, in every variant (the parent-kept goal in strong-parent only).
VARIANT_GOALS = {
    "nominee_truly_worse_sessions": "== 0",
    "false_promotion_share": "<= 0.05",
    "truly_better_share_where_oracle_better": ">= 0.90",
    "oracle_gain_capture": ">= 0.85",
}
STRONG_PARENT_GOALS = {"parent_kept_share": ">= 0.90", "false_promotions": "== 0"}
Z80 = 2.8  # standard errors a true gain must span to be detected at 95% two-sided with 80% power (1.96 + 0.84)


def wilson(k: int, n: int) -> list[float] | None:
    """The 95% Wilson interval of a share of k in n sessions (None without sessions): the rate's own resolution."""
    if n == 0:
        return None
    z, p = 1.96, k / n
    mid, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, mid - half), 4), round(min(1.0, mid + half), 4)]


def _hard_world_figures(sessions: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """A policy's issue-33 figures over sessions: nominee never truly worse, false promotions, the share truly better
    and the gain captured where the oracle-best is truly better, the parent kept; shares with their Wilson interval."""
    ps = [s["policies"][name] for s in sessions]
    better = [(s["policies"][name], s["policies"]["oracle_best"]) for s in sessions
              if s["policies"]["oracle_best"]["nominee_truly_better"]]
    kept = sum(p["nominee"] == s["parent"] for p, s in zip(ps, sessions, strict=True))
    worse = sum(p["nominee_truly_worse"] for p in ps)
    hit = sum(p["nominee_truly_better"] for p, _ in better)
    capture = [p["true_improvement"] / o["true_improvement"] for p, o in better]
    return {
        "nominee_truly_worse_share_ci": wilson(worse, len(ps)),
        "oracle_better_sessions": len(better),
        "truly_better_share_where_oracle_better": hit / len(better) if better else None,
        "truly_better_share_where_oracle_better_ci": wilson(hit, len(better)),
        "oracle_gain_capture": sum(capture) / len(capture) if capture else None,
        "oracle_gain_capture_per_session": capture,
        "parent_kept_share": kept / len(ps), "parent_kept_share_ci": wilson(kept, len(ps)),
        "truth_resolution": truth_resolution(sessions),
    }


def truth_resolution(sessions: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """How fine the truth sample resolves a gain: the 95% CI half-widths of every candidate against its parent
    (a candidate of the parent's own answers has none) and the smallest gain it detects with 80% power."""
    halves = [(c["vs_parent"]["ci_high"] - c["vs_parent"]["ci_low"]) / 2 for s in sessions for c in s["candidates"]
              if c["id"] != s["parent"] and c["vs_parent"]["ci_high"] > c["vs_parent"]["ci_low"]]
    if not halves:
        return {"truth_n": None, "ci_half_width_mean": None, "ci_half_width_max": None, "min_detectable_gain_80": None}
    return {"truth_n": sessions[0]["truth_n"] if "truth_n" in sessions[0] else None,
            "ci_half_width_mean": sum(halves) / len(halves), "ci_half_width_max": max(halves),
            "min_detectable_gain_80": max(halves) * Z80 / 1.96}


def check_variant_goals(variant: str, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 33's goals for the playbook in one variant; a goal with nothing to measure (no session where the
    oracle-best is truly better) is `met: None`."""
    play = summary["playbook"]
    goals = VARIANT_GOALS | (STRONG_PARENT_GOALS if variant == "strong-parent" else {})
    out = []
    for goal, rule in goals.items():
        op, target = rule.split()
        value = play[goal]
        met = None if value is None else {"==": value == float(target), ">=": value >= float(target),
                                          "<=": value <= float(target)}[op]
        out.append({"goal": goal, "target": rule, "measured": value, "met": met})
    return out


def truth_table(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """What the variant's world is, measured with the oracle over its sessions: every candidate kind's true win rate
    against the parent (mean, truly better / worse counts), the largest true gain any candidate had, the noise of
    the feedback's votes against the true verdicts, the dev holdout's size, and how often the verified screen
    ranks two candidates the way the truth does."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for s in sessions:
        for c in s["candidates"]:
            if c["id"] != s["parent"]:
                kinds.setdefault(c["origin"].split("-")[0], []).append(c["vs_parent"])
    table = {kind: {"n": len(v), "mean_win_rate": sum(x["win_rate"] for x in v) / len(v),
                    "truly_better": sum(x["ci_low"] > 0.5 for x in v), "truly_worse": sum(x["ci_high"] < 0.5 for x in v)}
             for kind, v in sorted(kinds.items())}
    gains = [c["vs_parent"]["win_rate"] - 0.5 for s in sessions for c in s["candidates"] if c["id"] != s["parent"]]
    facts = [s["world_facts"] for s in sessions if "world_facts" in s]
    agree = [a for f in facts for a in f["screen_agrees"]]
    return {"candidates": table, "max_true_gain": max(gains) if gains else None,
            "vote_wrong_share": _pooled(facts, "decisive", "wrong"), "vote_tie_share": _pooled(facts, "battles", "tie"),
            "dev_battles_max": max((f["dev_battles"] for f in facts), default=None),
            "dev_battles_mean": sum(f["dev_battles"] for f in facts) / len(facts) if facts else None,
            "screen_truth_pairs": len(agree), "screen_agrees_with_truth_share": sum(agree) / len(agree) if agree else None}


def _pooled(facts: list[dict[str, Any]], total: str, part: str) -> float | None:
    n = sum(f["votes"][total] for f in facts)
    return sum(f["votes"][part] for f in facts) / n if n else None


def world_facts(lab: Path, session: dict[str, Any]) -> dict[str, Any]:
    """A session's world as the oracle sees it: the feedback's votes against the true verdicts (wrong sides among
    the decisive ones, ties among all), the dev holdout's size, and, for every pair of candidates the verified screen
    scored apart and the truth sample ranks apart, whether the screen ranks them the same way."""
    from evals.judge import judged_prompt
    from evals.types import Item
    from tools.world import oracle

    votes = {"battles": 0, "decisive": 0, "wrong": 0, "tie": 0}
    for line in (lab / "world/feedback/battles.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        prompt = judged_prompt(Item(id=row["id"], messages=row["messages"]))
        true, _ = oracle.true_verdict(prompt, row["own"], row["other"])
        votes["battles"] += 1
        votes["tie"] += row["vote"] == "tie"
        if true in ("A", "B"):
            votes["decisive"] += 1
            votes["wrong"] += row["vote"] == ("other" if true == "A" else "own")
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        split = nb.latest_split()
        dev = sum(split.counts.get("dev", {}).values()) if split is not None else 0
        screen = {}
        for c in session["candidates"]:
            looks = [e for e in nb.evals(artifact_id=c["id"], suite="synthetic", session=SESSION)
                     if e.served and e.replicate == 0]
            if looks:
                screen[c["id"]] = looks[0].metrics["correct"]
    truth = {c["id"]: c["vs_parent"]["win_rate"] for c in session["candidates"]}
    ids = sorted(screen)
    agrees = [(screen[a] - screen[b]) * (truth[a] - truth[b]) > 0 for i, a in enumerate(ids) for b in ids[i + 1:]
              if screen[a] != screen[b] and truth[a] != truth[b]]
    return {"votes": votes, "dev_battles": dev, "screen_agrees": agrees}


def run_variant(args: argparse.Namespace, name: str, progress=None) -> dict[str, Any]:
    """`--seeds` judged sessions on `name`'s worlds, one world per seed from `--first-seed` (or `--seed-list`) on;
    a world whose inputs the agent refuses is recorded and the next seed taken."""
    vargs = argparse.Namespace(**vars(args) | {"work": args.work / name, "variant": name, "world_per_seed": True,
                                               "default_worlds": args.work})
    vargs.work.mkdir(parents=True, exist_ok=True)
    wanted = len(args.seed_list) if args.seed_list else args.seeds
    seeds = args.seed_list or list(range(args.first_seed, args.first_seed + 3 * args.seeds))
    rows, refused = [], []
    for seed in seeds:
        if len(rows) == wanted:
            break
        done = vargs.work / f"seed-{seed}.json"
        if args.reuse_rows and done.is_file():
            rows.append(json.loads(done.read_text()))
            continue
        prepared = prepare(vargs, seed)
        if "refused" in prepared:
            refused.append({"seed": seed, "problems": prepared["refused"]})
            print(f"{name} seed {seed}: refused ({prepared['refused'][0][:160]})", flush=True)
            continue
        walls = run_sessions({seed: prepared["lab"]}, args.budget, args.protocol, vargs.work, 1)
        row = finish(vargs, seed, prepared, walls[seed])
        row |= {"truth_n": args.truth_n, "world_facts": world_facts(prepared["lab"], row)}
        done.write_text(json.dumps(row, indent=1) + "\n")
        rows.append(row)
        if progress is not None:
            progress(rows, refused)
    return variant_result(name, rows, refused)


def variant_result(name: str, rows: list[dict[str, Any]], refused: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {policy: summarize_policy(rows, policy) for policy in POLICIES} if rows else {}
    return {"summary": summary, "goals": check_variant_goals(name, summary) if rows else [],
            "truth_table": truth_table(rows), "oracle_reach": oracle_reach(rows), "seeds": [r["seed"] for r in rows],
            "refused": refused, "table": table(summary) if rows else "", "sessions": rows}


def oracle_reach(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the playbook lost the oracle-best, read from each session's notebook: in the sessions where the
    oracle-best candidate is truly better than the parent, how often it was never compared under the bars (never
    looked at on the judged holdout: the screen kept it out; or looked at and ranked below the stage's promoted
    leader), and how often it was compared and not promoted, with the bars it failed. `policy_versions`: the rules
    each session ran."""
    better, never, unlooked, rejected, failed, versions = [], [], [], [], {}, set()
    for r in rows:
        oracle = r["policies"]["oracle_best"]
        with Notebook.open(Path(r["lab"]) / "notebook.db", readonly=True) as nb:
            opened = fold(nb, r["session"]).opened
            versions.add(opened.policy.version if opened is not None and opened.policy is not None else None)
            calls = nb.tool_calls(r["session"])
            compared = {c.args.get("candidate") for c in calls if c.tool == "compare"}
            judged = {rule.suite for rule in registered_bars(nb, r["session"]).p_rules}
            looked = {c.args.get("artifact") for c in calls if c.tool == "evaluate" and judged & set(c.args.get("suites", []))}
            bars = [f"{b.bar.suite}/{b.bar.metric}" for v in verdicts_of(nb, r["session"])
                    if v.candidate == oracle["nominee"] and not v.cleared for b in v.bars if not b.holds]
        if oracle["nominee"] == r["parent"] or not oracle["nominee_truly_better"]:
            continue
        better.append(r["seed"])
        if oracle["nominee"] not in compared:
            never.append(r["seed"])
            if oracle["nominee"] not in looked:
                unlooked.append(r["seed"])
        elif r["policies"]["playbook"]["nominee"] != oracle["nominee"]:
            rejected.append(r["seed"])
            failed[str(r["seed"])] = bars
    return {"oracle_better_seeds": better, "oracle_best_never_compared_seeds": never,
            "oracle_best_never_looked_at_seeds": unlooked,
            "oracle_best_compared_not_nominated_seeds": rejected, "oracle_best_failed_bars": failed,
            "policy_versions": sorted(v for v in versions if v is not None)}


def _variant_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in VARIANT_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated world variants of "
                                         f"{', '.join(VARIANT_NAMES)}")
    return names


class MergeRefused(Exception):
    """A `--merge` input that cannot be merged: the message names the file and what was expected."""


def merge_variants(paths: list[Path], out: Path) -> int:
    """One variants result from several runs' (`--variants ... --out A.json`, each run one or more variants): every
    run's entry kept under `runs`, and each variant's result taken from the one file that holds it. The runs must
    agree on the settings that make their figures comparable (protocol, budget, truth sample; the world size may
    differ, as strong-parent needs its own); a variant held by two files is refused rather than silently replaced.
    Nothing is written unless every file merges (exit 2 with one line otherwise)."""
    try:
        merged, owner = merged_variants(paths)
    except MergeRefused as exc:
        print(f"decision_quality.py --merge: {exc}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    for name, result in merged["variants"].items():
        print(f"== {name} ({len(result['sessions'])} sessions, from {owner[name]})\n{result['table']}")
    return 0


def merged_variants(paths: list[Path]) -> tuple[dict[str, Any], dict[str, Path]]:
    runs, variants, owner, keys = [], {}, {}, ("protocol", "budget", "truth_n", "truth_seed")
    first: tuple[str, dict[str, Any]] | None = None
    for path in paths:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            file_runs = data["runs"] if "runs" in data else [{k: data[k] for k in ("command", "config", "host", "wall_s")}
                                                             | {"variants": sorted(data["variants"])}]
            file_variants = dict(data["variants"])
            settings = [(run["command"], {k: run["config"].get(k) for k in keys}) for run in file_runs]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MergeRefused(f"{path}: expected a `--variants` result (JSON with `variants`, and `command` and "
                               f"`config` or `runs`): {type(exc).__name__}: {exc}") from None
        for command, config in settings:
            if first is None:
                first = (command, config)
            elif config != first[1]:
                raise MergeRefused(f"{path}: `{command}` ran with {config}, `{first[0]}` with {first[1]}: figures "
                                   "from different settings are not merged")
        runs.extend(file_runs)
        for name, result in file_variants.items():
            if name in owner:
                raise MergeRefused(f"{path}: variant {name!r} is also in {owner[name]}; take each variant from one file")
            owner[name], variants[name] = path, result
    return {"runs": runs, "variants": variants}, owner


def main_variants(args: argparse.Namespace, argv: list[str] | None) -> int:
    start = time.monotonic()
    result = {"command": "python bench/decision_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "host": {"machine": platform.machine(), "python": platform.python_version()}, "variants": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(name: str, rows: list[dict[str, Any]], refused: list[dict[str, Any]] | None = None) -> None:
        """The result so far (after every session: a run stopped midway keeps what it measured)."""
        result["variants"][name] = variant_result(name, rows, refused or [])
        result["wall_s"] = time.monotonic() - start
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    for name in args.variants:
        done = run_variant(args, name, lambda rows, refused, name=name: write(name, rows, refused))
        write(name, done["sessions"], done["refused"])
        print(f"== {name}\n{result['variants'][name]['table']}")
        for g in result["variants"][name]["goals"]:
            verdict = "not measurable" if g["met"] is None else "met" if g["met"] else "NOT met"
            print(f"goal {g['goal']} {g['target']}: measured {g['measured']} -> {verdict}", flush=True)
    return 0


# ---- main -----------------------------------------------------------------------------------------


def register_family(lab: Path, protocol: str) -> int:
    """Pre-register in the lab's bars the p-value family the protocol really uses; returns it."""
    family = PlaybookSettings.named(protocol).comparisons()
    path = lab / load_lab_config(lab).bars
    text, n = re.subn(r"(?m)^p_family = \d+$", f"p_family = {family}", path.read_text(encoding="utf-8"))
    if n != 1:
        raise SystemExit(f"{path}: expected one `p_family = N` line, found {n}")
    path.write_text(text, encoding="utf-8")
    return family


def prepare(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The seed's lab and the protocol's p-value family: a copy of the one world with its own feedback draw, or
    (`--world-per-seed`) a copy of the world built with the seed itself (its own parent, opponent, suites and
    feedback)."""
    lab, t0 = args.work / f"lab-{seed}", time.monotonic()
    fresh = not (lab / "notebook.db").exists()
    if args.world_per_seed:
        world = args.work / f"world-{seed}"
        variant, reuse = getattr(args, "variant", "default"), None
        if variant != "default":  # the seed's default world first: the variant copies what it keeps of it
            reuse = args.default_worlds / f"world-{seed}"
            build(reuse, seed=seed, size=args.size)
        build(world, seed=seed, size=args.size, variant=variant, reuse=reuse)
        problems = check_inputs(load_lab_config(world))
        if problems and not lab.exists():  # no session can open on it: the next seed is taken (run_variant)
            return {"refused": problems, "redraw_s": time.monotonic() - t0}
        if not lab.exists():
            shutil.copytree(world, lab, symlinks=True)
        feedback = {"world_seed": seed, "variant": variant,
                    "world_manifest_sha256": file_sha256(world / "world/manifest.json")}
    else:
        feedback = redraw_feedback(args.work / "world", lab, seed).model_dump()
    family = register_family(lab, args.protocol) if fresh else None
    return {"lab": lab, "feedback": feedback, "p_family": family, "redraw_s": time.monotonic() - t0}


def finish(args: argparse.Namespace, seed: int, prepared: dict[str, Any], session_s: float) -> dict[str, Any]:
    """Judge the seed's finished session; the row is also written to WORK/seed-SEED.json."""
    t1 = time.monotonic()
    row = judge_session(seed, prepared["lab"], args.work / f"judge-{seed}", args.truth_n, args.truth_seed, args.device)
    row |= {k: prepared[k] for k in ("feedback", "p_family", "redraw_s")} | {"session_s": session_s,
                                                                             "judge_s": time.monotonic() - t1}
    (args.work / f"seed-{seed}.json").write_text(json.dumps(row, indent=1) + "\n")
    print(f"seed {seed}: " + ", ".join(f"{k} nominee {v['nominee_name']} {v['nominee_vs_parent']['win_rate']:.3f}"
                                       for k, v in row["policies"].items()), flush=True)
    return row


def one_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Redraw, run and judge one session seed (`--one-seed N` does this by hand)."""
    prepared = prepare(args, seed)
    walls = run_sessions({seed: prepared["lab"]}, args.budget, args.protocol, args.work, 1)
    return finish(args, seed, prepared, walls[seed])


def run_seeds(args: argparse.Namespace, seeds: list[int]) -> list[dict[str, Any]]:
    """Every seed: the redraws one at a time, then the sessions `--parallel` at a time (the heavy part, each
    its own run_agent.py), then the judging one at a time, all in this process (one torch import, not one
    per seed). A seed whose row is in WORK (`--reuse-rows`) is taken from there."""
    args.work.mkdir(parents=True, exist_ok=True)
    todo = [seed for seed in seeds if not (args.reuse_rows and (args.work / f"seed-{seed}.json").is_file())]
    prepared = {seed: prepare(args, seed) for seed in todo}
    walls = run_sessions({seed: p["lab"] for seed, p in prepared.items()}, args.budget, args.protocol, args.work,
                         max(1, args.parallel))
    for seed in todo:
        finish(args, seed, prepared[seed], walls[seed])
    return [json.loads((args.work / f"seed-{seed}.json").read_text()) for seed in seeds]


def _seed_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 0,1,2") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=10, help="world seeds (sessions)")
    p.add_argument("--first-seed", type=int, default=1, help="first world seed")
    p.add_argument("--seed-list", type=_seed_list, help="comma-separated world seeds (instead of --seeds/--first-seed)")
    p.add_argument("--size", choices=["test", "demo"], default="demo", help="world size preset")
    p.add_argument("--budget", default="60gpuh", help="session budget (run_agent.py --budget)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="short", help="playbook size")
    p.add_argument("--world-seed", type=int, default=0, help="seed of the one world every session's feedback is drawn in")
    p.add_argument("--world-per-seed", action="store_true",
                   help="build each seed's own world (seed = the session seed) instead of redrawing one world's feedback")
    p.add_argument("--truth-n", type=int, default=2000, help="prompts of the truth sample")
    p.add_argument("--truth-seed", type=int, default=0, help="truth sample seed")
    p.add_argument("--device", default="cpu", help="device of the truth generation")
    p.add_argument("--work", type=Path, default=Path("/tmp/decision-quality"), help="worlds, sessions and caches")
    p.add_argument("--parallel", type=int, default=1, help="sessions run at the same time")
    p.add_argument("--reuse-rows", action="store_true", help="take a seed's row from WORK/seed-SEED.json when there")
    p.add_argument("--one-seed", type=int, help="redraw, run and judge this one seed only (WORK/world built)")
    p.add_argument("--variants", type=_variant_list,
                   help="comma-separated world variants (tools/world/variants.py): --seeds judged sessions on each, one "
                        "world per seed (written to --out, default bench/results/decision_quality-variants.json)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="merge `--variants` results (each variant from one file) into one file (--out)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.merge:
        if args.out is None:
            p.error("--merge needs --out")
        return merge_variants(args.merge, args.out)
    if args.out is None:
        args.out = REPO / ("bench/results/decision_quality-variants.json" if args.variants else
                           "bench/results/decision_quality.json")
    try:
        parse_budget(args.budget)
    except ValueError as exc:
        p.error(f"--budget {args.budget}: {exc}")
    if args.variants:
        return main_variants(args, argv)
    start = time.monotonic()
    seeds = args.seed_list or list(range(args.first_seed, args.first_seed + args.seeds))
    if args.one_seed is not None:
        one_seed(args, args.one_seed)
        return 0
    t0 = time.monotonic()
    if not args.world_per_seed:
        build(args.work / "world", seed=args.world_seed, size=args.size)  # once, before any seed copies it
    build_s = time.monotonic() - t0
    sessions = run_seeds(args, seeds)
    summary = {name: summarize_policy(sessions, name) for name in POLICIES}
    result = {
        "command": "python bench/decision_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "wall_s": time.monotonic() - start, "world_build_s": build_s, "sessions": sessions, "summary": summary, "goals": check_goals(summary),
        "table": table(summary),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(result["table"])
    for g in result["goals"]:
        print(f"goal {g['goal']} {g['target']}: measured {g['measured']} -> {'met' if g['met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
