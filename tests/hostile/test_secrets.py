"""Secrets never land anywhere (issue 34, section 3): an OpenAI-compatible endpoint whose 401 body echoes
the Authorization header (and a credential-shaped string) must not put the key into the notebook
(hash-chained decisions cannot be deleted), graph.sqlite, report.html, the session's log lines or the
CLI's output. Tested with a real loopback HTTP server, for the planner (a whole session through
run_agent.py) and for the judge (the openai judge client as an eval job builds it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from core import redact
from evals import judge
from evals.job import OpenAIJudgeSpec, make_judge

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "agent"))
from hostile_kit import REPO  # noqa: E402
from labkit import make_lab  # noqa: E402

# Not shaped like any known key (no sk- prefix): only the held value can redact it.
KEY = "pl-live-7Hq2x9Zk4Rm8Wn3TbV6c"
SHAPED = "sk-proj-4f9a8b7c6d5e4f3a2b1c0d9e"  # a key the process does not hold, echoed too: redacted by its shape


class Echo401(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        Echo401.seen.append(auth)
        body = json.dumps({"error": {"message": f"Incorrect API key provided: {auth}; also tried {SHAPED} and "
                                                f"https://admin:{KEY}@proxy.internal/v1",
                                     "type": "invalid_request_error", "code": "invalid_api_key"}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        return None


@pytest.fixture
def endpoint():
    Echo401.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo401)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _files_holding(root: Path, needle: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes())


def test_the_planners_key_echoed_by_its_endpoint_lands_nowhere(tmp_path: Path, endpoint: str) -> None:
    lab = make_lab(tmp_path / "lab", planner_url=endpoint)
    env = {**os.environ, "POSTLAB_TEST_PLANNER_KEY": KEY}
    run = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "--budget", "1gpum", "--lab", str(lab),
                          "--session", "leak", "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=1200, env=env)
    report = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "report", "--lab", str(lab), "-o",
                             str(lab / "report.html")], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert Echo401.seen and all(a == f"Bearer {KEY}" for a in Echo401.seen)  # the endpoint did get (and echo) the key
    assert run.returncode in (0, 1) and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert report.returncode == 0, report.stderr
    for needle in (KEY, SHAPED):
        assert _files_holding(lab, needle) == [], needle  # notebook.db (and -wal), graph.sqlite, report.html, jobs' logs
        assert needle not in run.stdout + run.stderr + report.stdout + report.stderr
    # What was recorded instead: the class and the HTTP status, in the decisions and the session's log.
    assert "AuthenticationError (HTTP 401)" in run.stdout
    assert (lab / "report.html").is_file() and b"AuthenticationError (HTTP 401)" in (lab / "notebook.db").read_bytes()


def test_the_judges_key_echoed_by_its_endpoint_is_not_in_its_error(endpoint: str, monkeypatch) -> None:
    monkeypatch.setenv("POSTLAB_TEST_JUDGE_KEY", KEY)
    spec = OpenAIJudgeSpec(kind="openai", base_url=endpoint, model="judge-model", api_key_env="POSTLAB_TEST_JUDGE_KEY")
    with pytest.raises(judge.JudgeEndpointError) as err:
        make_judge(spec)("q", "a", "b")
    assert Echo401.seen and Echo401.seen[-1] == f"Bearer {KEY}"
    text = str(err.value)
    assert text == "the judge endpoint (judge-model) failed: AuthenticationError (HTTP 401)"
    assert err.value.__cause__ is None and err.value.__suppress_context__  # the endpoint's error is not chained
    assert redact.redact(f"x {KEY} y") == f"x {redact.MARK} y"  # and the key, once read, is held for redaction


def test_the_judge_job_fails_without_the_key_in_its_log_or_record(tmp_path: Path, endpoint: str, monkeypatch) -> None:
    # The judge inside a real job process: its trace is the job's stderr, its failure the notebook's record.
    from memory.notebook import Notebook
    from tools.jobs.launcher import JobFailed, Launcher, LocalBackend, Resources
    from tools.jobs.probe import JudgeCallConfig, judge_call

    monkeypatch.setenv("POSTLAB_TEST_JUDGE_KEY", KEY)
    nb = Notebook.open(tmp_path / "notebook.db")
    nb.open_session("s", lab=str(tmp_path), budget_gpuh=10, reserve_gpuh=0, planner="playbook", executor="local",
                    config={})
    launcher = Launcher(nb, "s", LocalBackend(), tmp_path / "jobs", poll_s=0.1)
    spec = OpenAIJudgeSpec(kind="openai", base_url=endpoint, model="judge-model", api_key_env="POSTLAB_TEST_JUDGE_KEY")
    job = launcher.submit("probe", judge_call, JudgeCallConfig(judge=spec.model_dump()), Resources(time_limit_min=2, signal_delay_s=10))
    with pytest.raises(JobFailed) as failed:
        job.result(timeout_s=120)
    nb.close()
    assert Echo401.seen and failed.value.record.failure_detail.startswith("evals.judge.JudgeEndpointError")
    assert _files_holding(tmp_path, KEY) == [] and _files_holding(tmp_path, SHAPED) == []
    assert _files_holding(tmp_path, "AuthenticationError (HTTP 401)")  # the job's stderr says what failed
