"""The CLI says how to run it: --help shows the default command's flags; every command is its own, never read as `run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import run_agent

REPO = Path(__file__).resolve().parents[1]


def test_top_level_help_shows_the_default_commands_flags():
    proc = subprocess.run([sys.executable, "run_agent.py", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    for flag in ("--budget", "--lab", "--session", "--planner", "--executor"):
        assert flag in proc.stdout, flag
    assert "verify" in proc.stdout and "check-feedback" in proc.stdout


def test_every_command_design_names_is_its_own_subcommand(capsys):
    # DESIGN.md's command list; none of them may fall through to `run` (which would ask for --budget).
    for name in ("run", "resume", "replay", "report", "verify", "check-bundle", "check-feedback", "world"):
        assert name in run_agent.SUBCOMMANDS, name
        with pytest.raises(SystemExit) as stop:
            run_agent.main([name, "--help"])
        out = capsys.readouterr().out
        assert stop.value.code == 0 and run_agent.SUBCOMMANDS[name][2] in out, out
        assert name == "run" or "--budget BUDGET" not in out, (name, out)
