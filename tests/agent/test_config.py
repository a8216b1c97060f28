"""lab.toml and --budget: valid input loads; each class of bad input gets its own message, exit 2, no notebook.
The hostile corpus (tests/hostile/) adds many more inputs per class; this file keeps the format's own cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import (
    MAX_BUDGET_GPUH,
    MIN_BUDGET_GPUH,
    BudgetError,
    LabConfigError,
    load_lab_config,
    parse_budget,
)
from agent.inputs import check_inputs

# The valid lab to break is shared with the hostile-input corpus (tests/hostile/hostile_kit.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hostile"))
from hostile_kit import LAB_TOML, REPO, make_lab  # noqa: E402


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    return make_lab(tmp_path)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    # The lab's openai planner reads its key from OPENAI_API_KEY: set, as a session needs it (agent/inputs.py).
    env = {**os.environ, "OPENAI_API_KEY": "test-planner-key"}
    return subprocess.run([sys.executable, "run_agent.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)


def test_valid_lab_loads_and_its_inputs_check_out(lab: Path):
    cfg = load_lab_config(lab)
    assert cfg.model.base == lab / "models/base"
    assert cfg.executor.slurm.gpus_per_node == 4 and cfg.planner.kind == "openai"
    assert cfg.executor.slurm.extra_sbatch == ["--exclusive", "#SBATCH --constraint=h100"]
    assert [e.name for e in cfg.evals] == ["math", "confirm"] and cfg.evals[1].sealed
    decoding = cfg.serving.served_decoding(stop_token_ids=(2,))
    assert decoding.system_prompt == "You are a careful assistant." and decoding.temperature == 0.7
    assert check_inputs(cfg) == []
    # The snapshot a session stores is plain JSON (what the notebook's config column holds).
    assert cfg.model_dump(mode="json")["executor"]["slurm"]["partition"] == "gpu"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("[judge]", "[judge]\ncolour = 'red'"), "judge.colour: unknown key"),
        (("gpus_per_node = 4", "gpus_per_node = 'four'"), "executor.slurm.gpus_per_node: Input should be a valid integer"),
        (('"data/math.jsonl"', '"data/nope.jsonl"'), "evals[0].file: path 'data/nope.jsonl' does not exist"),
        (('kind = "slurm"', 'kind = "k8s"'), "executor.kind: Input should be 'local' or 'slurm' (got 'k8s')"),
        (("dev_fraction = 0.2", "dev_fraction = 0.2\nsealed = 3"), "feedback.sealed: unknown key"),
        (('base_url = "http://127.0.0.1:8000/v1"', ""), "planner: kind = 'openai' needs `base_url` and `model`"),
        (("[planner]", "[planner\n"), "not valid TOML"),
        (('model = "planner-1"', 'model = "planner-1"\napi_key = "sk-123"'), "planner.api_key: secrets never go in lab.toml"),
        (("time_limit_min = 120", "time_limit_min = true"), "executor.time_limit_min: Input should be a valid integer (got True)"),
        (("temperature = 0.7", 'temperature = "0.7"'), "serving.decoding.temperature: Input should be a valid number (got '0.7')"),
        (("sealed = true", 'sealed = "yes"'), "evals[1].sealed: Input should be a valid boolean (got 'yes')"),
        (('"models/parent"', '""'), "model.parent: expected a path, got an empty string"),
        (('file = "feedback.jsonl"', 'file = "data"'), "feedback.file: path 'data' is a directory, not a file"),
        (('base = "models/base"', 'base = "feedback.jsonl"'), "model.base: path 'feedback.jsonl' is not a directory"),
        (('parent = "models/parent"', 'parent = "data"'), "model.parent: path 'data' is no model directory: its config.json does not exist"),
    ],
)
def test_bad_lab_toml_is_refused_with_the_key(lab: Path, edit: tuple[str, str], expected: str):
    (lab / "lab.toml").write_text(LAB_TOML.replace(*edit))
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    assert str(lab / "lab.toml") in str(err.value) and expected in str(err.value)


def test_bad_lab_toml_at_the_cli_exits_2_and_writes_nothing(lab: Path):
    (lab / "lab.toml").write_text(LAB_TOML.replace("time_limit_min = 120", "time_limit_min = true"))
    out = run_cli("--budget", "1gpuh", "--lab", str(lab))
    assert out.returncode == 2 and "executor.time_limit_min" in out.stderr and "Traceback" not in out.stderr
    assert not (lab / "notebook.db").exists()


def test_a_model_without_a_tokenizer_is_refused_unless_one_is_named(lab: Path):
    (lab / "models/base/tokenizer.json").unlink()
    with pytest.raises(LabConfigError, match=r"model: base: .* holds no tokenizer"):
        load_lab_config(lab)
    (lab / "tok").mkdir()
    (lab / "tok/tokenizer_config.json").write_text("{}")
    (lab / "lab.toml").write_text(LAB_TOML.replace('parent = "models/parent"', 'parent = "models/parent"\ntokenizer = "tok"'))
    assert load_lab_config(lab).model.tokenizer == lab / "tok"


@pytest.mark.parametrize("budget", ["60", "-1gpuh", "abc", "1.5 gpus", "1e3gpuh", "٦٠gpuh", "60gpuh\n", " 60gpuh"])
def test_bad_budget_forms_are_refused(budget: str):
    with pytest.raises(BudgetError, match="accepted forms"):
        parse_budget(budget)


@pytest.mark.parametrize("budget", ["0gpuh", "0.001gpuh", "0gpum", "1000001gpuh", "9999999gpuh"])
def test_budget_outside_the_range_is_refused_with_the_range(budget: str):
    with pytest.raises(BudgetError, match=r"at least 1gpum \(0\.0167 GPU-hours\), at most 1000000gpuh"):
        parse_budget(budget)


@pytest.mark.parametrize(("text", "hours"), [("60gpuh", 60.0), ("0.5gpuh", 0.5), ("90gpum", 1.5), ("1gpum", 1 / 60),
                                             ("1000000gpuh", 1e6)])
def test_budget_forms(text: str, hours: float):
    assert parse_budget(text) == pytest.approx(hours)
    assert MIN_BUDGET_GPUH <= parse_budget(text) <= MAX_BUDGET_GPUH


def test_flags_needing_a_lab_toml_are_refused(tmp_path: Path):
    out = run_cli("--budget", "1gpuh", "--lab", str(tmp_path / "lab"), "--executor", "slurm")
    assert out.returncode == 2 and "need a lab.toml" in out.stderr
    assert not (tmp_path / "lab").exists()


def test_duplicate_session_is_refused_and_adds_nothing(lab: Path):
    from memory.notebook import Notebook

    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("a", lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.05, planner="openai", executor="slurm",
                        config=load_lab_config(lab).model_dump(mode="json"))
        count = nb.verify().count
    out = run_cli("--budget", "1gpuh", "--lab", str(lab), "--session", "a")
    assert out.returncode == 2 and "session 'a' already exists" in out.stderr and "Traceback" not in out.stderr
    with Notebook.open(lab / "notebook.db", readonly=True) as nb:
        assert [s.name for s in nb.sessions()] == ["a"] and nb.verify().count == count


def test_constraint_mode_is_for_constraints_suites_only(lab: Path):
    toml = (lab / "lab.toml").read_text()
    (lab / "lab.toml").write_text(toml.replace('scorer = "math"', 'scorer = "math"\nconstraint_mode = "ifeval"', 1))
    with pytest.raises(LabConfigError, match=r"evals\[0\].*constraint_mode applies to constraints suites only"):
        load_lab_config(lab)
    (lab / "lab.toml").write_text(toml.replace('scorer = "math"', 'scorer = "math"\nconstraint_mode = "strict"', 1))
    with pytest.raises(LabConfigError, match=r"evals\[0\]\.constraint_mode"):
        load_lab_config(lab)


def test_constraint_mode_reaches_the_eval_job(lab: Path):
    from agent.runner import lab_spec

    write = sys.modules["hostile_kit"].write_jsonl
    write(lab / "data/if.jsonl", [{"id": "i1", "messages": [{"role": "user", "content": "Answer in lowercase."}],
                                   "constraints": [{"type": "lowercase"}]}])
    toml = (lab / "lab.toml").read_text()
    (lab / "lab.toml").write_text(toml + '\n[[evals]]\nname = "ifeval"\nscorer = "constraints"\n'
                                  'file = "data/if.jsonl"\nconstraint_mode = "ifeval"\n')
    from core.tiny import build_tokenizer

    config = load_lab_config(lab)
    build_tokenizer(config.model.tokenizer or config.model.parent or config.model.base)  # lab_spec reads its stop id
    suite = lab_spec(config).suite("ifeval")
    assert (suite.scorer, suite.constraint_mode) == ("constraints", "ifeval")


# ---- pre-session checks of what the first jobs need (issue 43, item 4) -------------------------------------------

JUDGE = ('\n[judge]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "judge-1"\n'
         'api_key_env = "POSTLAB_TEST_JUDGE_KEY_UNSET"\n')


def _own_lab(tmp_path: Path, *, pad: bool = True, judge: bool = False) -> Path:
    """A non-toy lab (tests/agent/labkit.py), its tokenizer without a pad token (as Meta's Llama-3 ships) unless
    `pad`, and an OpenAI-compatible judge whose key variable is unset when `judge`."""
    from labkit import make_lab as make_own_lab

    lab = make_own_lab(tmp_path / "lab")
    if not pad:
        config = lab / "tokenizer" / "tokenizer_config.json"
        data = json.loads(config.read_text())
        data.pop("pad_token")
        config.write_text(json.dumps(data))
    if judge:
        with open(lab / "lab.toml", "a") as f:
            f.write(JUDGE)
    return lab


def test_a_tokenizer_without_a_pad_token_and_an_unset_judge_key_are_refused_before_a_session_opens(tmp_path: Path):
    lab = _own_lab(tmp_path, pad=False, judge=True)
    env = {k: v for k, v in os.environ.items() if k != "POSTLAB_TEST_JUDGE_KEY_UNSET"}
    out = subprocess.run([sys.executable, "run_agent.py", "--budget", "1gpuh", "--lab", str(lab), "--session", "x"],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "2 input file(s) do not check out; no session was opened" in out.stderr
    assert "the tokenizer has no pad token" in out.stderr and "<|finetune_right_pad_id|>" in out.stderr
    assert "[judge] api_key_env: the environment variable POSTLAB_TEST_JUDGE_KEY_UNSET is not set" in out.stderr
    assert not (lab / "notebook.db").exists() and not (lab / "jobs").exists()


def test_the_runtime_checks_pass_a_sound_lab_and_name_each_missing_key(tmp_path: Path):
    from agent.inputs import runtime_problems

    cfg = load_lab_config(_own_lab(tmp_path, judge=True))
    assert runtime_problems(cfg, {"POSTLAB_TEST_JUDGE_KEY_UNSET": "k-123456789"}, "playbook") == []
    (problem,) = runtime_problems(cfg, {"POSTLAB_TEST_JUDGE_KEY_UNSET": ""}, "playbook")  # empty is unset
    assert problem.startswith("[judge] api_key_env")
    # The planner's key is needed only when the session runs the openai planner.
    assert [p[:10] for p in runtime_problems(cfg, {"POSTLAB_TEST_JUDGE_KEY_UNSET": "k"}, "openai")] == ["[planner] "]


def test_a_mistyped_lab_is_refused_and_nothing_is_built(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch):
    import run_agent

    missing = tmp_path / "mylba"
    assert run_agent.main(["--budget", "1gpuh", "--lab", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--lab {missing}: no such directory" in err and "world build --lab" in err and err.count("\n") == 1
    assert not missing.exists()
    stray = tmp_path / "papers"
    stray.mkdir()
    (stray / "draft.txt").write_text("mine")
    assert run_agent.main(["--budget", "1gpuh", "--lab", str(stray)]) == 2
    assert "no lab.toml; refusing to build a toy world" in capsys.readouterr().err
    assert sorted(p.name for p in stray.iterdir()) == ["draft.txt"]
    # Without --lab the toy world is still the default, built in ./lab (here refused only because ./lab holds a file).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "x").write_text("")
    assert run_agent.main(["--budget", "1gpuh"]) == 2
    assert "lab: holds other files (x) and no lab.toml; refusing to build a toy world" in capsys.readouterr().err
