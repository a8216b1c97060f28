"""One redaction (core/redact.py) at the places text is stored or logged (issue 34, section 3): a held key
and a credential-shaped string never reach the notebook file (the hash chain covers the redacted record, so
`verify` still passes), nor any log line of the process, whichever logger or handler (a traceback included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from core import redact
from memory.notebook import Notebook

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import REPO  # noqa: E402

KEY = "pl-held-Zq8Wm2Xv5Kt9Rb3N"  # no known shape: redacted because the process holds it
URL = "https://admin:hunter2hunter2@proxy.internal/v1"


def test_a_held_key_and_url_credentials_never_reach_the_notebook_and_the_chain_verifies(tmp_path: Path) -> None:
    redact.hold(KEY)
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s", lab=str(tmp_path), budget_gpuh=1, reserve_gpuh=0, planner="openai", executor="local", config={})
    nb.record_decision("s", "plan", f"endpoint said: invalid key {KEY}", {"url": URL, KEY: "as a key too"})
    call = nb.record_tool_call("s", "evaluate", {"artifact": 1})
    nb.finish_tool_call(call.id, "failed", {"summary": f"Bearer {KEY} refused", "data": {}})
    nb.start_job("k", session="s", kind="eval", executor="local", resources={}, forecast_gpuh=0.0)
    nb.update_job("k", 1, state="failed", failure_class="error", failure_detail=f"Authorization: Bearer {KEY}")
    (decision,) = nb.decisions("s", kind="plan")
    assert decision.rationale == f"endpoint said: invalid key {redact.MARK}"
    assert nb.verify().ok, nb.verify().problem
    nb.close()
    data = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())  # the file and its -wal
    assert KEY.encode() not in data and b"hunter2" not in data and redact.MARK.encode() in data


def test_every_log_record_of_the_process_is_redacted() -> None:
    # In its own process: the record factory is process-wide (run_agent.py installs it first thing).
    code = f"""
import logging, sys
from core import redact
redact.install_log_redaction()
redact.hold({KEY!r})
logging.basicConfig(stream=sys.stderr, format="%(name)s %(message)s")
logging.getLogger("httpx").warning("request to %s failed with key %s", {URL!r}, {KEY!r})
try:
    raise RuntimeError("401: echo of Bearer {KEY}")
except RuntimeError:
    logging.getLogger("openai").exception("the endpoint refused")
logging.getLogger("x").error("not a format: %s %s", "only one")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert KEY not in proc.stderr and "hunter2" not in proc.stderr, proc.stderr
    assert "httpx request to https://[redacted]@proxy.internal/v1 failed with key [redacted]" in proc.stderr
    assert "RuntimeError: 401: echo of Bearer [redacted]" in proc.stderr  # the traceback, redacted
    assert "not a format" in proc.stderr  # a record whose arguments do not fit is still logged, not raised


def test_redaction_keeps_structure_and_is_idempotent() -> None:
    redact.hold(KEY)
    value = {"a": [f"x{KEY}y", 3, None, {"sk-live-0123456789abcdefgh": URL}], "b": ("Bearer abcdefgh12345",)}
    once = redact.redact_data(value)
    assert once == {"a": [f"x{redact.MARK}y", 3, None, {redact.MARK: "https://[redacted]@proxy.internal/v1"}],
                    "b": ("Bearer [redacted]",)}
    assert redact.redact_data(once) == once
    assert redact.redact("sk-learn-tests and a short key abc") == "sk-learn-tests and a short key abc"


def test_graph_checkpoints_are_written_redacted() -> None:
    # graph.sqlite's serializer (agent/runner.py): a secret in the state never reaches the checkpoint's bytes.
    from agent.runner import RedactingSerializer

    redact.hold(KEY)
    serde = RedactingSerializer()
    state = {"feedback": [f"the endpoint said {KEY}"], "proposal": {"args": {"url": URL}}, "step": 3}
    kind, data = serde.dumps_typed(state)
    assert KEY.encode() not in data and b"hunter2" not in data
    assert serde.loads_typed((kind, data)) == {"feedback": [f"the endpoint said {redact.MARK}"],
                                               "proposal": {"args": {"url": "https://[redacted]@proxy.internal/v1"}},
                                               "step": 3}
