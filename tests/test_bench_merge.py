"""bench/decision_quality.py --merge: several `--variants` runs become one result file, each variant from the one
run that measured it and every run's command kept; runs of different settings, a variant in two files and a file
that is no result are refused with one line (exit 2) and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "hostile"))
from hostile_kit import REPO, assert_refused  # noqa: E402


def one_run(path: Path, variants: list[str], truth_n: int = 2000, size: str = "demo") -> Path:
    """A file as `decision_quality.py --variants ... --out PATH` writes it (the fields merge reads, real shapes)."""
    command = f"python bench/decision_quality.py --variants {','.join(variants)} --size {size} --truth-n {truth_n}"
    config = {"size": size, "protocol": "short", "budget": "60gpuh", "truth_n": truth_n, "truth_seed": 0}
    path.write_text(json.dumps({
        "command": command, "config": config, "host": {"machine": "x86_64"}, "wall_s": 1.0,
        "variants": {v: {"summary": {}, "goals": [], "table": f"| {v} |", "sessions": [{"seed": 601}]}
                     for v in variants}}))
    return path


def merge(*args: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/decision_quality.py", "--merge", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_merge_keeps_each_variant_and_every_run(tmp_path):
    a = one_run(tmp_path / "a.json", ["small-holdout", "misleading-screens"])
    b = one_run(tmp_path / "b.json", ["strong-parent"], size="test")  # strong-parent runs at its own size
    first = merge(a, b, "--out", tmp_path / "ab.json")
    assert first.returncode == 0, first.stderr
    ab = json.loads((tmp_path / "ab.json").read_text())
    assert list(ab["variants"]) == ["small-holdout", "misleading-screens", "strong-parent"]
    assert [r["variants"] for r in ab["runs"]] == [["misleading-screens", "small-holdout"], ["strong-parent"]]
    assert ab["variants"]["strong-parent"]["table"] == "| strong-parent |"
    c = one_run(tmp_path / "c.json", ["noisy-judge"])
    again = merge(tmp_path / "ab.json", c, "--out", tmp_path / "abc.json")  # a merged file merges again
    assert again.returncode == 0, again.stderr
    abc = json.loads((tmp_path / "abc.json").read_text())
    assert len(abc["runs"]) == 3 and set(abc["variants"]) == set(ab["variants"]) | {"noisy-judge"}


def test_merge_refuses_what_would_mix_or_replace_figures(tmp_path):
    a = one_run(tmp_path / "a.json", ["noisy-judge"])
    out = tmp_path / "out.json"
    twice = merge(a, one_run(tmp_path / "b.json", ["noisy-judge"]), "--out", out)
    assert_refused(twice.returncode, twice.stderr, "b.json", "'noisy-judge'", "a.json")
    other_truth = merge(a, one_run(tmp_path / "c.json", ["harmful-arms"], truth_n=500), "--out", out)
    assert_refused(other_truth.returncode, other_truth.stderr, "c.json", "'truth_n': 500", "not merged")
    (tmp_path / "d.json").write_text('{"rows": []}')
    not_result = merge(a, tmp_path / "d.json", "--out", out)
    assert_refused(not_result.returncode, not_result.stderr, "d.json", "expected a `--variants` result")
    assert not out.exists()
