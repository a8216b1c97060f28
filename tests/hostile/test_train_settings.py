"""Hostile `[train]` settings (issue 44, item 1): values that cannot train are refused before a session opens, naming
the key and what was expected; exit 2, nothing written, no budget spent. What lab.toml alone decides is refused when
it loads (ranges, batch and micro-batch, target names); what needs the parent and the data (LoRA targets against the
parent's modules, max_len against the lab's prompts, the micro-batch against the data and the memory) with the
session's other inputs. No session runs: the checks are called as `run` calls them, and once through the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import LabConfigError, load_lab_config
from agent.inputs import require_inputs
from core import tiny

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import BATTLE, LAB_TOML, REPO, assert_refused, files, make_lab, run_cli, write_jsonl  # noqa: E402

LOCAL = LAB_TOML.replace('kind = "slurm"', 'kind = "local"')


@pytest.fixture(scope="module")
def parent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    return tiny.build_model("llama", tiny.build_tokenizer(root / "tok"), root / "llama")


@pytest.fixture
def lab(tmp_path: Path, parent: Path) -> Path:
    lab = make_lab(tmp_path / "lab")
    for d in ("models/base", "models/parent"):
        shutil.rmtree(lab / d)
        shutil.copytree(parent, lab / d)
    return lab


def _load_refused(lab: Path, train: str) -> str:
    (lab / "lab.toml").write_text(LOCAL + train)
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    return str(err.value)


def _inputs_refused(lab: Path, train: str, env: dict[str, str] | None = None) -> str:
    (lab / "lab.toml").write_text(LOCAL + train)
    cfg = load_lab_config(lab)
    with pytest.raises(LabConfigError) as err:
        require_inputs(cfg, lab / "lab.toml", env or {"CUDA_VISIBLE_DEVICES": ""}, "playbook", "local")
    return str(err.value)


@pytest.mark.parametrize(("train", "expected"), [
    ("[train]\nlr_range = [-1e-4, 1e-4]\n", "train.lr_range[0]: Input should be greater than 0"),
    ("[train]\nlr_range = [2e-4, 1e-5]\n", "lr_range [0.0002, 1e-05] must be [low, high] with low <= high"),
    ("[train]\nbatch_range = [0, 0]\n", "train.batch_range[0]: Input should be greater than or equal to 1"),
    ("[train]\nsteps_range = [0, 10]\n", "train.steps_range[0]: Input should be greater than or equal to 1"),
    ("[train.dpo]\nbeta_range = [-1.0, 0.5]\n", "train.dpo.beta_range[0]: Input should be greater than 0"),
    ("[train.dpo]\nnll_weight_range = [-2.0, 1.0]\n", "train.dpo.nll_weight_range[0]: Input should be greater than or equal to 0"),
    ("[train.klce]\nkl_coef_range = [0.5, -1.0]\n", "train.klce.kl_coef_range[1]: Input should be greater than or equal to 0"),
    ("[train.rft]\nk_range = [0, 4]\n", "train.rft.k_range[0]: Input should be greater than or equal to 1"),
    ("[train]\nbatch = 6\nmicro_batch = 4\n", "batch (6) must be a multiple of micro_batch (4)"),
    ("[train]\nbatch = 6\n[train.sft]\nmicro_batch = 4\n", "train.sft: batch (6) must be a multiple of micro_batch (4)"),
    ("[train]\nmicro_batch = 0\n", "train.micro_batch: Input should be greater than or equal to 1"),
    ('[train.lora]\ntarget_modules = [""]\n', "train.lora.target_modules[0]: String should match pattern"),
    ('[train.lora]\ntarget_modules = ["q_proj", "."]\n', "train.lora.target_modules[1]: String should match pattern"),
    ('[train.lora]\ntarget_parameters = ["experts."]\n', "train.lora.target_parameters[0]: String should match pattern"),
])
def test_a_value_lab_toml_alone_refuses_is_named_at_load(lab: Path, train: str, expected: str):
    message = _load_refused(lab, train)
    assert expected in message, message
    assert "Traceback" not in message


@pytest.mark.parametrize(("train", "expected"), [
    ('[train]\nmethod = "lora"\n[train.lora]\ntarget_modules = ["qkv"]\n',
     "train.lora.target_modules[0] = 'qkv' matches no module of the parent; expected a suffix of a linear module's "
     "name: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    ('[train]\nmethod = "lora"\n[train.lora]\nr = 4096\ntarget_modules = ["embed_tokens", "input_layernorm"]\n',
     "train.lora.target_modules[0] = 'embed_tokens' matches 1 module(s) LoRA cannot adapt (Embedding"),
    ('[train]\nmethod = "lora"\n[train.lora]\ntarget_modules = ["input_layernorm"]\n',
     "train.lora.target_modules[0] = 'input_layernorm' matches 2 module(s) LoRA cannot adapt (LlamaRMSNorm"),
    ('[train]\nmethod = "lora"\n[train.lora]\ntarget_modules = ["layers"]\n', "'layers' matches 1 module(s) LoRA cannot adapt (ModuleList"),
    ('[train.dpo]\nmethod = "lora"\n[train.dpo.lora]\ntarget_parameters = ["mixer.experts.up_proj"]\n',
     "train.dpo.lora.target_parameters[0] = 'mixer.experts.up_proj' matches no parameter of the parent; expected a "
     "suffix of a 3-D weight's name: none (this model has no 3-D weights)"),
    ('[train]\nmethod = "lora"\n[train.lora]\ntarget_parameters = ["input_layernorm.weight"]\n',
     "'input_layernorm.weight' matches 2 parameter(s) that are no weight matrix"),
    ("[train]\nmax_len = 9\n", "train.max_len: 9 tokens leaves no room for an answer: the longest prompt of the lab's "
                               "feedback is 11 tokens; expected at least 27"),
    ("[train.sft]\nbatch = 1073741824\nmicro_batch = 1073741824\n", "train.sft.micro_batch: 1073741824 sequences per forward pass is more "
                                                "than the lab's data holds (11 rows"),
])
def test_a_value_the_parent_or_the_data_refuses_is_named_before_the_session(lab: Path, train: str, expected: str):
    message = _inputs_refused(lab, train)
    assert expected in message, message
    assert message.count(expected.split(":")[0]) == 1, message  # inherited by four families, named once


@pytest.mark.parametrize("gib", [1.5, 80.0])
def test_a_micro_batch_past_one_gpu_is_refused_by_the_estimate(lab: Path, gib: float):
    """Against [executor] gpu_memory_gib (on a GPU host without it, the GPU nvidia-smi shows): the tiny parent's
    step needs the estimate's 2 GiB CUDA reserve alone, so 1.5 GiB is refused and 80 GiB is not."""
    (lab / "lab.toml").write_text(LOCAL.replace("time_limit_min = 120", f"time_limit_min = 120\ngpu_memory_gib = {gib}")
                                  + "[train]\nmicro_batch = 2\nbatch = 4\nmax_len = 512\n")
    cfg = load_lab_config(lab)
    if gib > 2:
        require_inputs(cfg, lab / "lab.toml", {"CUDA_VISIBLE_DEVICES": ""}, "playbook", "local")
        return
    with pytest.raises(LabConfigError) as err:
        require_inputs(cfg, lab / "lab.toml", {"CUDA_VISIBLE_DEVICES": ""}, "playbook", "local")
    assert ("train.micro_batch and train.max_len: a step at micro_batch 2 x 512 tokens is estimated at 2.0 GiB (sft), "
            "2.0 GiB (dpo), 2.0 GiB (klce), 2.0 GiB (rft), more than one GPU has (1.5 GiB)") in str(err.value), err.value


