"""Shared pieces of the hostile-input corpus: a valid lab to break, the CLI run as real subprocesses,
and the assertions every refusal must pass (exit 2, no traceback, the place named, nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BATTLE = {"messages": [{"role": "user", "content": "q"}], "own": "a", "other": "b", "vote": "own"}

LAB_TOML = """
bars = "bars.toml"

[model]
base = "models/base"
parent = "models/parent"

[feedback]
file = "feedback.jsonl"
dev_fraction = 0.2
sealed_fraction = 0.2

[[data]]
name = "replay"
path = "data/replay.jsonl"
cap = 500

[[evals]]
name = "math"
scorer = "math"
file = "data/math.jsonl"

[[evals]]
name = "confirm"
scorer = "judge"
sealed = true

[executor]
kind = "slurm"
time_limit_min = 120
[executor.slurm]
partition = "gpu"
gpus_per_node = 4
extra_sbatch = ["--exclusive", "#SBATCH --constraint=h100"]

[planner]
kind = "openai"
base_url = "http://127.0.0.1:8000/v1"
model = "planner-1"

[judge]
kind = "oracle"

[serving]
system_prompt_file = "system.txt"
[serving.decoding]
temperature = 0.7
top_p = 0.9
max_new_tokens = 256
"""

BARS_TOML = '[[bar]]\nsuite = "math"\nmetric = "correct"\nrule = "delta >= -1.0 * noise_floor"\n'


def battles(n: int = 10) -> list[dict]:
    votes = ["own", "other", "tie", "both_bad"]
    return [BATTLE | {"id": f"b{i}", "messages": [{"role": "user", "content": f"question number {i}"}],
                      "vote": votes[i % 4]} for i in range(n)]


def write_jsonl(path: Path, rows: Sequence[dict | str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def make_lab(root: Path) -> Path:
    """A lab whose lab.toml and every input file are valid (model directories hold a config and tokenizer)."""
    for d in ("models/base", "models/parent"):
        (root / d).mkdir(parents=True)
        (root / d / "config.json").write_text('{"model_type": "nemotron_h"}')
    (root / "models/base/tokenizer.json").write_text("{}")
    write_jsonl(root / "feedback.jsonl", battles())
    write_jsonl(root / "data/replay.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "hello"}]}])
    write_jsonl(root / "data/math.jsonl", [{"id": f"m{i}", "messages": [{"role": "user", "content": f"{i}+1?"}],
                                            "gold": str(i + 1)} for i in range(3)])
    (root / "bars.toml").write_text(BARS_TOML)
    (root / "system.txt").write_text("You are a careful assistant.\n")
    (root / "lab.toml").write_text(LAB_TOML)
    return root


def group_alive(pgid: int) -> bool:
    """Whether any process of the group `pgid` is alive (an agent's, its jobs')."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def files(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for directories and specials): 'nothing appeared or changed'."""
    out: dict[str, bytes | None] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.read_bytes() if p.is_file() and not p.is_symlink() else None
    return out


def run_cli(argvs: Sequence[Sequence[str]], cwd: Path = REPO) -> list[subprocess.CompletedProcess[str]]:
    """Runs `run_agent.py ARGS` for each argv at once (real processes; concurrent to keep the corpus fast)."""
    procs = [subprocess.Popen([sys.executable, str(REPO / "run_agent.py"), *argv], cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv in argvs]
    out = []
    for argv, p in zip(argvs, procs, strict=True):
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(list(argv), p.returncode, stdout, stderr))
    return out


def assert_refused(returncode: int, stderr: str, *where: str) -> None:
    """Bad input: exit 2, one message on one line without a traceback, naming each of `where`."""
    assert returncode == 2, (returncode, stderr)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    for place in where:
        assert place in stderr, (place, stderr)
