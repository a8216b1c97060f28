"""The judge under a failing endpoint (issue 30): requests go out concurrently up to the bound, transient failures
(HTTP 500, 429 with Retry-After) are retried with backoff, a judgment that keeps failing is recorded as failed
(never a tie), and the suite fails past its error share. A real openai client against a loopback server."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from evals import judge
from evals.types import suite_metrics

FENCE = re.compile(r"<<<(PROMPT|ANSWER A|ANSWER B) [0-9a-f]{16}>>>\n(.*?)\n<<<END \1 [0-9a-f]{16}>>>", re.DOTALL)
POLICY = judge.JudgePolicy(concurrency=3, retries=4, backoff_s=0.01, max_backoff_s=0.05, max_error_share=0.25)


class Flaky(BaseHTTPRequestHandler):
    """Judges by rule; each distinct judgment (prompt and answers, the nonce left out) is numbered on arrival:
    every third one fails with 500 on its first try, every fifth answers 429 (Retry-After: 0) to its first two;
    a prompt with DOWN in it fails with 503 always. Counts requests in flight."""

    lock = threading.Lock()
    tries: dict[tuple, int] = {}
    order: dict[tuple, int] = {}
    in_flight = 0
    most_in_flight = 0
    requests = 0

    def do_POST(self):  # noqa: N802 (http.server's method name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        parts = dict(FENCE.findall(body["messages"][1]["content"]))
        key = (parts["PROMPT"], parts["ANSWER A"], parts["ANSWER B"])
        cls = Flaky
        with cls.lock:
            cls.requests += 1
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
            index = cls.order.setdefault(key, len(cls.order))
            cls.tries[key] = attempt = cls.tries.get(key, 0) + 1
        time.sleep(0.05)  # long enough for the client's other workers to arrive meanwhile
        if "DOWN" in parts["PROMPT"]:
            reply = 503, {"error": {"message": "overloaded, key sk-secret-echo"}}, None
        elif index % 3 == 0 and attempt == 1:
            reply = 500, {"error": {"message": "internal"}}, None
        elif index % 5 == 1 and attempt <= 2:
            reply = 429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}
        else:
            verdict = "A" if "good" in parts["ANSWER A"] else "B"
            reply = 200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                          "choices": [{"index": 0, "finish_reason": "stop",
                                       "message": {"role": "assistant", "content": f"VERDICT: {verdict}"}}]}, None
        # Out of flight before the reply is written: once the client has read it, it may send its next request
        # before this thread would get past the write, and that request must not be counted beside this one.
        with cls.lock:
            cls.in_flight -= 1
        self._send(*reply)

    def _send(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                            **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky():
    Flaky.tries, Flaky.order, Flaky.in_flight, Flaky.most_in_flight, Flaky.requests = {}, {}, 0, 0, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield judge.OpenAIJudge(base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", model="j", api_key="k")
    httpd.shutdown()
    httpd.server_close()


def _battles(item, completion, prompts):
    items = [item(f"i{k}", p) for k, p in enumerate(prompts)]
    return items, [completion(i.id, "a good answer") for i in items], [completion(i.id, "a poor one") for i in items]


def test_retries_and_the_concurrency_bound_hold(flaky, tmp_path, item, completion):
    items, cand, inc = _battles(item, completion, [f"q{k}" for k in range(10)])
    outcomes, record = judge.score(items, cand, inc, flaky, seed=1, judgments_path=tmp_path / "j.jsonl", policy=POLICY)
    # Every judgment got its verdict in the end: the candidate wins every item.
    assert [o.label for o in outcomes] == ["win"] * 10
    # 20 judgments: #0, 3, 6, ... fail their first try (500: 7 retries); #1, 11, 16 their first two (429: 6 retries);
    # #6 its first with 500 and its second with 429 (one more retry).
    retried = 7 + 6 + 1
    assert Flaky.requests == 20 + retried
    assert 1 < Flaky.most_in_flight <= POLICY.concurrency
    rows = [json.loads(line) for line in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert sum(r.get("attempts", 1) - 1 for r in rows) == retried
    assert not any("error" in r for r in rows)


def test_a_failed_item_is_recorded_as_failed_and_the_suite_fails_past_the_error_share(flaky, tmp_path, item,
                                                                                        completion):
    # One item of five down (20%, within the 25% tolerated): recorded as failed, with no score.
    items, cand, inc = _battles(item, completion, ["q0", "q1 DOWN", "q2", "q3", "q4"])
    outcomes, _ = judge.score(items, cand, inc, flaky, seed=2, judgments_path=tmp_path / "a.jsonl", policy=POLICY)
    down = outcomes[1]
    assert down.label == "failed" and "win_score" not in down.values  # not a tie: no score at all
    assert down.reasons == ("judge request failed: InternalServerError (HTTP 503)",) * 2
    metrics = suite_metrics(outcomes)
    assert metrics["n_win_score"] == 4 and metrics["win_score"] == 1.0 and metrics["n_judge_failed"] == 1
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    failed = [r for r in rows if "error" in r]
    assert len(failed) == 2 and all(r["attempts"] == POLICY.retries + 1 and r["reply"] == "" for r in failed)
    assert "sk-secret-echo" not in (tmp_path / "a.jsonl").read_text()  # the endpoint's text is never kept
    # Two of five down (40% > 25%): the suite fails, its judgments still on disk.
    items, cand, inc = _battles(item, completion, ["q0", "q1 DOWN", "q2 DOWN", "q3", "q4"])
    with pytest.raises(judge.JudgeFailed, match=r"2 of 5 items failed after retries \(40%\), over the tolerated 25%"):
        judge.score(items, cand, inc, flaky, seed=3, judgments_path=tmp_path / "b.jsonl", policy=POLICY)
    assert len((tmp_path / "b.jsonl").read_text().splitlines()) == 10


def test_an_error_that_is_not_transient_is_not_retried(tmp_path, item, completion):
    # A local judge function's own exception is a bug, not the endpoint's weather: it surfaces at once.
    items, cand, inc = _battles(item, completion, ["q0"])

    def broken(prompt: str, a: str, b: str) -> str:
        raise ZeroDivisionError("bug")

    with pytest.raises(ZeroDivisionError):
        judge.score(items, cand, inc, broken, seed=0, judgments_path=tmp_path / "c.jsonl", policy=POLICY)
