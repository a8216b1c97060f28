"""A session that skipped planned steps says so: the `skip` tool's record (a plan decision and a finished tool
call) is read back by the status line, the report and the model card (real notebook, real tool, real report).
"""

from __future__ import annotations

from pathlib import Path

from agent import toolbox
from agent.planners.stages import NO_POOL
from agent.runner import closing_line
from memory.notebook import Notebook
from memory.report import write_report
from memory.skips import skipped_steps
from memory.state import fold
from tools.context import ToolContext
from tools.nomination import card
from tools.paths import LabPaths

STEP = "the first rft arm"


def _session(tmp_path: Path) -> Notebook:
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=0, planner="playbook", executor="local",
                    config={})
    return nb


def test_a_skipped_step_is_in_the_status_line_the_report_and_the_card(tmp_path: Path):
    nb = _session(tmp_path)
    assert closing_line(nb, "s").startswith("session s: open; notebook ")  # nothing skipped: the line as it was
    # As the graph takes a planner's step: its plan decision first, then the tool, linked to it.
    args = {"step": STEP, "reason": NO_POOL}
    seq = nb.record_decision("s", "plan", f"skip {STEP}: {NO_POOL}", {"tool": "skip", "args": args,
                                                                      "planner": "playbook"}).seq
    ctx = ToolContext(nb=nb, session="s", paths=LabPaths(root=tmp_path, session="s"), lab=None,  # type: ignore[arg-type]
                      jobs=None)  # type: ignore[arg-type]
    outcome = toolbox.run(ctx, "skip", toolbox.args_model("skip").model_validate(args), seq)
    assert outcome.status == "done" and outcome.data == args
    assert [(x.step, x.reason, x.decision_seq) for x in skipped_steps(nb, "s")] == [(STEP, NO_POOL, seq)]
    nb.end_session("s", "done", "nominated arm")

    line = closing_line(nb, "s")
    assert line.startswith("session s: done, 1 planned step(s) skipped")
    report = tmp_path / "report.html"
    write_report(tmp_path / "notebook.db", "s", report)
    html = report.read_text()
    assert "Skipped steps: 1" in html and f'href="#decision-{seq}"' in html and "the lab has no [[data]] pool" in html
    nominee = nb.add_artifact(kind="checkpoint", name="arm", path=str(tmp_path / "arm"), sha256="0" * 64, session="s")
    lines = card._limitations(nb, fold(nb, "s"), nominee, None)
    assert any(x.startswith(f"- skipped steps (planned, not taken): {STEP} (the lab has no") for x in lines)
    nb.close()