def _battles(prompts: list[int], answers: list[int]) -> list[dict]:
    """Battles whose prompt and answers are that many words (a word is a token of the tiny tokenizer)."""
    votes = ["own", "other", "tie", "both_bad"]
    return [BATTLE | {"id": f"b{i}", "messages": [{"role": "user", "content": f"q{i} " + "word " * p}],
                      "own": "yes " * a, "other": "no " * a, "vote": votes[i % 4]}
            for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]


@pytest.mark.parametrize(("prompts", "answers", "max_len", "expected"), [
    # Above every prompt but the longest: that battle's row would be cut within its prompt (the trainer refuses the
    # job), so the longest prompt and ANSWER_ROOM tokens are asked for.
    ([5] * 9 + [200], [3] * 10, 128, "train.max_len: 128 tokens leaves no room for an answer: the longest prompt of "
                                     "the lab's feedback is 211 tokens; expected at least 227, that prompt and 16 "
                                     "answer tokens"),
    # Room after every prompt, but most answers cut before their end.
    ([5] * 10, [300] * 7 + [3] * 3, 64, "train.max_len: 64 tokens cuts the answer of 7 of the lab's 10 feedback battles "
                                        "(the prompt and the longer answer) before its end; expected at least 326, the "
                                        "length at which half of them fit whole"),
])
def test_a_max_len_without_room_for_the_lab_s_answers_is_refused(lab: Path, prompts, answers, max_len: int,
                                                                 expected: str):
    write_jsonl(lab / "feedback.jsonl", _battles(prompts, answers))
    message = _inputs_refused(lab, f"[train]\nmax_len = {max_len}\n")
    assert expected in message, message
    assert message.count("train.max_len") == 1, message  # inherited by four families, named once


