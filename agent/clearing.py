"""A person clears a suite the suite audit flagged (issue 41, item 2): from the next comparison on, the suite's guards
read their registered margin again instead of `audit_margin` times it (evals/compare.py).

    python run_agent.py clear-suite SESSION SUITE --lab LAB --by NAME --reason "labels re-checked by hand"

Refused, nothing written (exit 2): a notebook that fails verify, an unknown session, a suite none of the session's
bars reads, a suite with no finding in force, a lab whose writer lock another process holds (run_agent.py takes it).
Apart from agent/runner.py, as agent/closing.py is: the command loads the notebook and the session state only.
"""

from __future__ import annotations

from pathlib import Path

from agent.closing import require_verified
from agent.errors import SessionError
from core.display import shown
from evals.compare import clear_suite
from memory.notebook import Notebook, NotebookError
from memory.state import SessionState, fold
from tools.paths import LabPaths


def clear(lab_dir: Path, session: str, suite: str, by: str, reason: str) -> int:
    """Record `by` clearing `suite` in `session` with `reason` (a `clear_suite` decision); SessionError when it
    cannot be cleared. The caller holds the lab's writer lock."""
    with Notebook.open(LabPaths(root=lab_dir).notebook) as nb:
        require_verified(nb, "clear-suite")
        try:
            nb.session(session)
        except NotebookError as exc:
            raise SessionError(str(exc)) from None
        problem = _refusal(fold(nb, session), suite)
        if problem:
            raise SessionError(problem)
        decision = clear_suite(nb, session, suite, by=by, note=reason)
        print(f"session {session}: suite {shown(suite)} cleared by {shown(by)} (decision {decision.seq}); its guards "
              f"read their registered margin again; notebook {shown(str(nb.path))}")
    return 0


def _refusal(state: SessionState, suite: str) -> str | None:
    """Why `suite` cannot be cleared in the session, or None when a finding on it is in force."""
    suites = sorted({rule.suite for bars in state.registrations for rule in bars.rules})
    if suite not in suites:
        return (f"suite {suite!r}: no bars of session {state.session} read it (its bars' suites: "
                f"{', '.join(suites) or 'none registered'}); nothing to clear")
    if state.flagged(suite) is not None:
        return None
    cleared = [f for f in state.findings if f.payload.suite == suite]
    if cleared:
        last = cleared[-1]
        return (f"suite {suite!r}: its suite-audit finding (decision {last.seq}) was cleared by {last.cleared_by!r} "
                f"(decision {last.cleared_seq}); no finding is in force, nothing to clear")
    return f"suite {suite!r}: no suite-audit finding in session {state.session}; nothing to clear"
