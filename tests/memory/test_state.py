"""The session state (memory/state.py): the one fold of a session's decisions that every reader asks.

Walks of the code hold the line: no module outside the fold reads the notebook for a fact the state holds (bars,
noise floors, verdicts, the ledger, the incumbent chain, confirmations, the split, the nominee), and no typed record
is read dict-style (`payload.get`). Folds of real notebooks check what the state says: a change of incumbent is its
own event, a notebook from before the `incumbent` kind folds the same, and a verdict records the floor its
threshold used. The card and the report printing that floor on a whole session are tests/memory/test_floor_units.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agent.replay import _names, signature
from evals import bars as bars_mod
from evals import compare as compare_mod
from evals import noise, records
from evals.decoding import Decoding
from evals.job import EvalResult, SuiteResult
from evals.types import Outcome, suite_metrics
from memory.notebook import Notebook
from memory.records import IncumbentPayload, _Payload
from memory.state import fold, resolution

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "tools", "evals", "memory", "trainers", "core")


def folded_kinds() -> set[str]:
    """Every decision kind the fold reads: the literal kinds of the match cases in `_Fold.apply` (memory/state.py),
    so that a kind the state starts to hold is guarded without anyone editing a list here."""
    tree = ast.parse((REPO / "memory" / "state.py").read_text(encoding="utf-8"))
    fold_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Fold")
    apply = next(n for n in fold_class.body if isinstance(n, ast.FunctionDef) and n.name == "apply")
    return {p.value.value for case in ast.walk(apply) if isinstance(case, ast.match_case)
            for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant)}


# Notebook queries whose answers are facts the state holds. `decisions` is one of them when it asks for a folded
# kind, or for the whole log.
FOLDED_QUERIES = {"comparisons", "noise_floors", "noise_floor", "bars", "ledger", "latest_split"}
FOLDED_KINDS = folded_kinds()
# Who may still ask the notebook itself, and why. Everyone else asks the state.
ALLOWED: dict[str, set[str]] = {
    "memory/notebook.py": FOLDED_QUERIES | {"decisions"},  # the queries themselves
    "memory/state.py": FOLDED_QUERIES | {"decisions"},  # the fold
    "tools/session.py": {"ledger"},  # the tools' door to the ledger (launcher admission, time limits)
    "tools/jobs/progress.py": {"ledger"},  # the launcher's live table, refreshed while jobs run
    # Writers of the feedback split: they read the latest split to keep its assignments (the state holds the
    # session's own split once ingested).
    "tools/ingest.py": {"latest_split"},
    "tools/data/splits.py": {"latest_split"},
    "tools/build_dataset.py": {"latest_split"},
    "agent/replay.py": {"latest_split", "decisions"},  # the lab's split before the session; the log it compares
    "memory/report.py": {"decisions"},  # the decision timeline: the log itself, every row
    "tools/nomination/check_bundle.py": {"decisions"},  # the bundle's chain head checked against the log
    "tools/nomination/publish.py": {"decisions"},  # likewise, before publishing
    "tools/context.py": {"decisions"},  # record_once: a resumed tool does not record its decision twice
}


def _sources() -> list[Path]:
    return [REPO / "run_agent.py"] + [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]


def _kind_of(call: ast.Call) -> str | None:
    """The literal `kind=` a decisions() call filters by; None for the whole log or a computed kind."""
    for kw in call.keywords:
        if kw.arg == "kind" and isinstance(kw.value, ast.Constant):
            return kw.value.value
    return None


def notebook_scans(path: Path) -> list[str]:
    """Calls `<x>.<query>(...)` in `path` that ask the notebook for a fact the state holds and the allow-list does
    not grant the file."""
    rel = str(path.relative_to(REPO))
    allowed = ALLOWED.get(rel, set())
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name = node.func.attr
        if name == "decisions":
            kind = _kind_of(node)
            if (kind is None or kind in FOLDED_KINDS) and name not in allowed:
                found.append(f"{rel}:{node.lineno}: decisions(kind={kind!r})")
        elif name in FOLDED_QUERIES and name not in allowed:
            found.append(f"{rel}:{node.lineno}: {name}()")
    return found


def dict_reads_of_payloads(path: Path) -> list[str]:
    """`<x>.payload.get(...)` calls: a typed payload read as a dict."""
    rel = str(path.relative_to(REPO))
    return [f"{rel}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "payload"]


def test_no_module_outside_the_fold_scans_the_notebook_for_a_fact_the_state_holds():
    scans = [s for path in _sources() for s in notebook_scans(path)]
    assert not scans, "notebook scans outside the session state (ask memory.state.fold instead):\n" + "\n".join(scans)


def test_the_guarded_kinds_are_every_kind_the_fold_reads():
    # The kinds of issue 41 (a look of a sequential bar, a suite audit, a person clearing it) are folded too.
    assert FOLDED_KINDS == {"open", "register_bars", "calibrate", "promote", "reject", "incumbent", "confirm",
                            "evaluate", "ingest", "nominate", "refuse", "truth", "look", "audit", "clear_suite"}


def test_the_walker_sees_a_new_scan(tmp_path: Path):
    probe = REPO / "agent" / "_probe_scan.py"  # a path under agent/, so the allow-list applies as to any module
    probe.write_text("def f(nb, s):\n    a = nb.comparisons(s)\n    b = nb.decisions(s, kind='promote')\n"
                     "    c = nb.decisions(s, kind='plan')\n    d = nb.decisions(s)\n"
                     "    e = nb.decisions(s, kind='audit')\n    f = nb.decisions(s, kind='look')\n"
                     "    g = nb.decisions(s, kind='clear_suite')\n    return a, b, c, d, e, f, g\n")
    try:
        assert notebook_scans(probe) == ["agent/_probe_scan.py:2: comparisons()",
                                         "agent/_probe_scan.py:3: decisions(kind='promote')",
                                         "agent/_probe_scan.py:5: decisions(kind=None)",
                                         "agent/_probe_scan.py:6: decisions(kind='audit')",
                                         "agent/_probe_scan.py:7: decisions(kind='look')",
                                         "agent/_probe_scan.py:8: decisions(kind='clear_suite')"]
    finally:
        probe.unlink()


def test_no_typed_record_is_read_as_a_dict():
    reads = [r for path in _sources() + sorted((REPO / "bench").rglob("*.py")) + sorted((REPO / "tests").rglob("*.py"))
             for r in dict_reads_of_payloads(path)]
    assert not reads, "payload.get on typed records:\n" + "\n".join(reads)
    assert not hasattr(_Payload, "get")  # and no dict-style door left open on the payload models


# ---- folds of real notebooks ---------------------------------------------------------------------------

SERVED = Decoding(temperature=0.7, top_p=0.95, max_new_tokens=64, stop_token_ids=(3,))
BASE = [1, 0, 1, 0, 1, 1, 0, 1, 0, 1] * 4
GUARD = '[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta >= -1.0 * noise_floor"\n'


def _result(values: list[int], replicate: int = 0) -> EvalResult:
    outs = [Outcome(item_id=f"i{k}", label="x", values={"correct": v}) for k, v in enumerate(values)]
    suite = SuiteResult(suite="math", scorer="math", sealed=False, replicate=replicate, seed=replicate, resampled=False,
                        metrics=suite_metrics(outs), outcomes=outs, completions_path=None)
    return EvalResult(checkpoint="c", decoding=SERVED, decoding_sha256=SERVED.fingerprint(), served=True,
                      suites=[suite], generated_tokens=0, generation_s=0.0, load_s=0.0)


@pytest.fixture
def judged(tmp_path: Path):
    """A parent calibrated K=3 (replicates one item apart: a floor finer than the suite resolves), bars of each floor
    unit registered, and a candidate two items worse compared under each."""
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s1", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=1, planner="playbook", executor="local",
                    config={})
    parent = nb.add_artifact(kind="checkpoint", name="parent", path="/p", sha256="a" * 64, session="s1",
                             recipe={"role": "parent"}).id
    reps = [BASE, [0, *BASE[1:]], [1, 1, *BASE[2:]]]
    noise.calibrate(nb, "s1", [records.record_result(nb, "s1", parent, _result(r, k))[0] for k, r in enumerate(reps)])
    ids = {}
    for unit in ("replicates", "resolvable"):
        spec = bars_mod.Bars.model_validate(__import__("tomllib").loads(f'floor_unit = "{unit}"\n' + GUARD)).spec()
        bars_id = bars_mod.register(nb, "s1", spec).id
        cand = nb.add_artifact(kind="checkpoint", name=f"c-{unit}", path=f"/{unit}", sha256=("b" if unit == "replicates" else "c") * 64,
                               session="s1").id
        records.record_result(nb, "s1", cand, _result([0] * 3 + BASE[3:]))
        compare_mod.compare(nb, "s1", cand, parent, bars_id, SERVED)
        ids[unit] = cand
    yield nb, parent, ids
    nb.close()


def test_each_verdict_keeps_the_floor_its_threshold_used(judged):
    nb, parent, ids = judged
    state = fold(nb, "s1")
    [floor] = state.floors
    resolved = resolution([float(v) for v in BASE])
    assert floor.record.mean_abs_delta < resolved  # the case where the two units differ
    assert floor.unit("replicates") == floor.record.mean_abs_delta and floor.unit("resolvable") == resolved
    for verdict, unit in zip(state.verdicts, ("replicates", "resolvable"), strict=True):
        [bar], [f] = verdict.bars, verdict.floors
        assert (verdict.candidate, f.floor_unit, f.recorded, f.floor_id) == (ids[unit], unit, True, floor.record.id)
        assert bar.floor == f.unit == floor.unit(unit) and bar.threshold == pytest.approx(-1.0 * f.unit)
    # Between the two units the same candidate is judged differently: -0.05 is within one standard error, not
    # within the replicates' floor.
    assert [v.cleared for v in state.verdicts] == [False, True]
    # The state's own answer for the bars in force (the latest: resolvable) against the parent: the same number.
    assert [b.unit for b in state.bar_floors()] == [resolved]


def test_a_change_of_incumbent_is_its_own_event_and_an_old_promote_folds_the_same(judged, tmp_path: Path):
    nb, parent, ids = judged
    cand = ids["resolvable"]
    state = fold(nb, "s1")
    assert state.promotion(cand).promotable and not state.promotion(ids["replicates"]).promotable
    assert state.incumbent == parent  # a verdict that cleared every bar moves no incumbent
    change = IncumbentPayload(action="incumbent", artifact_id=cand, comparison_id=state.verdicts[1].comparison_id,
                              previous=parent)
    written = nb.record_decision("s1", "incumbent", "c-resolvable becomes the incumbent", change)
    after = fold(nb, "s1")
    assert (after.chain, after.incumbent, after.changes[0].seq) == ([parent, cand], cand, written.seq)
    assert "already the incumbent" in after.promotion(cand).reasons[0]
    became = dict(nb.db.execute("SELECT artifact_id, became_incumbent FROM lineage").fetchall())  # the views too
    assert became[cand] == 1 and became[ids["replicates"]] == 0
    # A notebook from before the kind recorded the same change as a `promote` decision: it folds, and replays, alike.
    with Notebook.open(tmp_path / "old.db") as old:
        old.open_session("s1", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=1, planner="playbook",
                         executor="local", config={})
        first = old.add_artifact(kind="checkpoint", name="parent", path="/p", sha256="a" * 64, session="s1",
                                 recipe={"role": "parent"}).id
        legacy = old.record_decision("s1", "promote", "c-resolvable becomes the incumbent",
                                     change.model_copy(update={"previous": first}))
        assert fold(old, "s1").chain == [first, cand]
        assert signature(legacy, _names(old, "s1"))[0] == signature(written, _names(nb, "s1"))[0] == "incumbent"
