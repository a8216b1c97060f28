"""lab.toml and --budget: valid input loads; each class of bad input gets its own message, exit 2, no notebook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import BudgetError, LabConfigError, load_lab_config, parse_budget
from memory.notebook import Notebook

REPO = Path(__file__).resolve().parents[2]

VALID = """
bars = "bars.toml"

[model]
base = "models/base"
parent = "models/parent"

[feedback]
file = "feedback.jsonl"
dev_fraction = 0.1
sealed_fraction = 0.05
stratify_by = "lang"

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
extra_sbatch = ["--exclusive"]

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


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    for d in ("models/base", "models/parent", "data"):
        (tmp_path / d).mkdir(parents=True)
    for f in ("feedback.jsonl", "data/replay.jsonl", "data/math.jsonl", "bars.toml"):
        (tmp_path / f).write_text("")
    (tmp_path / "system.txt").write_text("You are a careful assistant.\n")
    (tmp_path / "lab.toml").write_text(VALID)
    return tmp_path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "run_agent.py", *args], cwd=REPO, capture_output=True, text=True)


def test_valid_lab_loads(lab: Path):
    cfg = load_lab_config(lab)
    assert cfg.model.base == lab / "models/base"
    assert cfg.executor.slurm.gpus_per_node == 4 and cfg.planner.kind == "openai"
    assert [e.name for e in cfg.evals] == ["math", "confirm"] and cfg.evals[1].sealed
    decoding = cfg.serving.served_decoding(stop_token_ids=(2,))
    assert decoding.system_prompt == "You are a careful assistant." and decoding.temperature == 0.7


def test_valid_lab_opens_a_session(lab: Path):
    out = run_cli("--budget", "0.5gpuh", "--lab", str(lab), "--session", "first")
    assert out.returncode == 0, out.stderr
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        session = nb.session("first")
        assert session.budget_gpuh == 0.5 and session.planner == "openai" and session.executor == "slurm"
        assert session.config["executor"]["slurm"]["partition"] == "gpu"
        assert nb.verify().ok


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("[judge]", "[judge]\ncolour = 'red'"), "judge.colour: unknown key"),
        (("gpus_per_node = 4", "gpus_per_node = 'four'"), "executor.slurm.gpus_per_node: Input should be a valid integer"),
        (('"data/math.jsonl"', '"data/nope.jsonl"'), "evals[0].file: path 'data/nope.jsonl' does not exist"),
        (('kind = "slurm"', 'kind = "k8s"'), "executor.kind: Input should be 'local' or 'slurm' (got 'k8s')"),
        (("dev_fraction = 0.1", "dev_fraction = 0.1\nsealed = 3"), "feedback.sealed: unknown key"),
        (('base_url = "http://127.0.0.1:8000/v1"', ""), "planner: kind = 'openai' needs `base_url` and `model`"),
        (("[planner]", "[planner\n"), "not valid TOML"),
        (('model = "planner-1"', 'model = "planner-1"\napi_key = "sk-123"'), "planner.api_key: secrets never go in lab.toml"),
    ],
)
def test_bad_lab_toml_is_refused_without_a_trace(lab: Path, edit: tuple[str, str], expected: str):
    (lab / "lab.toml").write_text(VALID.replace(*edit))
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    assert str(lab / "lab.toml") in str(err.value) and expected in str(err.value)
    out = run_cli("--budget", "1gpuh", "--lab", str(lab))
    assert out.returncode == 2 and expected in out.stderr
    assert not (lab / "notebook.db").exists()


@pytest.mark.parametrize("budget", ["60", "-1gpuh", "abc", "0gpuh", "1.5 gpus", "1e3gpuh"])
def test_bad_budget_is_refused_with_the_accepted_forms(tmp_path: Path, budget: str):
    with pytest.raises(BudgetError, match="accepted forms"):
        parse_budget(budget)
    out = run_cli("--budget", budget, "--lab", str(tmp_path / "lab"))
    assert out.returncode == 2 and "accepted forms: GPU-hours like 60gpuh" in out.stderr
    assert not (tmp_path / "lab").exists()


@pytest.mark.parametrize(("text", "hours"), [("60gpuh", 60.0), ("0.5gpuh", 0.5), ("90gpum", 1.5)])
def test_budget_forms(text: str, hours: float):
    assert parse_budget(text) == hours


def test_duplicate_session_is_refused_and_adds_nothing(lab: Path):
    assert run_cli("--budget", "1gpuh", "--lab", str(lab), "--session", "a").returncode == 0
    before = (lab / "notebook.db").read_bytes()
    out = run_cli("--budget", "1gpuh", "--lab", str(lab), "--session", "a")
    assert out.returncode == 2 and "already exists" in out.stderr
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        assert len(nb.sessions()) == 1 and nb.verify().count == 2
    assert len(before) > 0


def test_flags_needing_a_lab_toml_are_refused(tmp_path: Path):
    out = run_cli("--budget", "1gpuh", "--lab", str(tmp_path / "lab"), "--executor", "slurm")
    assert out.returncode == 2 and "need a lab.toml" in out.stderr
    assert not (tmp_path / "lab").exists()
