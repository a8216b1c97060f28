"""[train] of lab.toml is read strictly, like the rest: a value of the wrong type, out of its range, an unknown key
or a verifier that is no verifying suite is refused at load with the key named, and at the CLI with exit 2 and no
notebook. A valid [train] is settled per family (tests/tools/test_train_lora.py follows it into the train tool)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import LabConfigError, load_lab_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hostile"))
from hostile_kit import LAB_TOML, REPO, make_lab  # noqa: E402


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    return make_lab(tmp_path)


def _with(lab: Path, train: str) -> None:
    (lab / "lab.toml").write_text(LAB_TOML + "\n" + train)


def test_a_valid_train_section_reaches_the_tools(lab: Path):
    _with(lab, '[train]\nmethod = "lora"\nlr_range = [1e-5, 1e-3]\n[train.lora]\nr = 32\nfp32_head = true\n'
               '[train.dpo]\nlr = 2e-5\nbeta = 0.2\n[train.rft]\nk = 8\nverifiers = ["math"]\n')
    config = load_lab_config(lab)
    recipe = config.train_recipe()
    assert recipe.families["sft"].method == "lora" and recipe.families["sft"].lora.r == 32
    assert (recipe.families["dpo"].lr, recipe.families["dpo"].beta, recipe.families["rft"].k) == (2e-5, 0.2, 8)
    assert recipe.families["rft"].verifiers == ["math"]
    assert config.model_dump(mode="json")["train"]["lora"]["r"] == 32  # the session's config snapshot holds it


@pytest.mark.parametrize(("train", "expected"), [
    ('[train]\nlr = "1e-4"\n', "train.lr: Input should be a valid number (got '1e-4')"),
    ("[train]\nsteps = true\n", "train.steps: Input should be a valid integer (got True)"),
    ('[train]\nmethod = "qlora"\n', "train.method: Input should be 'full' or 'lora' (got 'qlora')"),
    ("[train.dpo]\nbetta = 0.1\n", "train.dpo.betta: unknown key"),
    ("[train.lora]\nr = 0\n", "train.lora.r: Input should be greater than or equal to 1 (got 0)"),
    ("[train.sft]\nlr = 0.5\nlr_range = [1e-6, 1e-4]\n", "train.sft: lr = 0.5 is outside lr_range [1e-06, 0.0001]"),
    ("[train]\nlr_range = [1e-6]\n", "train.lr_range: List should have at least 2 items"),
    ("[train]\nlr = -1e-4\n", "train.lr: Input should be greater than 0"),
    ("[train.klce]\nkl_coef = 0.5\nkl_coef_range = [0.0, 0.2]\n", "train.klce: kl_coef = 0.5 is outside kl_coef_range"),
    ('[train.rft]\nverifiers = ["nope"]\n', "train.rft.verifiers: 'nope' cannot verify RFT samples (no [[evals]] suite"),
    ("[train]\nlr_range = [1e-6, 1e-5]\n[train.sft]\nlr = 1e-3\n", "train.sft: lr = 0.001 (lab.toml [train.sft]) is "
                                                                   "outside lr_range [1e-06, 1e-05] (lab.toml [train])"),
])
def test_bad_train_values_are_refused_naming_the_key(lab: Path, train: str, expected: str):
    _with(lab, train)
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    assert str(lab / "lab.toml") in str(err.value) and expected in str(err.value)


def test_a_bad_train_value_at_the_cli_exits_2_and_writes_nothing(lab: Path):
    _with(lab, "[train.sft]\nlr = 0.5\nlr_range = [1e-6, 1e-4]\n")
    out = subprocess.run([sys.executable, "run_agent.py", "--budget", "1gpuh", "--lab", str(lab)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "train.sft: lr = 0.5 is outside lr_range" in out.stderr
    assert "Traceback" not in out.stderr and not (lab / "notebook.db").exists()
