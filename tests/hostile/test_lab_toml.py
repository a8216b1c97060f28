"""Hostile lab.toml files (issue 10, item 2): strict types, paths checked for what they must be,
unreadable files refused, secrets refused without being echoed, Slurm values that could add their
own #SBATCH line refused at load, deep nesting refused. Each: LabConfigError naming the key, and
at the CLI exit 2, no traceback and no file written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from agent.config import LabConfigError, load_lab_config

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import LAB_TOML, assert_refused, files, make_lab, run_cli  # noqa: E402

SK = "sk-proj-" + "Ab3" * 8
EDITS = {
    # strict types: no coercion
    "bool as int": (("time_limit_min = 120", "time_limit_min = true"), "executor.time_limit_min: Input should be a valid integer (got True)"),
    "string as float": (("dev_fraction = 0.2", 'dev_fraction = "0.1"'), "feedback.dev_fraction: Input should be a valid number (got '0.1')"),
    "string as bool": (("sealed = true", 'sealed = "yes"'), "evals[1].sealed: Input should be a valid boolean (got 'yes')"),
    "float as int": (("gpus_per_node = 4", "gpus_per_node = 4.0"), "executor.slurm.gpus_per_node: Input should be a valid integer"),
    "int as string": (('partition = "gpu"', "partition = 7"), "executor.slurm.partition: Input should be a valid string"),
    "date as string": (('model = "planner-1"', "model = 1979-05-27"), "planner.model: Input should be a valid string"),
    "nan": (("temperature = 0.7", "temperature = nan"), "serving.decoding.temperature: nan is not a finite number"),
    "inf": (("time_limit_min = 120", "time_limit_min = 120\nsimulated_gpuh_per_device_s = inf"),
            "executor.simulated_gpuh_per_device_s: inf is not a finite number"),
    "int past Python's limit": (("time_limit_min = 120", "time_limit_min = " + "9" * 5000), "not valid TOML: Exceeds the limit (4300 digits)"),
    "int past 64 bits": (("max_new_tokens = 256", "max_new_tokens = 99999999999999999999"),
                         "serving.decoding.max_new_tokens: an integer of 20 digits is out of range (TOML integers are 64-bit)"),
    # paths are what they must be
    "empty path": (('file = "feedback.jsonl"', 'file = ""'), "feedback.file: expected a path, got an empty string"),
    "directory as file": (('system_prompt_file = "system.txt"', 'system_prompt_file = "models"'),
                          "serving.system_prompt_file: path 'models' is a directory, not a file"),
    "system prompt not UTF-8": (('system_prompt_file = "system.txt"', 'system_prompt_file = "models/base/latin1.txt"'),
                                "serving.system_prompt_file: path 'models/base/latin1.txt': line 1 is not valid UTF-8 (byte 0xee)"),
    "file as model dir": (('base = "models/base"', 'base = "bars.toml"'), "model.base: path 'bars.toml' is not a directory"),
    "dir without config": (('parent = "models/parent"', 'parent = "data"'), "model.parent: path 'data' is no model directory"),
    "path as a number": (('bars = "bars.toml"', "bars = 3"), "bars: expected a path string, got int"),
    # secrets: refused, never echoed
    "key in api_key_env": (('model = "planner-1"', f'model = "planner-1"\napi_key_env = "{SK}"'),
                           "planner.api_key_env: the value looks like an API key (sk-...) (not shown)"),
    "password in base_url": (('base_url = "http://127.0.0.1:8000/v1"', 'base_url = "http://me:hunter2pass@127.0.0.1:8000/v1"'),
                             "planner.base_url: the value looks like credentials inside a URL (user:password@) (not shown)"),
    "token in any field": (('sealed_fraction = 0.2', 'sealed_fraction = 0.2\nstratify_by = "ghp_' + "x1" * 12 + '"'),
                           "feedback.stratify_by: the value looks like a GitHub token (not shown)"),
    "bearer in model": (('model = "planner-1"', 'model = "Bearer abcdefgh12345678"'), "planner.model: the value looks like a bearer token"),
    "aws key in account": (('partition = "gpu"', 'partition = "gpu"\naccount = "AKIAABCDEFGHIJKLMNOP"'),
                           "executor.slurm.account: the value looks like an AWS access key"),
    "secret as a key": (("[judge]", f'[judge]\n"{SK}" = 1'), "judge: a key looks like an API key (sk-...)"),
    "slack token in sbatch": (('"--exclusive"', '"--comment=xoxb-1234567890-abcdef"'), "executor.slurm.extra_sbatch[0]: the value looks like a Slack token"),
    # Slurm values cannot add #SBATCH lines
    "newline in partition": (('partition = "gpu"', 'partition = "gpu\\n#SBATCH --account=theirs"'), "executor.slurm.partition: 'gpu\\n#SBATCH --account=theirs' is not a Slurm name"),
    "space in qos": (('partition = "gpu"', 'partition = "gpu"\nqos = "high --mem=0"'), "executor.slurm.qos: 'high --mem=0' is not a Slurm name"),
    "newline in sbatch": (('"--exclusive"', '"--exclusive\\n#SBATCH --wrap=sh"'), "executor.slurm.extra_sbatch[0]: '--exclusive\\n#SBATCH --wrap=sh' is not one long option"),
    "short option": (('"--exclusive"', '"-p other"'), "executor.slurm.extra_sbatch[0]: '-p other' is not one long option"),
    "reserved option": (('"--exclusive"', '"--time=99999"'), "executor.slurm.extra_sbatch[0]: '--time=99999': --time is set by the launcher"),
    "output moved": (('"--exclusive"', '"--output=/tmp/x"'), "--output is set by the launcher"),
    "option twice": (('"--exclusive"', '"--constraint=a100"'), "executor.slurm.extra_sbatch: option --constraint is given twice"),
    # per-kind resources (issue 30)
    "resource gpus as string": (("[planner]", '[executor.resources.eval]\ngpus = "1"\n\n[planner]'),
                                "executor.resources.eval.gpus: Input should be a valid integer"),
    "unknown resource kind": (("[planner]", "[executor.resources.gpu]\ngpus = 1\n\n[planner]"),
                              "executor.resources.gpu: unknown key"),
    "unknown resource key": (("[planner]", "[executor.resources.train]\ngpu = 2\n\n[planner]"),
                             "executor.resources.train.gpu: unknown key"),
    "negative gpus": (("[planner]", "[executor.resources.merge]\ngpus = -1\n\n[planner]"),
                      "executor.resources.merge.gpus: Input should be greater than or equal to 0"),
    "multi-node eval": (("[planner]", "[executor.resources.eval]\nnodes = 2\n\n[planner]"),
                        "resources.eval.nodes > 1: only training jobs run on several nodes"),
    # nesting and names
    "deep nesting": (("[judge]", "[judge]\nx = " + "[" * 12 + "1" + "]" * 12), "judge.x[0][0][0][0][0][0]: nested more than 8 levels deep"),
    "bad suite name": (('name = "math"', 'name = "../math"'), "evals[0].name: '../math' is not a name"),
    "env name with spaces": (('model = "planner-1"', 'model = "planner-1"\napi_key_env = "MY KEY"'),
                             "planner.api_key_env: expected the NAME of an environment variable"),
    "not a URL": (('base_url = "http://127.0.0.1:8000/v1"', 'base_url = "file:///etc/passwd"'), "planner.base_url: expected an http:// or https:// URL"),
}


@pytest.fixture
def lab(tmp_path: Path) -> Path:
    return make_lab(tmp_path / "lab")


@pytest.mark.parametrize("case", sorted(EDITS))
def test_hostile_lab_toml_is_refused_naming_the_key(lab: Path, case: str):
    (old, new), expected = EDITS[case]
    assert old in LAB_TOML
    (lab / "lab.toml").write_text(LAB_TOML.replace(old, new, 1))
    (lab / "models/base/latin1.txt").write_bytes("Soyez bref, s'il vous pla\u00eet. Caf\u00e9".encode("latin-1"))
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    assert str(err.value).startswith(str(lab / "lab.toml")) and expected in str(err.value), str(err.value)
    for secret in (SK, "hunter2pass", "x1x1x1", "abcdefgh12345678", "AKIAABCDEFGHIJKLMNOP", "xoxb-1234567890"):
        assert secret not in str(err.value)


def test_toml_nested_past_the_parser_stack_is_refused(lab: Path):
    (lab / "lab.toml").write_text(LAB_TOML + "\n[x]\ny = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(LabConfigError, match=r"lab.toml: (nested too deeply|.*nested more than 8 levels)"):
        load_lab_config(lab)


def _unreadable(lab: Path, how: str) -> str:
    toml = lab / "lab.toml"
    toml.unlink()
    if how == "directory":
        toml.mkdir()
        return "is a directory, not a file"
    if how == "dangling symlink":
        toml.symlink_to(lab / "gone.toml")
        return "is a dangling symbolic link"
    if how == "symlink loop":
        toml.symlink_to(toml)
        return "cannot be opened (Too many levels of symbolic links)"
    if how == "fifo":
        os.mkfifo(toml)
        return "is a named pipe (FIFO), not a file"
    toml.write_bytes(LAB_TOML.encode().replace(b'"gpu"', b'"gp\xfa"'))
    line = LAB_TOML[: LAB_TOML.index('"gpu"')].count("\n") + 1
    return f"line {line}: not valid UTF-8 (byte 0xfa)"


@pytest.mark.parametrize("how", ["directory", "dangling symlink", "symlink loop", "fifo", "latin-1"])
def test_unreadable_lab_toml_is_refused_never_taken_for_no_lab(lab: Path, how: str):
    expected = _unreadable(lab, how)
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    assert expected in str(err.value), str(err.value)


def test_cli_refuses_hostile_lab_toml_with_exit_2_and_writes_nothing(tmp_path: Path):
    labs = {name: make_lab(tmp_path / name.replace(" ", "_")) for name in ("bool as int", "password in base_url", "dangling", "newline in sbatch")}
    for name in ("bool as int", "password in base_url", "newline in sbatch"):
        (labs[name] / "lab.toml").write_text(LAB_TOML.replace(*EDITS[name][0], 1))
    expected = {name: EDITS[name][1] for name in EDITS if name in labs}
    expected["dangling"] = _unreadable(labs["dangling"], "dangling symlink")
    before = {name: files(lab) for name, lab in labs.items()}
    procs = run_cli([["--budget", "1gpuh", "--lab", str(lab)] for lab in labs.values()])
    for (name, lab), proc in zip(labs.items(), procs, strict=True):
        assert_refused(proc.returncode, proc.stderr, str(lab / "lab.toml"), expected[name])
        assert "hunter2pass" not in proc.stderr + proc.stdout
        assert files(lab) == before[name], name  # no notebook, no toy world built in its place
