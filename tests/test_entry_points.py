"""Every `python -m X CONFIG.json` entry point refuses a missing file, bad JSON and a bad field with exit 2."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (module, leading arguments before CONFIG.json, a field name that must appear in the bad-field message)
ENTRY_POINTS = [
    ("trainers.sft", [], "model"),
    ("trainers.dpo", [], "model"),
    ("trainers.klce", [], "model"),
    ("trainers.rft", [], "model"),
    ("trainers.merge", ["soup"], "models"),
    ("evals.job", [], "model"),
    ("tools.data.datasets", ["winner_sft"], "split"),
]


def _cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"model": "m",\n  "steps": }\n')
    bad_field = tmp_path / "field.json"
    bad_field.write_text(json.dumps({"no_such_field": 1}))
    return {
        "missing file": (tmp_path / "absent.json", "no such file"),
        "bad json": (bad_json, "bad.json:2:12: invalid JSON"),
        "bad field": (bad_field, "problem(s) in"),
    }


@pytest.mark.parametrize(("module", "lead", "field"), ENTRY_POINTS, ids=[m for m, _, _ in ENTRY_POINTS])
def test_entry_point_refuses_bad_config_with_exit_2(module, lead, field, tmp_path, capsys):
    main = importlib.import_module(module).main
    for case, (path, expected) in _cases(tmp_path).items():
        assert main([*lead, str(path)]) == 2, case
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(path) in err and expected in err, (case, err)
        assert "Traceback" not in err
        if case == "bad field":
            assert f"field {field}" in err or "field no_such_field" in err, err
    assert main([]) == 2 and "usage: python -m " in capsys.readouterr().err


def test_entry_point_as_a_subprocess_has_no_traceback(tmp_path):
    # The real command line, once: what a Slurm job log shows for a broken config.
    for path, expected in _cases(tmp_path).values():
        proc = subprocess.run([sys.executable, "-m", "trainers.sft", str(path)], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
