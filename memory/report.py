"""The HTML report of one session, for a human reviewing what the agent did before trusting its nominee.

    python run_agent.py report [--lab DIR] [--session S] [-o FILE]     # default: the latest session, DIR/report.html

One self-contained file read from the notebook only (opened read-only; nothing is written to it):
inline CSS, plots as inline SVG (memory/report_svg.py), one small inline script that sorts tables,
no network. Sections, linked by record id (#artifact-N, #comparison-N, #decision-N, #job-N):
summary (budget split by job family, measured vs simulated GPU-hours; incumbent chain; nominee;
sealed confirmation; ground truth in the toy world; whether the decision log verifies), budget
burn-down, checkpoint lineage, comparisons (per-bar delta, CI, noise-floor band, verdict), dose
curves, the decision timeline and the jobs. Every text from the notebook is HTML-escaped, its control
characters shown as escapes and its bidirectional overrides (U+202E) neutralised (core/display.py): battle
text comes from the public, and artifact names and rationales can quote it.

The per-bar delta and its 95% CI are recomputed here from the stored per-item outcomes (paired by
item id, first served replicate-0 eval of each side, as evals/compare.py pairs them; a paired-t
interval); the verdict shown is always the notebook's.
"""

from __future__ import annotations

import math
import os
import stat
from datetime import datetime
from html import escape as html_escape
from pathlib import Path
from statistics import mean, stdev

from core.display import shown
from core.util import shipped_file_mode, write_atomic
from memory import report_svg as svg
from memory.notebook import (
    Artifact,
    Decision,
    EvalRecord,
    JobRecord,
    Notebook,
    NotebookError,
    Session,
)
from memory.records import StepFailPayload
from memory.skips import skipped_steps
from memory.state import Verdict, fold


def escape(text: str) -> str:
    """HTML-escaped, with control and bidi characters shown as escapes (newlines kept for multi-line blocks)."""
    return html_escape(shown(text, keep_newlines=True))


class ReportError(NotebookError):
    """A report that cannot be made or written; like any NotebookError, the CLI prints it and exits 2."""


TRAINING_KINDS = {"sft", "dpo", "klce", "rft", "train"}
FAMILIES = ("training", "evaluation", "merge", "other")


def family(kind: str) -> str:
    """Budget family of a job kind: training, evaluation, merge, or other (data builds, bundles, ingest)."""
    if kind in TRAINING_KINDS:
        return "training"
    # "reference": the judged suites' reference answers, generated for an evaluation; "truth": the
    # nominee's ground truth (tools/ground_truth.py), an evaluation by the lab's noise-free scorer.
    return {"eval": "evaluation", "reference": "evaluation", "truth": "evaluation", "merge": "merge"}.get(kind, "other")


def method(a: Artifact) -> str:
    """How a checkpoint was made, in a few words (the lineage view's `method` column, same rule)."""
    r = a.recipe
    if r.get("merge"):
        return f"{r['merge']} alpha {r['alpha']:g}" if r.get("alpha") is not None else str(r["merge"])
    if isinstance(r.get("hparams"), dict) and r["hparams"].get("trainer"):
        return str(r["hparams"]["trainer"])
    if r.get("serving_of") is not None:
        return "serving"
    return str(r.get("role") or a.kind)


class _Data:
    """Everything the report reads, fetched once from the read-only notebook: the session's facts from its state
    (memory/state.py), the decision log itself for the timeline."""

    def __init__(self, nb: Notebook, session: Session):
        self.session = session
        self.state = fold(nb, session.name)
        self.decisions = nb.decisions(session.name)  # the log itself, for the timeline
        self.jobs = nb.jobs(session=session.name)
        self.artifacts = {a.id: a for a in nb.artifacts()}
        self.evals = nb.evals(session=session.name)
        self.ledger = self.state.ledger
        self.skipped = skipped_steps(nb, session.name)
        self.verify = nb.verify()
        self.chain = self.state.chain
        self.nominee = self.state.nominee

    def first_eval(self, artifact_id: int, suite: str) -> EvalRecord | None:
        """The first served replicate-0 eval: the look that counts (evals/compare.py)."""
        return next((e for e in self.evals if e.artifact_id == artifact_id and e.suite == suite and e.served
                     and e.replicate == 0), None)

    def chosen(self, among: set[int]) -> int | None:
        """Which of `among` the session kept: the nominee, else the latest incumbent that is one of
        them, itself or as the weights a serving alternative of it serves."""
        for pick in [*([self.nominee] if self.nominee is not None else []), *reversed(self.chain)]:
            a = self.artifacts.get(pick)
            for candidate in (pick, a.recipe.get("serving_of") if a else None):
                if candidate in among:
                    return candidate
        return None


