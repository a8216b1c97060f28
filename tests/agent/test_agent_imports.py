"""The agent process plans, gates and records; jobs load models. So neither the agent nor its CLI imports torch,
transformers or peft until a job of its own is built (a train or merge config): a refused command answers in a
second of CPU instead of seven, and every session, replay and resume starts without loading a model stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Also what only a statistical test (scipy) or a judge call (openai) needs: the CLI's commands that run neither
# (verify, a refusal) start without them.
HEAVY = ("torch", "transformers", "peft", "trl", "datasets", "scipy", "openai")


def test_the_agent_and_its_replay_import_no_model_stack():
    code = ("import sys; import agent.runner, agent.replay, agent.closing; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"imported with the agent: {run.stdout.strip()}"


def test_a_refused_run_answers_before_any_model_stack_loads(tmp_path: Path):
    code = ("import runpy, sys; sys.argv = ['run_agent.py', '--budget', '1gpuh', '--lab', sys.argv[1]]\n"
            "try:\n    runpy.run_path('run_agent.py', run_name='__main__')\n"
            f"except SystemExit as e:\n    print(e.code, ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.split(" ") == ["2", "\n"], run.stdout + run.stderr
