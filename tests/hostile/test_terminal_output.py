"""Bounded, terminal-safe output (issue 34, section 6).

Someone else's text (feedback meta keys and values, file names, artifact names, rationales) reaches the terminal,
the HTML report and the model card escaped: no raw ESC sequence (which set the terminal title and cleared the
screen), no raw newline forging an output line, no live bidi override (U+202E). Problem lists stop at the first
20 plus a count; Parquet feedback is refused once its decoded rows pass the bound; `world truth --n` has the bound
of lab.toml's `[truth] n`. The commands run as real subprocesses; each case asserts the exit status, no traceback,
the message naming the place, and nothing written.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import BATTLE, REPO, assert_refused, files, make_lab, run_cli, write_jsonl  # noqa: E402

from core.display import LIST_LIMIT, bounded, shown  # noqa: E402
from memory.notebook import Notebook  # noqa: E402
from memory.records import TRUTH_N_MAX, TRUTH_N_MIN  # noqa: E402
from tools.nomination import card  # noqa: E402

TITLE = "\x1b]0;pwned\x07"  # sets the terminal's title
CLEAR = "\x1b[2J\x1b[H"  # clears the screen
RLO = "\u202e"  # right-to-left override: "evil\u202etxt.exe" reads as "evilexe.txt"


def _raw_controls(text: str) -> list[str]:
    """Characters a terminal or a browser would act on (newlines and tabs aside)."""
    return [c for c in text if (ord(c) < 32 and c not in "\n\t") or c in "\x7f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"]


def test_shown_escapes_controls_and_bidi_and_bounded_counts_the_rest():
    assert shown(f"a{TITLE}b{RLO}c\nd") == "a\\x1b]0;pwned\\x07b\\u202ec\\nd"
    assert shown("line\nline", keep_newlines=True) == "line\nline"
    assert shown("x" * 50, limit=10) == "x" * 10 + "... (40 more characters)"
    assert bounded([str(i) for i in range(25)]) == [str(i) for i in range(LIST_LIMIT)] + ["... and 5 more"]
    assert card.code(f"name{CLEAR}{RLO}`|") == "`name\\x1b[2J\\x1b[H\\u202e'/`"


def test_check_feedback_escapes_meta_keys_values_and_file_names(tmp_path):
    battles = [BATTLE | {"id": f"b{i}", "meta": {f"lang\nFORGED LINE: all good{TITLE}": f"en{CLEAR}{RLO}",
                                                 "category": f"c{i}"}} for i in range(30)]
    path = write_jsonl(tmp_path / f"feedback{TITLE}.jsonl", battles)
    before = files(tmp_path)
    [done] = run_cli([["check-feedback", str(path)]])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "Traceback" not in out and _raw_controls(out) == []
    assert "\nFORGED LINE" not in out and "lang\\nFORGED LINE: all good\\x1b]0;pwned\\x07" in out
    assert "en\\x1b[2J\\x1b[H\\u202e 30" in out and "feedback\\x1b]0;pwned\\x07.jsonl" in out
    category = next(line for line in out.splitlines() if line.startswith("meta.category:"))
    assert "... and 10 more" in category and category.count(", ") == LIST_LIMIT  # 30 values: the first 20 listed
    assert files(tmp_path) == before


def test_problem_lists_stop_at_twenty_and_count_the_rest(tmp_path):
    feedback = write_jsonl(tmp_path / "bad.jsonl", [BATTLE | {"id": f"b{i}", "vote": f"maybe{CLEAR}"} for i in range(1000)])
    lab = make_lab(tmp_path / "lab")
    (lab / "bars.toml").write_text("".join(f'[[bar]]\nsuite = "nope{i}"\nmetric = "correct"\nrule = "delta >= 0"\n'
                                           for i in range(10_000)))
    before = files(tmp_path)
    check, run = run_cli([["check-feedback", str(feedback)], ["--budget", "1gpuh", "--lab", str(lab)]])
    assert check.returncode == 1 and "Traceback" not in check.stderr and _raw_controls(check.stderr) == []
    assert "line 1: vote: unknown vote" in check.stderr and "... and 980 more" in check.stderr
    assert len(check.stderr.splitlines()) <= LIST_LIMIT + 3
    assert_refused(run.returncode, run.stderr, str(lab / "bars.toml"), "10000 problem(s)", "bar[0].suite",
                   "... and 9980 more")
    assert len(run.stderr.splitlines()) <= LIST_LIMIT + 5, run.stderr[:2000]
    assert files(tmp_path) == before


def _parquet(path: Path, rows: int, value: str) -> Path:
    """`rows` battles whose answer is `value`, stored once in a dictionary (the file stays small)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    own = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([value]))
    table = pa.table({"id": [f"b{i}" for i in range(rows)], "own": own, "other": ["b"] * rows,
                      "vote": ["own"] * rows, "messages": [[{"role": "user", "content": "q"}]] * rows})
    pq.write_table(table, path, compression="zstd")
    return path


