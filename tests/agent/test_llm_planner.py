"""The LLM planner against a loopback OpenAI-compatible HTTP server started by the test.

Scripted tool-call replies: malformed JSON, an unknown tool, a path outside the lab (3 bad replies in
a row: the playbook's next step is taken and the decision says so), bars, a launch that would bust the
budget (refused by the gate), stop. The lab's battles carry a prompt injection and a fake tool call:
no planner request contains any battle text, and no decision follows the injection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.toolbox import PLANNER_TOOLS
from memory.notebook import Notebook

sys.path.insert(0, str(Path(__file__).parent))
from labkit import INJECTION, make_lab  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = [
    ("ingest", '{"reason": "split first"'),               # malformed JSON
    ("delete_everything", "{}"),                          # unknown tool
    ("register_bars", '{"file": "/etc/passwd"}'),         # a path outside the lab: refused by the gates
    ("register_bars", "{}"),
    ("calibrate", '{"artifact": 1, "k": 3}'),             # even its 1-minute bound busts a 1 GPU-minute budget
    ("stop", '{"reason": "scripted end"}'),
]


class Scripted(BaseHTTPRequestHandler):
    requests: list[dict] = []
    replies: list[tuple[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Scripted.requests.append(body)
        name, arguments = Scripted.replies.pop(0) if Scripted.replies else ("stop", '{"reason": "script done"}')
        reply = {"id": f"c{len(Scripted.requests)}", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                     "role": "assistant", "content": f"scripted step {len(Scripted.requests)}",
                     "tool_calls": [{"id": "t1", "type": "function", "function": {"name": name, "arguments": arguments}}]}}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        return None


@pytest.fixture(scope="module")
def llm_session(tmp_path_factory):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Scripted.requests, Scripted.replies = [], list(SCRIPT)
    lab = make_lab(tmp_path_factory.mktemp("llm") / "lab", injected=True,
                   planner_url=f"http://127.0.0.1:{server.server_address[1]}/v1")
    env = {**os.environ, "POSTLAB_TEST_PLANNER_KEY": "test-key"}
    out = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "--budget", "1gpum", "--lab", str(lab),
                          "--session", "llm", "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=1200,
                         env=env)
    server.shutdown()
    # Every scored step was refused (budget), so no candidate has a served eval to bundle: nothing is
    # nominated and the session ends as failed (exit 1), with the refusal recorded.
    assert out.returncode == 1 and "nothing nominated" in out.stdout, out.stdout + out.stderr
    return lab, Scripted.requests


def test_bad_replies_are_recorded_fed_back_and_replaced_by_the_playbook(llm_session):
    lab, requests = llm_session
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        refusals = [d.rationale for d in nb.decisions("llm", kind="refuse")]
        assert any("not valid JSON" in r for r in refusals) and any("unknown tool 'delete_everything'" in r for r in refusals)
        assert any("outside the lab" in r for r in refusals) and any("gate: budget" in r for r in refusals)
        plans = nb.decisions("llm", kind="plan")
        fallback = [p for p in plans if "3 bad replies in a row" in p.rationale]
        assert len(fallback) == 1 and fallback[0].payload.tool == "ingest" and fallback[0].payload.planner == "playbook"
        assert [p.payload.tool for p in plans] == ["register_bars", "ingest", "register_bars", "calibrate", "stop"]
        assert [c.tool for c in nb.tool_calls("llm")][:2] == ["ingest", "register_bars"]
        assert any("parent has no eval at its served decoding" in r for r in refusals)
        assert nb.session("llm").status == "failed" and nb.verify().ok
    # Each reason came back to the planner in the next request.
    assert "not valid JSON" in json.dumps(requests[1]) and "unknown tool" in json.dumps(requests[2])
    assert len(requests) == len(SCRIPT)  # the fallback step asked nobody


def test_tools_are_offered_with_schemas_from_the_argument_models(llm_session):
    _, requests = llm_session
    for body in requests:
        assert [t["function"]["name"] for t in body["tools"]] == list(PLANNER_TOOLS)
        train = next(t for t in body["tools"] if t["function"]["name"] == "train")["function"]["parameters"]
        assert {"trainer", "parent", "dataset", "lr"} <= set(train["properties"])


def test_no_battle_text_reaches_the_planner_and_injections_change_nothing(llm_session):
    lab, requests = llm_session
    sent = json.dumps(requests)
    battles = [json.loads(line) for line in (lab / "feedback.jsonl").read_text().splitlines()]
    assert INJECTION not in sent and '"candidate": 99' not in sent
    for b in battles:
        assert b["messages"][-1]["content"] not in sent and b["own"] not in sent
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        assert not nb.decisions("llm", kind="promote") and not nb.comparisons("llm")
