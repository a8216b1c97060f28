"""The session report (`run_agent.py report`), opened in headless Chromium.

The report of the agent tests' finished session (tests/conftest.py `finished`: a real playbook
session on the small lab, killed twice and resumed) loads with no console error and no request
leaving the file, every plot drawn; a copy of that notebook extended through the Notebook API with a
failed job, a refusal and a longer dose sweep shows all three; bad inputs exit 2 with one line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import struct
import sys
from pathlib import Path

import pytest

import run_agent
from memory.notebook import Notebook
from memory.records import FailPayload, GateRefusal
from memory.report import write_report

sys.path.insert(0, str(Path(__file__).parent))
from chromium import CHROMIUM, Browser  # noqa: E402
from test_floor_units import check_printed_floors  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# `finished` (tests/conftest.py) is the agent tests' session: the suite runs it once for both.

HOSTILE = '<script>document.title="owned"</script><img src="https://example.com/x.png" onerror="alert(1)">'
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing: run `make chromium`")

# Per plot: its name, how many marks it draws, its drawn size.
PLOTS_JS = """JSON.stringify(Array.from(document.querySelectorAll('svg.plot')).map(function (s) {
  var box = s.getBoundingClientRect();
  return {plot: s.dataset.plot, marks: s.querySelectorAll('.mark').length, dots: s.querySelectorAll('.dot').length,
          fails: s.querySelectorAll('.fail').length, chosen: s.querySelectorAll('.chosen').length,
          width: box.width, height: box.height};
}))"""


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def _open(tmp_path: Path, html: Path) -> tuple[dict, list[dict]]:
    """Load the report; return what the page showed (plots, errors, requests, screenshot) for the asserts."""
    with Browser.start(tmp_path) as browser:
        page = browser.open(html)
        plots = json.loads(page.evaluate(PLOTS_JS))
        shot = page.screenshot(tmp_path / "report.png")
        seen = {
            "errors": page.errors(), "requests": page.requests(), "title": page.evaluate("document.title"),
            "scripts": page.evaluate("document.scripts.length"), "images": page.evaluate("document.images.length"),
            "rows": page.evaluate("JSON.stringify(Array.from(document.querySelectorAll('table.decisions tbody tr'))"
                                  ".map(function (r) { return [r.id, r.className, r.textContent]; }))"),
            "shot": shot,
        }
        for _ in range(2):  # sort the timeline by seq: ascending, then descending
            page.evaluate("document.querySelector('table.decisions th').click()")
        seen["first_after_sort"] = page.evaluate("document.querySelector('table.decisions tbody tr').id")
    seen["rows"] = json.loads(seen["rows"])
    return seen, plots


def _assert_clean(seen: dict, plots: list[dict], html: Path) -> None:
    assert seen["errors"] == []
    assert seen["requests"] == [html.resolve().as_uri()], "a request left the file"
    assert seen["scripts"] == 1 and seen["images"] == 0
    for p in plots:
        assert p["marks"] > 0 and p["width"] > 100 and p["height"] > 30, p
    width, height = _png_size(seen["shot"])
    assert width >= 1000 and height > 1500, (width, height)
    assert seen["shot"].stat().st_size > 50_000


@needs_chromium
def test_the_report_of_a_real_session_opens_clean_in_chromium(finished, tmp_path: Path, capsys):
    notebook = finished.lab / "notebook.db"
    before, out = _sha(notebook), tmp_path / "report.html"
    assert run_agent.main(["report", "--lab", str(finished.lab), "-o", str(out)]) == 0
    assert f"report of session {finished.session}" in capsys.readouterr().out
    assert _sha(notebook) == before, "the report wrote to the notebook"
    with Notebook.open(notebook, readonly=True) as nb:
        comparisons, decisions = nb.comparisons(finished.session), nb.decisions(finished.session)
        doses = [a for a in nb.artifacts(kind="checkpoint") if a.recipe.get("merge") == "dose"]
    seen, plots = _open(tmp_path, out)
    _assert_clean(seen, plots, out)
    names = [p["plot"] for p in plots]
    assert names.count("burn-down") == 1 and names.count("lineage") == 1
    assert names.count("deltas") == len(comparisons) > 0
    assert names.count("dose") == (1 if doses else 0)
    assert [r[0] for r in seen["rows"]] == [f"decision-{d.seq}" for d in decisions]
    assert seen["first_after_sort"] == f"decision-{decisions[-1].seq}"
    html = out.read_text().replace('xmlns="http://www.w3.org/2000/svg"', "")  # a namespace name, never fetched
    assert "verifies</span>" in html and "http://" not in html and "https://" not in html


def _copy(notebook: Path, to: Path) -> Path:
    src, dst = sqlite3.connect(f"{notebook.resolve().as_uri()}?mode=ro", uri=True), sqlite3.connect(to)
    src.backup(dst)
    src.close()
    dst.close()
    return to


def _extend(path: Path, session: str) -> int:
    """Add a failed job, a refusal with hostile text and two more dose points; return the sweep's merged points."""
    with Notebook.open(path) as nb:
        checkpoints = nb.artifacts(kind="checkpoint", session=session)
        doses = [a for a in checkpoints if a.recipe.get("merge") == "dose"]
        start, end = doses[0].recipe["models"] if doses else (checkpoints[0].id, checkpoints[1].id)
        nb.start_job("k-oom", session=session, kind="dpo", executor="local", resources={}, forecast_gpuh=0.05)
        job = nb.get_job("k-oom", 1)
        nb.update_job("k-oom", 1, state="failed", failure_class="oom", failure_detail=f"CUDA out of memory {HOSTILE}",
                      gpu_hours=0.01, device_seconds=36.0, charge="measured", started_at=job.submitted_at,
                      ended_at=job.submitted_at)
        nb.record_decision(session, "fail", "dpo failed: oom", FailPayload(
            key="k-oom", attempt=1, failure_class="oom", detail=f"CUDA out of memory {HOSTILE}"))
        nb.record_decision(session, "refuse", f"gate refused: {HOSTILE}", GateRefusal(
            tool="train", args={"steps": 10**6}, reason=f"forecast 900 GPU-h exceeds the budget left {HOSTILE}"))
        end_evals = [e for e in nb.evals(artifact_id=end, session=session) if e.served and e.replicate == 0]
        for alpha in (0.25, 1.5):
            a = nb.add_artifact(kind="checkpoint", name=f"dose-{alpha}", path=f"/nowhere/{alpha}", sha256=f"{alpha}" * 8,
                                parents=[start, end], recipe={"merge": "dose", "alpha": alpha, "models": [start, end]},
                                session=session)
            for e in end_evals:
                nb.add_eval(session=session, artifact_id=a.id, suite=e.suite, replicate=0, decoding=e.decoding,
                            decoding_sha256=e.decoding_sha256, served=True, metrics=e.metrics, items=e.items)
        return len(doses) + 2