# ---- opening -------------------------------------------------------------------------------------


def pick_session(nb: Notebook, name: str | None) -> Session:
    """The named session, or the latest one; a clear NotebookError for none, an unknown or an empty one."""
    sessions = nb.sessions()
    if not sessions:
        raise ReportError(f"{nb.path}: no session in this notebook yet (run one: run_agent.py --budget 60gpuh)")
    if name is None:
        session = sessions[-1]
    else:
        by_name = {s.name: s for s in sessions}
        if name not in by_name:
            known = ", ".join(sorted(by_name)[:10])
            raise ReportError(f"{nb.path}: no session {name!r} (sessions here: {known})")
        session = by_name[name]
    recorded = [d.kind for d in nb.decisions(session.name) if d.kind not in ("open", "stop")]
    if not recorded and not nb.jobs(session=session.name):
        raise ReportError(f"{nb.path}: session {session.name!r} is empty (no decision past its opening, "
                            "no job): nothing to report")
    return session


def write_report(notebook: Path, session: str | None, out: Path) -> tuple[Session, Path]:
    """Read the notebook (read-only) and write the report atomically to `out` (nothing written on error)."""
    if not notebook.exists():
        raise ReportError(f"{notebook}: no notebook here (run a session first, or pass --lab DIR)")
    _check_target(out)
    with Notebook.open(notebook, readonly=True) as nb:
        chosen = pick_session(nb, session)
        html = render(_Data(nb, chosen))
    try:
        # Readable by the reviewers it is for (0644, or the lab's [nomination] file_mode), not owner-only.
        return chosen, write_atomic(out, html, shipped_file_mode(chosen.config))
    except OSError as err:
        raise ReportError(f"{out}: cannot write the report: {err.strerror or err}") from None


