"""Battles carrying the lab tokenizer's own control strings (issue 44, item 5). The renderer splits every text the
tokenizer reads as a special token wherever the public wrote it (core/chat.py control_strings); check-feedback warns
about battles carrying the fixed shapes (`<|...|>`, every template family's specials), and with a lab also about the
lab tokenizer's own special tokens, whatever their shape (here Mistral's `[TOOL_CALLS]`, which no fixed pattern
knows). `run` prints the same warning line before the session opens: counts and lines, never the text."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from core import tiny
from memory.notebook import Notebook, NotebookError
from tools.data.feedback import CONTROL_STRINGS

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import BATTLE, LAB_TOML, REPO, battles, make_lab, write_jsonl  # noqa: E402

LOCAL = LAB_TOML.replace('kind = "slurm"', 'kind = "local"')
SPECIAL = "[TOOL_CALLS]"  # a special token of the lab's tokenizer in no fixed pattern


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose tokenizer reads SPECIAL as a special token (an additional special token)."""
    root = tmp_path_factory.mktemp("tiny")
    tok = PreTrainedTokenizerFast.from_pretrained(tiny.build_tokenizer(root / "tok"))
    tok.add_special_tokens({"additional_special_tokens": [SPECIAL]})
    tok.save_pretrained(root / "tok")
    return tiny.build_model("llama", root / "tok", root / "llama")


@pytest.fixture
def lab(tmp_path: Path, parent: Path) -> Path:
    """A valid local lab on that parent whose feedback carries SPECIAL in one answer (line 3) and nothing else."""
    assert not CONTROL_STRINGS.search(SPECIAL)
    lab = make_lab(tmp_path / "lab")
    for d in ("models/base", "models/parent"):
        shutil.rmtree(lab / d)
        shutil.copytree(parent, lab / d)
    rows = battles()
    rows[2] = rows[2] | {"own": f"Sure. {SPECIAL} call the tool"}
    write_jsonl(lab / "feedback.jsonl", rows)
    (lab / "lab.toml").write_text(LOCAL)
    return lab


def _check_feedback(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "run_agent.py"), "check-feedback", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


WARNING = ("warning: 1 battle(s) carry chat-template control strings (answers 1, prompts 0), lines 3: they are trained "
           "and evaluated as plain text, never as the template's control tokens")


def test_check_feedback_with_the_lab_warns_about_its_tokenizer_s_special_tokens(lab: Path):
    alone = _check_feedback(str(lab / "feedback.jsonl"))
    assert alone.returncode == 0 and _warnings(alone.stderr) == [], alone.stderr  # no fixed pattern matches it
    done = _check_feedback(str(lab / "feedback.jsonl"), "--lab", str(lab))
    assert done.returncode == 0, done.stderr
    assert _warnings(done.stderr) == [WARNING], done.stderr
    assert SPECIAL not in done.stdout + done.stderr


def test_a_tokenizer_that_does_not_load_leaves_the_fixed_patterns(lab: Path):
    """Its refusal is the session's (agent/inputs.py); check-feedback still warns about what the patterns know."""
    (lab / "models/parent/tokenizer.json").write_text("{")
    rows = battles()
    rows[4] = rows[4] | {"other": "fine<|im_end|>"}
    write_jsonl(lab / "feedback.jsonl", rows)
    done = _check_feedback(str(lab / "feedback.jsonl"), "--lab", str(lab))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert _warnings(done.stderr) == [WARNING.replace("lines 3", "lines 5")], done.stderr


def _run_until_the_session_opens(lab: Path) -> str:
    """`run` on the lab as a user starts it (a real process), stopped once its session is open (the notebook holds
    it): what it printed on stderr by then."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    with open(lab.parent / "run.err", "w") as err:
        proc = subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), "--budget", "1gpuh", "--lab", str(lab),
                                 "--planner", "playbook", "--session", "s1", "--quiet"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while not _opened(lab):
            assert proc.poll() is None, (lab.parent / "run.err").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return (lab.parent / "run.err").read_text()


def _opened(lab: Path) -> bool:
    try:
        with Notebook.open(lab / "notebook.db", readonly=True) as nb:
            return any(s.name == "s1" for s in nb.sessions())
    except NotebookError:
        return False


def test_run_prints_check_feedback_s_warning_line_before_the_session_opens(lab: Path):
    """`run` on the same lab prints the line check-feedback --lab prints, once, on stderr, before its session opens."""
    err = _run_until_the_session_opens(lab)
    expected = _warnings(_check_feedback(str(lab / "feedback.jsonl"), "--lab", str(lab)).stderr)
    assert expected == [WARNING]
    assert _warnings(err) == expected, err
    assert SPECIAL not in err


def test_run_prints_no_warning_for_battles_without_control_strings(lab: Path):
    write_jsonl(lab / "feedback.jsonl", [BATTLE | b for b in battles()])
    assert _warnings(_run_until_the_session_opens(lab)) == []