def test_a_max_len_that_fits_half_the_rows_whole_passes(lab: Path):
    write_jsonl(lab / "feedback.jsonl", _battles([5] * 10, [300] * 5 + [3] * 5))
    (lab / "lab.toml").write_text(LOCAL + "[train]\nmax_len = 64\n")
    require_inputs(load_lab_config(lab), lab / "lab.toml", {"CUDA_VISIBLE_DEVICES": ""}, "playbook", "local")


def test_a_micro_batch_past_this_host_s_memory_is_refused_at_the_cli(lab: Path, monkeypatch: pytest.MonkeyPatch):
    """On a host without a GPU (CUDA_VISIBLE_DEVICES empty), local jobs train on the CPU: the estimate is held against
    this host's memory. The parent states a context of 2**22 tokens, so a written micro_batch of that many rows
    (each at least 17 GiB of activations by the estimate: 34 bytes x hidden 64 x 2 layers a token) passes it; the
    lab gets as many [[data]] rows, so the micro_batch is no larger than its data."""
    from core.tiny import HIDDEN
    from tools.jobs.executor import host_memory_gb

    context = 1 << 22
    for d in ("models/base", "models/parent"):
        config = json.loads((lab / d / "config.json").read_text())
        (lab / d / "config.json").write_text(json.dumps(config | {"max_position_embeddings": context}))
    micro = int(host_memory_gb() * 1024**3 // (34 * HIDDEN * 2 * context)) + 2
    write_jsonl(lab / "data/replay.jsonl", [{"messages": [{"role": "user", "content": f"hi {i}"},
                                                          {"role": "assistant", "content": "hello"}]}
                                            for i in range(micro)])
    (lab / "lab.toml").write_text(LOCAL + f"[train]\nbatch = {micro}\nmicro_batch = {micro}\nmax_len = {context}\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    before = files(lab)
    [done] = run_cli([["--budget", "1gpuh", "--lab", str(lab), "--planner", "playbook"]])
    assert_refused(done.returncode, done.stderr, str(lab / "lab.toml"), "no session was opened",
                   f"train.micro_batch and train.max_len: a step at micro_batch {micro} x {context} tokens is estimated "
                   "at ", "more than this host's memory (no GPU: local jobs train on the CPU) has")
    assert done.stderr.count("train.micro_batch") == 1, done.stderr  # inherited by four families, named once
    assert files(lab) == before and not (lab / "notebook.db").exists()


def test_the_estimate_builds_no_adapter_in_the_agent_process(parent: Path):
    """The launcher's admission and this check estimate LoRA's memory from shapes: peft is never imported."""
    code = ("import sys; from pathlib import Path; from trainers.common import LoRASettings; "
            "from trainers.memory import model_shape; "
            f"s = model_shape(Path({str(parent)!r}), LoRASettings(r=4096, target_modules=['q_proj'])); "
            "assert s.trainable_params > 0; "
            "print('peft' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_defaults_and_sound_values_pass(lab: Path):
    (lab / "lab.toml").write_text(LOCAL + '[train]\nmethod = "lora"\nbatch = 8\nmicro_batch = 2\nmax_len = 256\n'
                                  '[train.lora]\ntarget_modules = ["q_proj", "self_attn.v_proj"]\n')
    require_inputs(load_lab_config(lab), lab / "lab.toml", {"CUDA_VISIBLE_DEVICES": ""}, "playbook", "local")


def test_the_cli_refuses_with_exit_2_and_writes_nothing(lab: Path):
    (lab / "lab.toml").write_text(LOCAL + '[train]\nmethod = "lora"\n[train.lora]\nr = 4096\n'
                                  'target_modules = ["embed_tokens", "norm"]\n')
    before = files(lab)
    [done] = run_cli([["--budget", "1gpuh", "--lab", str(lab), "--planner", "playbook"]])
    assert_refused(done.returncode, done.stderr, str(lab / "lab.toml"), "train.lora.target_modules[0] = 'embed_tokens'",
                   "train.lora.target_modules[1] = 'norm'")
    assert files(lab) == before


def test_a_job_refusing_its_settings_is_a_refusal_of_the_arm(tmp_path: Path):
    """Item 2: a [train] value found only by the trainer (here LoRA targets the lab's checks never saw: the runtime
    is built without them) fails its job as class config, and the tool records a refusal of that arm, not an error."""
    from agent import toolbox
    from agent.planners.playbook import PlaybookSettings
    from agent.runner import _runtime
    from memory.notebook import Notebook
    from tools.data.datasets import WinnerSFTConfig, build_winner_sft, record_dataset
    from tools.data.splits import SplitConfig, ingest_feedback
    from tools.promote import start_incumbent

    sys.path.insert(0, str(REPO / "tests" / "agent"))
    from labkit import SYSTEM
    from labkit import make_lab as make_agent_lab

    lab = make_agent_lab(tmp_path / "lab")
    with open(lab / "lab.toml", "a") as f:
        f.write('\n[train.lora]\nr = 4\ntarget_modules = ["qkv"]\n')
    config = load_lab_config(lab)
    nb = Notebook.open(lab / "notebook.db")
    nb.open_session("s1", lab=str(lab), budget_gpuh=10.0, reserve_gpuh=0.5, planner="playbook", executor="local",
                    config={})
    rt = _runtime(nb, "s1", lab, config, config.executor, PlaybookSettings.test(), "playbook", True)
    parent = start_incumbent(rt.ctx)
    split, _ = ingest_feedback(nb, lab / "feedback.jsonl", SplitConfig(dev_fraction=0.2, sealed_fraction=0.1),
                               lab / "splits", session="s1")
    manifest = build_winner_sft(WinnerSFTConfig(out=lab / "data" / "winner.jsonl", tokenizer=lab / "tokenizer",
                                                feedback=lab / "feedback.jsonl", split=split, system_prompt=SYSTEM))
    dataset = record_dataset(nb, manifest, session="s1").id
    args = {"trainer": "sft", "parent": parent, "dataset": dataset, "method": "lora", "steps": 2, "batch_size": 2}
    outcome = toolbox.run(rt.ctx, "train", toolbox.args_model("train").model_validate(args), None)
    assert outcome.status == "refused", outcome
    assert "refused its settings before training (class config" in outcome.summary
    assert "lora.target_modules: 'qkv' matches no module" in outcome.detail  # the trainer's own words, for a person
    [job] = nb.jobs()
    assert job.failure_class == "config"
    [refusal] = nb.decisions("s1", kind="refuse")
    assert refusal.payload.tool == "train" and refusal.payload.args["method"] == "lora"
    nb.close()


@pytest.mark.parametrize("target", ["embed_tokens", "norm", ""])
def test_the_trainer_refuses_targets_lora_does_not_adapt(parent: Path, target: str):
    """The job's own check (a lab.toml changed after its checks, a resumed session) refuses what the load check does."""
    from trainers.common import ConfigError, LoRASettings, check_lora_targets

    with pytest.raises(ConfigError, match="only linear projections are adapted"):
        check_lora_targets(parent, LoRASettings(r=4, target_modules=[target]))