@needs_chromium
def test_a_failed_job_a_refusal_and_a_dose_sweep_are_all_shown(finished, tmp_path: Path):
    notebook = _copy(finished.lab / "notebook.db", tmp_path / "notebook.db")
    merged = _extend(notebook, finished.session)
    out = tmp_path / "extended.html"
    write_report(notebook, finished.session, out)
    seen, plots = _open(tmp_path, out)
    _assert_clean(seen, plots, out)  # the hostile text ran no script and loaded no image
    assert seen["title"] == f"Session {finished.session}: report"
    fail_rows = [r for r in seen["rows"] if "kind-fail" in r[1]]
    assert fail_rows and "oom" in fail_rows[-1][2] and "CUDA out of memory <script>" in fail_rows[-1][2]
    refusals = [r for r in seen["rows"] if "kind-refuse" in r[1]]
    assert refusals and "forecast 900 GPU-h exceeds the budget left <script>" in refusals[-1][2]
    burn = next(p for p in plots if p["plot"] == "burn-down")
    assert burn["fails"] >= 1
    dose = [p for p in plots if p["plot"] == "dose"]
    assert len(dose) == 1 and dose[0]["dots"] % (merged + 2) == 0 and dose[0]["dots"] >= merged + 2
    assert dose[0]["chosen"] <= 1


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------


def _new(path: Path, *, session: bool, decisions: bool) -> Path:
    with Notebook.open(path) as nb:
        if session:
            nb.open_session("s1", lab="lab", budget_gpuh=1, reserve_gpuh=0.1, planner="playbook", executor="local",
                            config={})
        if decisions:
            nb.record_decision("s1", "plan", "why", {"next": "sft"})
    return path


def _truncated(path: Path) -> Path:
    _new(path, session=True, decisions=True)
    Notebook.open(path).close()  # checkpointed: the whole notebook now lies in the main file
    path.write_bytes(path.read_bytes()[:-1000])
    return path


@pytest.mark.parametrize(("make", "args", "message"), [
    (None, [], "no notebook here"),
    (lambda p: _new(p, session=False, decisions=False), [], "no session in this notebook yet"),
    (lambda p: _new(p, session=True, decisions=True), ["--session", "other"], "no session 'other' (sessions here: s1)"),
    (lambda p: _new(p, session=True, decisions=False), [], "session 's1' is empty"),
    (lambda p: p.write_bytes(b"not a notebook at all, just bytes" * 200), [], "is not an SQLite database"),
    (_truncated, [], "is truncated"),
])
def test_bad_input_says_what_and_exits_2(tmp_path: Path, capsys, make, args, message):
    lab = tmp_path / "lab"
    lab.mkdir()
    if make:
        make(lab / "notebook.db")
    out = tmp_path / "report.html"
    assert run_agent.main(["report", "--lab", str(lab), "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and not out.exists()


def test_an_output_directory_is_refused(tmp_path: Path, capsys):
    lab = tmp_path / "lab"
    _new(lab / "notebook.db", session=True, decisions=True)
    assert run_agent.main(["report", "--lab", str(lab), "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_public_text_is_escaped_and_the_default_output_is_the_lab(tmp_path: Path):
    lab = tmp_path / "lab"
    with Notebook.open(_new(lab / "notebook.db", session=True, decisions=True)) as nb:
        nb.add_artifact(kind="checkpoint", name=HOSTILE, path="/p", sha256="a" * 64, recipe={"role": "parent"},
                        session="s1")
        nb.record_decision("s1", "plan", HOSTILE, {"tool": HOSTILE})
    assert run_agent.main(["report", "--lab", str(lab)]) == 0
    html = (lab / "report.html").read_text()
    assert HOSTILE not in html and html.count("<script>") == 1 and "<img" not in html
    assert "&lt;script&gt;document.title=&quot;owned&quot;&lt;/script&gt;" in html
    shutil.rmtree(lab)


def test_card_and_report_print_each_bars_floor_in_its_thresholds_unit_by_default(finished, tmp_path):
    """The default floor unit (`resolvable`): the floor a threshold used may be coarser than the replicates' mean
    absolute delta, and the card and the report print the one the threshold used (issue 42)."""
    lab = tmp_path / "lab"
    shutil.copytree(finished.lab, lab, symlinks=True, ignore=shutil.ignore_patterns("lab.lock"))
    assert check_printed_floors(lab, finished.session, "resolvable") >= 1