def _check_target(out: Path) -> None:
    """The report replaces `out` by a rename: only a regular file (or a new name in a directory) may be
    replaced that way. Run as root, a rename onto /dev/null replaced the machine's /dev/null with a file;
    onto a symbolic link, it would replace the link, not the file it names."""
    if os.path.lexists(out):
        mode = out.lstat().st_mode
        if stat.S_ISDIR(mode):
            raise ReportError(f"-o {out}: is a directory; name the HTML file to write")
        if not stat.S_ISREG(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "a device, pipe or socket"
            raise ReportError(f"-o {out}: is {what}, not a regular file; the report writes regular files only")
    elif not out.parent.is_dir():
        raise ReportError(f"-o {out}: {out.parent} is not a directory")


# ---- rendering -----------------------------------------------------------------------------------


def _hours(start: str, at: str | None) -> float:
    """Hours from `start` to `at` (0 when `at` is unknown)."""
    if at is None:
        return 0.0
    try:
        return (datetime.fromisoformat(at) - datetime.fromisoformat(start)).total_seconds() / 3600
    except (TypeError, ValueError):  # the notebook writes ISO-8601 UTC; anything else was written by hand
        raise ReportError(f"time {at!r} or session start {start!r} is not an ISO-8601 time with a zone") from None


def _num(v: float | None, digits: int = 4) -> str:
    # + 0.0 turns a negative zero (a threshold of -1.0 x a zero floor) into 0
    return "" if v is None else f"{v + 0.0:.{digits}g}" if isinstance(v, float) else escape(str(v))


def _a(kind: str, ident: int | str, text: str | None = None) -> str:
    return f'<a href="#{kind}-{escape(str(ident))}">{escape(text or f"#{ident}")}</a>'


def _artifact_link(d: _Data, artifact_id: int | None) -> str:
    if artifact_id is None:
        return "none"
    a = d.artifacts.get(artifact_id)
    return _a("artifact", artifact_id, f"#{artifact_id} {a.name}" if a else f"#{artifact_id}")


def _table(cls: str, header: list[str], rows: list[str]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    return f'<table class="sortable {cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _job_anchor(j: JobRecord) -> str:
    return f"job-{j.id}"


def _budget_section(d: _Data) -> str:
    spent = {(f, c): 0.0 for f in (*FAMILIES, "failed") for c in ("measured", "simulated")}
    attempts = dict.fromkeys((*FAMILIES, "failed"), 0)
    for j in d.jobs:
        fam = "failed" if j.state == "failed" else family(j.kind)
        attempts[fam] += 1
        if j.gpu_hours is not None:
            spent[(fam, j.charge or "measured")] += j.gpu_hours
    rows = [f"<tr><td>{escape(f)}</td><td>{attempts[f]}</td><td>{spent[(f, 'measured')]:.4f}</td>"
            f"<td>{spent[(f, 'simulated')]:.4f}</td></tr>" for f in (*FAMILIES, "failed")]
    led = d.ledger
    simulated = any(j.charge == "simulated" for j in d.jobs)
    note = ("<p class=\"warn\">Some GPU-hours are <b>simulated</b> (device-seconds scaled by the lab's "
            "simulated_gpuh_per_device_s), not measured on a GPU.</p>" if simulated else
            "<p>Every settled GPU-hour is measured (device-seconds held).</p>")
    return (f"<h3>Budget</h3><p>Budget <b>{led.budget_gpuh:g}</b> GPU-h: spent <b>{led.spent_gpuh:.4f}</b>, "
            f"reserved for running jobs {led.reserved_gpuh:.4f}, left <b>{led.left_gpuh(nomination=True):.4f}</b> "
            f"(of which {led.reserve_gpuh:g} is the nomination reserve).</p>{note}"
            + _table("budget", ["family", "attempts", "measured GPU-h", "simulated GPU-h"], rows))


def _confirmation(d: _Data) -> str:
    confirms = d.state.confirmations
    if not confirms:
        return "<p>Sealed confirmation: <b>not opened</b> in this session.</p>"
    out = []
    for c in confirms:
        ev = d.first_eval(c.artifact_id, c.suite)
        metrics = ", ".join(f"{escape(k)} = {_num(v)}" for k, v in sorted(ev.metrics.items())
                            if isinstance(v, int | float)) if ev else "no eval recorded"
        out.append(f"<li>{escape(c.suite)} for {_artifact_link(d, c.artifact_id)} "
                   f"({_a('decision', c.seq, f'decision {c.seq}')}): {metrics}</li>")
    return f"<p>Sealed confirmation:</p><ul>{''.join(out)}</ul>"


def _truth(d: _Data) -> str:
    """The nominee's ground truth (its `truth` decision), when the lab declares a scorer ([truth] of lab.toml)."""
    x = d.state.truth(d.nominee) if d.nominee is not None else None
    if x is None:
        declared = (d.session.config.get("lab") or {}).get("truth")
        why = "the lab declares no scorer ([truth] in lab.toml)" if not declared else "declared, but no result recorded"
        return f"<p>Ground truth: none ({escape(why)}).</p>"
    t = x.payload
    families = "".join(f"<tr><td>{escape(name)}</td><td>{f.n}</td><td>{_num(f.accuracy)}</td>"
                       f"<td>{_num(f.other_accuracy)}</td><td>{_num(f.win_rate)}</td></tr>" for name, f in t.per_family.items())
    return (f"<p>Ground truth ({escape(t.scorer)}, {_a('decision', x.seq, f'decision {x.seq}')}; never shown to the "
            f"planner) of {_artifact_link(d, t.artifact_id)} against the parent {_artifact_link(d, t.parent)}: true win "
            f"rate <b>{_num(t.win_rate)}</b> (95% CI {_num(t.ci_low)} to {_num(t.ci_high)}), n = {t.n}; accuracy "
            f"{_num(t.accuracy)} vs {_num(t.other_accuracy)}; leak audit of the sample "
            f"{'passed' if t.audit_passed else '<b>FAILED</b>'}.</p>"
            + _table("truth", ["family", "n", "nominee accuracy", "parent accuracy", "win rate"], [families]))


def _summary(d: _Data) -> str:
    s, v = d.session, d.verify
    verify = (f'<span class="ok">verifies</span>: {v.count} decisions, head <code>{escape(v.head[:16])}</code>'
              if v.ok else f'<span class="bad">does NOT verify</span>: {escape(v.problem or "")}')
    chain = " &rarr; ".join(_artifact_link(d, a) for a in d.chain) or "none"
    stops = [x for x in d.decisions if x.kind == "stop"]
    ended = f"ended {escape(s.ended_at or '')} ({escape(stops[-1].rationale)})" if stops else "still open"
    return (f'<section id="summary"><h2>Summary</h2><p>Session <b>{escape(s.name)}</b> in lab <code>{escape(s.lab)}</code>, '
            f"planner {escape(s.planner)}, executor {escape(s.executor)}, status <b>{escape(s.status)}</b>; started "
            f"{escape(s.started_at)}, {ended}.</p><p>Decision log: {verify}.</p>"
            f"<p>Incumbent chain: {chain}.</p><p>Nominee: <b>{_artifact_link(d, d.nominee)}</b>.</p>"
            f"{_confirmation(d)}{_truth(d)}{_skipped(d)}{_budget_section(d)}</section>")


def _skipped(d: _Data) -> str:
    """The planned steps the session did not take, and why (a step whose data the lab lacks, or that a failed
    step before it left without input): a session that skipped steps says so next to its status."""
    if not d.skipped:
        return "<p>Skipped steps: none.</p>"
    items = "".join(f'<li>{_a("decision", x.decision_seq, x.step) if x.decision_seq else escape(x.step)}: '
                    f"{escape(x.reason)}</li>" for x in d.skipped)
    return f'<p><span class="bad">Skipped steps: {len(d.skipped)}</span></p><ul class="skipped">{items}</ul>'


def _burn_down(d: _Data) -> str:
    settled = sorted((j for j in d.jobs if j.gpu_hours is not None), key=lambda j: (j.ended_at or j.submitted_at, j.id))
    left, segments = d.session.budget_gpuh, []
    for j in settled:
        start = _hours(d.session.started_at, j.started_at or j.submitted_at)
        end = max(start, _hours(d.session.started_at, j.ended_at or j.started_at or j.submitted_at))
        label = f"{j.kind} job {j.id} ({j.state}{', ' + j.failure_class if j.failure_class else ''}): {j.gpu_hours:.4g} GPU-h"
        segments.append(svg.Segment(start_h=start, end_h=end, left_before=left, left_after=left - j.gpu_hours,
                                    family=family(j.kind), failed=j.state == "failed", label=label, href=f"#{_job_anchor(j)}"))
        left -= j.gpu_hours
    caption = (f"Budget burn-down: GPU-hours left after each settled attempt ({len(segments)}), coloured by job family; "
               "failed attempts crossed")
    return f'<section id="burn-down"><h2>Budget burn-down</h2>{svg.burn_down(segments, d.session.budget_gpuh, d.session.reserve_gpuh, caption)}</section>'


def _lineage(d: _Data) -> str:
    checkpoints = [a for a in d.artifacts.values() if a.kind == "checkpoint" and a.session in (None, d.session.name)]
    jobs = {j.key: j for j in d.jobs}
    nodes, rows = [], []
    for a in checkpoints:
        job = jobs.get(a.job_key) if a.job_key else None
        job_text = f"job {job.id}" + (f" ({job.external_id})" if job.external_id else "") if job else "no job"
        nodes.append(svg.Node(id=a.id, title=f"#{a.id} {a.name}", detail=f"{method(a)}, {job_text}",
                              parents=[p for p in a.parents if d.artifacts.get(p) and d.artifacts[p].kind == "checkpoint"],
                              chain=a.id in d.chain))
        parents = ", ".join(_artifact_link(d, p) for p in a.parents) or "none"
        job_cell = _a("job", job.id, job_text) if job else "none"
        rows.append(f'<tr id="artifact-{a.id}" class="{"chain" if a.id in d.chain else ""}"><td>{a.id}</td><td>{escape(a.name)}</td>'
                    f"<td>{escape(method(a))}</td><td>{parents}</td><td>{job_cell}</td>"
                    f"<td>{'yes' if a.id in d.chain else ''}</td><td><code>{escape(a.sha256[:12])}</code></td></tr>")
    others = [a for a in d.artifacts.values() if a.kind != "checkpoint" and a.session in (None, d.session.name)]
    rows += [f'<tr id="artifact-{a.id}"><td>{a.id}</td><td>{escape(a.name)}</td><td>{escape(a.kind)}</td>'
             f"<td>{', '.join(_artifact_link(d, p) for p in a.parents) or 'none'}</td><td></td><td></td>"
             f"<td><code>{escape(a.sha256[:12])}</code></td></tr>" for a in others]
    plot = svg.lineage(nodes, f"Lineage of {len(nodes)} checkpoints: edges to parents, the incumbent chain highlighted")
    table = _table("artifacts", ["id", "name", "method", "parents", "job", "incumbent", "sha256"], rows)
    return f'<section id="lineage"><h2>Lineage</h2>{plot}{table}</section>'


def paired_delta(cand: EvalRecord | None, inc: EvalRecord | None, metric: str) -> tuple[float | None, tuple[float, float] | None, int]:
    """Mean candidate-minus-incumbent difference over items both scored, with a 95% paired-t CI."""
    if cand is None or inc is None:
        return None, None, 0
    a = {o["item_id"]: o["values"][metric] for o in cand.items if metric in o.get("values", {})}
    b = {o["item_id"]: o["values"][metric] for o in inc.items if metric in o.get("values", {})}
    diffs = [a[k] - b[k] for k in sorted(a.keys() & b.keys())]
    if not diffs:
        return None, None, 0
    m = mean(diffs)
    if len(diffs) < 2:
        return m, None, 1
    from scipy import stats  # for this interval only

    half = stats.t.ppf(0.975, len(diffs) - 1) * stdev(diffs) / math.sqrt(len(diffs))
    return m, (m - half, m + half), len(diffs)


def _comparison(d: _Data, c: Verdict) -> str:
    """One comparison: per bar its statistic, threshold, recomputed delta and CI, and the noise floor in the unit the
    threshold used (`Verdict.floors`, the session state's one floor rule)."""
    rows, table = [], []
    for v, f in zip(c.bars, c.floors, strict=True):
        bar = v.bar
        delta, ci, n = paired_delta(d.first_eval(c.candidate, bar.suite), d.first_eval(c.incumbent, bar.suite), bar.metric)
        floor = None if f is None else f.unit
        label = f"{bar.target} {bar.text()}"
        rows.append(svg.DeltaRow(label=label, delta=delta, ci=ci, floor=floor,
                                 threshold=v.threshold if bar.statistic == "delta" else None, holds=v.holds))
        ci_text = f"[{ci[0]:.4g}, {ci[1]:.4g}]" if ci else ""
        verdict = '<span class="ok">holds</span>' if v.holds else '<span class="bad">fails</span>'
        unit = "" if f is None else f" ({escape(f.floor_unit)})"
        table.append(f"<tr><td>{escape(label)}</td><td>{_num(v.value)}</td><td>{_num(v.threshold)}</td>"
                     f"<td>{n}</td><td>{_num(delta)}</td><td>{escape(ci_text)}</td><td>{_num(floor)}{unit}</td>"
                     f"<td>{verdict}</td></tr>")
    outcome = '<span class="ok">cleared every bar</span>' if c.cleared else '<span class="bad">rejected</span>'
    link = f" ({_a('decision', c.seq, f'decision {c.seq}')})"
    plot = svg.deltas(rows, f"Comparison {c.comparison_id}: paired delta (dot), 95% CI (whisker), noise-floor band "
                            "(grey), threshold (dashed)")
    header = ["bar", "statistic", "threshold", "pairs", "delta", "95% CI", "noise floor (bar unit)", "verdict"]
    return (f'<article id="comparison-{c.comparison_id}"><h3>Comparison {c.comparison_id}: '
            f"{_artifact_link(d, c.candidate)} vs incumbent {_artifact_link(d, c.incumbent)}: {outcome}{link}</h3>"
            f"{plot}{_table('verdicts', header, table)}</article>")


def _comparisons(d: _Data) -> str:
    body = "".join(_comparison(d, c) for c in d.state.verdicts) or "<p>No comparison was made in this session.</p>"
    return f'<section id="comparisons"><h2>Comparisons</h2>{body}{_looks(d)}{_audit(d)}</section>'


def _looks(d: _Data) -> str:
    """Every look of a p bar under the bars' sequential rule (an unresolved look spent no p-value)."""
    if not d.state.looks:
        return ""
    rows = [f"<tr><td>{x.seq}</td><td>{_artifact_link(d, x.payload.candidate)}</td><td>{escape(x.payload.target)}</td>"
            f"<td>{x.payload.look} of {x.payload.looks}</td><td>{x.payload.n}{_of_reserve(x.payload.reserve)}</td>"
            f"<td>{_num(x.payload.raw_p)}</td>"
            f"<td>{_num(x.payload.sequential_p)}</td><td>{_num(x.payload.adjusted_p)}</td>"
            f"<td>{escape(x.payload.outcome)}</td></tr>" for x in d.state.looks]
    header = ["decision", "candidate", "bar", "look", "items", "p", "p* (min p/w)", "adjusted", "outcome"]
    return f'<article id="looks"><h3>Sequential looks</h3>{_table("looks", header, rows)}</article>'


def _of_reserve(reserve: int | None) -> str:
    """A reserve look's items: how many are reserve prompts, drawn for it."""
    return "" if reserve is None else f" ({reserve} of the reserve)"


def _audit(d: _Data) -> str:
    """The suite-audit findings: a guard's suite the judged holdout contradicted beyond chance."""
    if not d.state.findings:
        return ""
    rows = []
    for f in d.state.findings:
        p = f.payload
        status = f"cleared by {escape(f.cleared_by or '')} (decision {f.cleared_seq})" if f.cleared_seq else "in force"
        rows.append(f"<tr><td>{f.seq}</td><td>{escape(p.suite)}/{escape(p.metric)}</td>"
                    f"<td>{_artifact_link(d, p.candidate)}</td><td>{_num(p.guard_value)}</td>"
                    f"<td>{_num(p.guard_threshold)}</td><td>{_num(p.widened_threshold)}</td>"
                    f"<td>{escape(p.judge_target)} adjusted p {_num(p.judge_adjusted_p)}</td><td>{status}</td></tr>")
    header = ["decision", "guard", "candidate", "delta", "threshold", "widened to", "the judge", "status"]
    return (f'<article id="suite-audit"><h3>Suite audit findings</h3><p>A guard whose suite disagreed with the judged '
            f"holdout beyond chance holds at the bars' wider audit margin until a person clears the suite.</p>"
            f'{_table("audit", header, rows)}</article>')


def _sweeps(d: _Data) -> dict[tuple[int, int], list[tuple[float, int]]]:
    """(start, end) model pair -> [(alpha, artifact id)] of doses and two-model soups, endpoints included."""
    sweeps: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for a in d.artifacts.values():
        r, models = a.recipe, a.recipe.get("models") or []
        if a.session != d.session.name or len(models) != 2:
            continue
        if r.get("merge") == "dose" and r.get("alpha") is not None:
            alpha = float(r["alpha"])
        elif r.get("merge") == "soup":
            weights = r.get("weights") or [0.5, 0.5]
            if sum(weights) <= 0:
                continue
            alpha = weights[1] / sum(weights)
        else:
            continue
        sweeps.setdefault((models[0], models[1]), []).append((alpha, a.id))
    for (start, end), points in sweeps.items():
        points += [(0.0, start), (1.0, end)]
    return sweeps


def _dose(d: _Data) -> str:
    suites = sorted({e.suite for e in d.evals})
    bar_metrics = {(b.bar.suite, b.bar.metric) for c in d.state.verdicts for b in c.bars}
    out = []
    for (start, end), points in sorted(_sweeps(d).items()):
        series: dict[str, list[svg.DosePoint]] = {}
        chosen = d.chosen({aid for alpha, aid in points if 0 < alpha})
        for suite in suites:
            metrics = sorted(m for s, m in bar_metrics if s == suite) or ["correct"]
            for metric in metrics:
                for alpha, aid in points:
                    ev = d.first_eval(aid, suite)
                    value = ev.metrics.get(metric) if ev else None
                    if isinstance(value, int | float):
                        series.setdefault(f"{suite}/{metric}", []).append(
                            svg.DosePoint(alpha=alpha, value=value, artifact_id=aid, chosen=aid == chosen and 0 < alpha))
        caption = (f"Dose curve from {_name(d, start)} (alpha 0) to {_name(d, end)} (alpha 1): metric per suite "
                   f"against alpha, {len(points) - 2} merged point(s), the chosen point ringed")
        out.append(svg.dose_curve(series, caption))
    body = "".join(out) or "<p>No dose sweep or soup was merged in this session.</p>"
    return f'<section id="dose"><h2>Dose curves</h2>{body}</section>'


def _name(d: _Data, artifact_id: int) -> str:
    a = d.artifacts.get(artifact_id)
    return f"#{artifact_id} {a.name}" if a else f"#{artifact_id}"


def _decision_detail(d: _Data, x: Decision) -> str:
    p, jobs = x.payload, {j.key: j for j in d.jobs}
    if x.kind == "refuse":
        reasons = getattr(p, "reasons", None) or [getattr(p, "reason", x.rationale)]
        return "refused: " + "; ".join(escape(r) for r in reasons)
    if x.kind == "fail" and isinstance(p, StepFailPayload):
        return f'<span class="bad">step {escape(p.tool)} failed</span>: {escape(p.reason)}'
    if x.kind == "fail":
        job = jobs.get(p.key)
        where = _a("job", job.id, f"job {job.id}") if job else "job"
        said = f": {escape(p.message)}" if p.message else ""  # the job's own words, stored made safe
        return f'<span class="bad">{escape(p.failure_class)}</span> in {where}: {escape(p.detail)}{said}'
    if x.kind == "launch" and p.key in jobs:
        return f"{_a('job', jobs[p.key].id, 'job ' + str(jobs[p.key].id))}: {escape(p.kind)}, forecast {p.forecast_gpuh:.4g} GPU-h"
    if x.kind == "plan" and getattr(p, "tool", None):
        return f"next: {escape(str(p.tool))}"
    if getattr(p, "comparison_id", None) is not None:
        return _a("comparison", p.comparison_id, f"comparison {p.comparison_id}")
    if getattr(p, "artifact_id", None) is not None:
        return _artifact_link(d, p.artifact_id)
    return ""


def _timeline(d: _Data) -> str:
    rows = [f'<tr id="decision-{x.seq}" class="kind-{escape(x.kind)}"><td>{x.seq}</td>'
            f"<td>{_hours(d.session.started_at, x.at) * 60:.1f}</td><td>{escape(x.kind)}</td>"
            f"<td>{escape(x.rationale)}</td><td>{_decision_detail(d, x)}</td></tr>" for x in d.decisions]
    refused = sum(x.kind == "refuse" for x in d.decisions)
    steps = sum(x.kind == "fail" and isinstance(x.payload, StepFailPayload) for x in d.decisions)
    failed = sum(x.kind == "fail" for x in d.decisions) - steps
    return (f'<section id="timeline"><h2>Decision timeline</h2><p>{len(d.decisions)} decisions, {refused} refusal(s), '
            f"{failed} failed job(s), {steps} failed step(s).</p>"
            + _table("decisions", ["seq", "minute", "kind", "rationale", "detail"], rows) + "</section>")


def _placement(result: dict | None) -> dict:
    """Where a completed model job ran, as its result records it (an RFT run's in its train result); {} otherwise."""
    found = (result or {}).get("placement") or ((result or {}).get("train") or {}).get("placement")
    return found if isinstance(found, dict) else {}


def _placement_cells(result: dict | None) -> str:
    p = _placement(result)
    devices = f" x{p['devices']}" if p.get("devices", 1) > 1 else ""
    return (f"<td>{escape(str(p.get('device', '')))}{devices}</td><td>{escape(str(p.get('dtype', '')))}</td>"
            f"<td>{escape(str(p.get('device_name', '')))}</td><td>{_num(p.get('tokens_per_s'), 5)}</td>")


def _jobs(d: _Data) -> str:
    rows = [f'<tr id="{_job_anchor(j)}" class="state-{escape(j.state)}"><td>{j.id}</td><td>{escape(j.kind)}</td>'
            f"<td>{j.attempt}</td><td>{escape(j.state)}</td><td>{escape(j.failure_class or '')}</td>"
            f"<td>{escape(j.failure_detail or '')}</td><td>{_num(j.forecast_gpuh)}</td><td>{_num(j.gpu_hours)}</td>"
            f"<td>{escape(j.charge or 'unsettled')}</td>{_placement_cells(j.result)}"
            f"<td>{escape(j.external_id or '')}</td></tr>" for j in d.jobs]
    header = ["id", "kind", "attempt", "state", "failure class", "failure detail", "forecast GPU-h", "GPU-h", "charge",
              "device", "dtype", "device name", "tokens/s", "external id"]
    return f'<section id="jobs"><h2>Jobs</h2>{_table("jobs", header, rows)}</section>'


_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:0 16px;color:#222}
nav a{margin-right:12px} h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;margin:8px 0;font-size:13px} th,td{border:1px solid #ddd;padding:3px 6px;vertical-align:top}
th{background:#f3f3f3;cursor:pointer} tr.chain td{background:#fbeef6} tr.kind-refuse td,tr.kind-fail td,tr.state-failed td{background:#fdeee8}
.ok{color:#087f23;font-weight:600} .bad{color:#b3261e;font-weight:600} .warn{color:#8a5a00}
svg.plot{background:#fff;border:1px solid #eee;max-width:100%;height:auto} figure{margin:8px 0} figcaption{color:#555;font-size:12px}
svg text{font:11px system-ui,sans-serif;fill:#333} svg .label{font-size:12px} svg .empty{fill:#888}
.axis{stroke:#444} .tick{stroke:#444} .grid{stroke:#eee} .zero{stroke:#444;stroke-dasharray:2 2}
.reserve{stroke:#b3261e;stroke-dasharray:6 3} .seg{stroke-width:4;stroke-linecap:round} .fail{stroke:#D55E00;stroke-width:2.5}
.node rect{fill:#f7f7f7;stroke:#888} .node.chain rect{fill:#fbeef6;stroke:#CC79A7;stroke-width:3}
.edge{fill:none;stroke:#999;stroke-width:1.5} .edge.chain{stroke:#CC79A7;stroke-width:3}
.node-title{font-weight:600} .band{fill:#ddd} .threshold{stroke:#b3261e;stroke-dasharray:4 2;stroke-width:2}
.ci{stroke:#0072B2;stroke-width:3} .delta{fill:#0072B2} .verdict.holds{fill:#087f23} .verdict.fails{fill:#b3261e}
.curve{fill:none;stroke-width:2} .chosen{fill:none;stroke:#CC79A7;stroke-width:3}
"""

# Click a column header to sort its table (numbers numerically); the only script, no network.
_SORT = """
document.querySelectorAll('table.sortable th').forEach(function (th, col) {
  th.addEventListener('click', function () {
    var body = th.closest('table').tBodies[0], rows = Array.prototype.slice.call(body.rows);
    var down = th.dataset.dir !== 'asc'; th.dataset.dir = down ? 'asc' : 'desc';
    function key(r) { var t = r.cells[th.cellIndex].textContent.trim(), n = parseFloat(t); return isNaN(n) ? t : n; }
    rows.sort(function (a, b) { var x = key(a), y = key(b), c = x < y ? -1 : x > y ? 1 : 0; return down ? c : -c; });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""


def render(d: _Data) -> str:
    """The whole report as one HTML document."""
    nav = "".join(f'<a href="#{k}">{v}</a>' for k, v in (
        ("summary", "Summary"), ("burn-down", "Burn-down"), ("lineage", "Lineage"), ("comparisons", "Comparisons"),
        ("dose", "Dose curves"), ("timeline", "Timeline"), ("jobs", "Jobs")))
    sections = [_summary(d), _burn_down(d), _lineage(d), _comparisons(d), _dose(d), _timeline(d), _jobs(d)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "script-src 'unsafe-inline'; img-src data:\">"
            f"<title>Session {escape(d.session.name)}: report</title><style>{_CSS}</style></head><body>"
            f"<h1>Session {escape(d.session.name)}</h1><nav>{nav}</nav>{''.join(sections)}"
            f"<script>{_SORT}</script></body></html>\n")
