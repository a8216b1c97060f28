"""Snapshots (TrainConfig.snapshot_steps): the model saved whole at intermediate steps, for trajectory selection.

A snapshot must be the model at its step: the same weights as the resume state of the same run stopped at that
step, loadable the way the final model is (weights, tokenizer and chat template), and saving it must not change
the run (same final weights as without snapshots, also across a preemption and resume).
"""

import json
import os
import signal

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from trainer_testkit import metric_series
from transformers import AutoModelForCausalLM, AutoTokenizer

from core import chat
from trainers import checkpoint, loop
from trainers.common import Preempted, RunPaths, load_policy
from trainers.sft import SFTConfig, train

SYSTEM = "Be brief."


def _config(model_dir, data, out, **kw) -> SFTConfig:
    base = dict(model_path=model_dir, data_path=data, output_dir=out, lr=1e-2, steps=6, batch_size=8,
                micro_batch_size=8, system_prompt=SYSTEM)
    return SFTConfig(**(base | kw))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)


def _weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(model_dir / "model.safetensors")


def _preempted_after(monkeypatch, step: int) -> None:
    """SIGUSR2 to this process during step `step` (as Slurm sends it): the run saves resume state there, stops."""
    real_step, calls = loop._one_step, []

    def step_then_signal(*args):
        out = real_step(*args)
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), signal.SIGUSR2)
        return out

    monkeypatch.setattr(loop, "_one_step", step_then_signal)


def _resume_weights(config: SFTConfig) -> dict[str, torch.Tensor]:
    """The weights held in a stopped run's resume state, loaded by the loop's own resume code."""
    model = load_policy(config.model_path, "float32", None, config.seed)
    optimizer, scheduler = loop.make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay,
                                               warmup_steps=config.warmup_steps, steps=config.steps,
                                               schedule=config.schedule, min_lr_ratio=config.min_lr_ratio)
    loop.load_resume(RunPaths(root=config.output_dir), model, optimizer, scheduler, config.seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_snapshot_is_the_model_at_its_step_and_changes_nothing(model_dirs, sft_data, tmp_path, monkeypatch):
    llama = model_dirs["llama"]
    straight = _config(llama, sft_data, tmp_path / "straight", snapshot_steps=[2, 4])
    # A snapshot write killed earlier left its temporary directory behind: the run replaces it.
    (tmp_path / "straight" / "snapshots" / "step-2.tmp").mkdir(parents=True)
    (tmp_path / "straight" / "snapshots" / "step-2.tmp" / "model.safetensors").write_text("half written")
    done = train(straight)
    assert [(s.step, s.model_dir.name) for s in done.snapshots] == [(2, "step-2"), (4, "step-4")]
    assert sorted(p.name for p in (tmp_path / "straight" / "snapshots").iterdir()) == ["step-2", "step-4"]

    # Loadable like the final model, with the template its rows were rendered with; and really intermediate.
    for snap in done.snapshots:
        AutoModelForCausalLM.from_pretrained(snap.model_dir)
        assert AutoTokenizer.from_pretrained(snap.model_dir).chat_template == chat.CHATML_TEMPLATE  # the base's own
    w2, w4, final = _weights(done.snapshots[0].model_dir), _weights(done.snapshots[1].model_dir), _weights(done.model_dir)
    assert not torch.equal(w2["lm_head.weight"], w4["lm_head.weight"])
    assert not torch.equal(w4["lm_head.weight"], final["lm_head.weight"])
    # The learning rate so far: the metrics' per-step rates summed up to the snapshot's step.
    lrs = metric_series(tmp_path / "straight", "lr")
    assert done.snapshots[1].lr == pytest.approx(lrs[3]) and done.snapshots[1].lr_sum == pytest.approx(sum(lrs[:4]))
    assert done.snapshots[1].loss == pytest.approx(metric_series(tmp_path / "straight")[3])

    # The same run stopped at step 2: its resume state holds the snapshot's weights; resumed, it writes the
    # later snapshot and ends on the same weights.
    stopped = _config(llama, sft_data, tmp_path / "stopped", snapshot_steps=[2, 4])
    _preempted_after(monkeypatch, 2)
    with pytest.raises(Preempted, match=r"^preempted: step 2:"):
        train(stopped)
    monkeypatch.undo()
    assert (tmp_path / "stopped" / "snapshots" / "step-2" / checkpoint.SNAPSHOT_INFO).is_file()
    assert not (tmp_path / "stopped" / "snapshots" / "step-4").exists()
    _same(_resume_weights(stopped), w2)
    resumed = train(stopped)
    assert resumed.resumed_at_steps == [2]
    _same(_weights(resumed.snapshots[0].model_dir), w2)
    _same(_weights(resumed.snapshots[1].model_dir), w4)
    _same(_weights(resumed.model_dir), final)
    assert resumed.snapshots[1].lr_sum == pytest.approx(done.snapshots[1].lr_sum)

    # Without snapshots the run ends on the same weights: saving them draws no randomness, moves nothing.
    plain = train(_config(llama, sft_data, tmp_path / "plain"))
    assert plain.snapshots == []
    _same(_weights(plain.model_dir), final)
    stored = json.loads((tmp_path / "straight" / "result.json").read_text())
    assert [s["step"] for s in stored["snapshots"]] == [2, 4]


@pytest.mark.parametrize("steps", [[6], [0], [4, 2], [2, 2]])
def test_snapshot_steps_must_increase_below_the_run_length(model_dirs, sft_data, tmp_path, steps):
    with pytest.raises(ValidationError, match=r"snapshot_steps \(.*\) must increase and lie between 0 and steps \(6\)"):
        _config(model_dirs["llama"], sft_data, tmp_path / "run", snapshot_steps=steps)
