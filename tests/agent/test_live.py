"""What a user sees: plain timestamped lines off a terminal, the rich live panel on one."""

from __future__ import annotations

import io
import time

from rich.console import Console

from agent.live import LivePanel, PlainLog, reporter
from agent.summary import summarize
from memory.notebook import Notebook


def _notebook(tmp_path):
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s", lab=str(tmp_path), budget_gpuh=2.0, reserve_gpuh=0.1, planner="playbook", executor="local",
                    config={})
    return nb


def test_plain_lines_off_a_terminal(tmp_path):
    out = io.StringIO()
    log = PlainLog(out, session="s")
    log.event("plan: ingest")
    assert out.getvalue().rstrip().endswith("[s] plan: ingest")
    assert isinstance(reporter(tmp_path / "notebook.db", "s", quiet=True), PlainLog)


def test_live_panel_shows_step_budget_and_incumbent(tmp_path):
    nb = _notebook(tmp_path)
    buf = io.StringIO()
    panel = LivePanel(tmp_path / "notebook.db", "s", console=Console(file=buf, force_terminal=True, width=100))
    panel.observe(summarize(nb, "s"))
    panel.event("act: calibrate")
    time.sleep(1.5)  # one refresh of the background thread, which reads the notebook itself
    panel.close()
    text = buf.getvalue()
    assert "act: calibrate" in text and "budget 0.000 / 2.000 GPU-h" in text and "incumbent: none yet" in text