def test_parquet_feedback_is_refused_once_its_decoded_rows_pass_the_bound(tmp_path):
    amplified = _parquet(tmp_path / "amplified.parquet", 40_000, "x" * 20_000)  # 800 MB decoded from a small file
    many = _parquet(tmp_path / "many.parquet", 30_000, "y" * 50_000)  # 1.5 GB
    assert amplified.stat().st_size < 2 * 1024**2 and many.stat().st_size < 2 * 1024**2
    before = files(tmp_path)
    for path, words in [(amplified, "decode to more than 536870912 bytes"), (many, "decode to more than")]:
        done = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "check-feedback", str(path)], cwd=REPO,
                              text=True, capture_output=True, timeout=600)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert "row " in done.stderr and words in done.stderr and str(path) in done.stderr, done.stderr
    assert files(tmp_path) == before
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child's peak so far
    assert peak_kib < 3 * 1024**2, peak_kib  # bounded: the amplified file would decode to 800 MB (x2 as Python)


def test_world_truth_n_has_the_bound_of_lab_toml(tmp_path):
    low, high = run_cli([["world", "truth", str(tmp_path), "--n", str(TRUTH_N_MIN - 1)],
                         ["world", "truth", str(tmp_path), "--n", str(TRUTH_N_MAX + 1)]])
    for done, n in ((low, TRUTH_N_MIN - 1), (high, TRUTH_N_MAX + 1)):
        assert_refused(done.returncode, done.stderr, f"--n {n}", f"expected {TRUTH_N_MIN} to {TRUTH_N_MAX}",
                       "[truth] n")


def test_the_report_shows_public_text_escaped(tmp_path):
    lab = tmp_path / "lab"
    hostile = f"evil{RLO}txt.exe{TITLE}<script>alert(1)</script>"
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config={})
        nb.add_artifact(kind="checkpoint", name=hostile, path="/p", sha256="a" * 64, session="s1")
        nb.start_job("k-sft", session="s1", kind="sft", executor="local", resources={}, forecast_gpuh=0.1)
        nb.update_job("k-sft", 1, state="failed", gpu_hours=0.1, failure_class="oom", failure_detail=hostile)
        nb.end_session("s1", "failed", f"stopped: {hostile}\nFORGED")
    out = tmp_path / "report.html"
    [done] = run_cli([["report", "--lab", str(lab), "-o", str(out)]])
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    html = out.read_text(encoding="utf-8")
    assert RLO not in html and "\x1b" not in html and "<script>alert" not in html
    assert "evil\\u202etxt.exe\\x1b]0;pwned\\x07&lt;script&gt;alert(1)" in html


def test_a_bundle_file_name_is_shown_escaped_by_check_bundle(tmp_path):
    import bundle_kit

    model = bundle_kit.build_model(tmp_path)
    b = bundle_kit.make_bundle(model, tmp_path / "bundle")
    (b / f"notes{TITLE}{CLEAR}\nFORGED.txt").write_text("x")
    before = files(tmp_path)
    [done] = run_cli([["check-bundle", str(b)]])
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in out and _raw_controls(out) == []
    assert "notes\\x1b]0;pwned\\x07\\x1b[2J\\x1b[H\\nFORGED.txt lies in the bundle but in no manifest" in out
    assert "\nFORGED" not in out
    assert files(tmp_path) == before


@pytest.mark.parametrize("text", [json.dumps({"k": "v"}), "plain"])
def test_plain_text_is_unchanged(text):
    assert shown(text) == text
