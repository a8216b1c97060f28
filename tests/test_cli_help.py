"""The CLI says how to run it: --help shows the default command's flags; reserved names are not read as `run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import run_agent

REPO = Path(__file__).resolve().parents[1]


def test_top_level_help_shows_the_default_commands_flags():
    proc = subprocess.run([sys.executable, "run_agent.py", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    for flag in ("--budget", "--lab", "--session", "--planner", "--executor"):
        assert flag in proc.stdout, flag
    assert "verify" in proc.stdout and "check-feedback" in proc.stdout


def test_reserved_names_say_what_brings_them(tmp_path, capsys):
    for name in [n for n in run_agent.RESERVED if n not in run_agent.SUBCOMMANDS]:
        assert run_agent.main([name, "x", "--lab", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "arrives with" in err and "--budget" not in err, err
    assert not list(tmp_path.iterdir())
