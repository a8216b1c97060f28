"""The gates are pure: each refuses exactly its case, from the call, the summary, the forecast and the lab root."""

from __future__ import annotations

from pathlib import Path

from agent import gates
from agent.summary import Checkpoint, Dataset, Summary
from tests.agent.views import bar_verdict, bars, ledger, rule, verdict
from tests.agent.views import summary as make


def summary(**changes) -> Summary:
    """A session whose SFT arm (3) cleared the bars against the parent (1) and whose DPO arm (4) did not; `changes`
    overrides the view's budget, bars, incumbent and failed arms or the summary's other fields."""
    view = {k: changes.pop(k) for k in ("budget", "bars", "incumbent") if k in changes}
    return make(
        budget=view.get("budget", ledger(1.0, 0.2, 0.1, 0.05)),
        bars=view.get("bars", bars(rule("d", "correct", "delta", ">=", 0))), parent=1,
        incumbent=view.get("incumbent", 1), calibrated=[1],
        checkpoints=[Checkpoint(id=1, name="parent", origin="parent", parent=None, served_decoding="a", metrics={}, verdicts=[]),
                     Checkpoint(id=3, name="sft", origin="train:sft", parent=1, served_decoding="a", metrics={},
                                verdicts=[verdict(1, 1, True)]),
                     Checkpoint(id=4, name="dpo", origin="train:dpo", parent=1, served_decoding="a", metrics={},
                                verdicts=[verdict(2, 1, False, [bar_verdict(rule("d", "correct", "delta", ">=", 0),
                                                                            -0.1, 0.0, False)])])],
        datasets=[Dataset(id=2, name="w", builder="winner_sft", row_kind="sft", rows=5, audit_passed=True),
                  Dataset(id=5, name="leaky", builder="winner_sft", row_kind="sft", rows=5, audit_passed=False)],
        calls=[], **changes)


LAB = Path("/tmp/some-lab")


def test_every_gate_passes_a_sound_call():
    assert gates.check("train", {"trainer": "sft", "parent": 1, "dataset": 2}, summary(), 0.5, LAB) is None


def test_budget_admission_counts_spent_reserved_and_reserve():
    assert "budget" in gates.check("train", {"parent": 1, "dataset": 2}, summary(), 0.66, LAB)
    assert gates.check("compare", {"candidate": 3}, summary(), 99.0, LAB) is None  # no job, no forecast


def test_bars_before_scores():
    for tool, args in (("evaluate", {"artifact": 3}), ("calibrate", {"artifact": 1}), ("compare", {"candidate": 3})):
        assert "bars" in gates.check(tool, args, summary(bars=None), 0.0, LAB)


def test_training_data_only_from_audited_session_datasets():
    assert "leak-audited" in gates.check("train", {"parent": 1, "dataset": 5}, summary(), 0.1, LAB)
    assert "not an artifact" in gates.check("train", {"parent": 1, "dataset": 77}, summary(), 0.1, LAB)
    assert "leak-audited" in gates.check("build_dataset", {"builder": "mix", "parts": [{"dataset": 5}]}, summary(), 0.0, LAB)


def test_promotion_needs_a_promoting_comparison_against_the_current_incumbent():
    assert gates.check("promote", {"candidate": 3}, summary(), 0.0, LAB) is None
    # Every reason is given: the failed bar, with its statistic and threshold.
    assert "failed 1 bar(s): d/correct delta=-0.1 >= 0: fails" in gates.check("promote", {"candidate": 4}, summary(), 0.0, LAB)
    assert "no comparison at its served decoding against incumbent 4" in gates.check(
        "promote", {"candidate": 3}, summary(incumbent=4), 0.0, LAB)
    assert "already the incumbent" in gates.check("promote", {"candidate": 3}, summary(incumbent=3), 0.0, LAB)


def test_sealed_once_and_for_the_nominee_only():
    assert "nominee only" in gates.check("sealed_open", {"artifact": 3}, summary(), 0.0, LAB)
    assert gates.check("sealed_open", {"artifact": 3}, summary(nominee=3), 0.0, LAB) is None
    assert "once" in gates.check("sealed_open", {"artifact": 3}, summary(nominee=3, sealed_opened=True), 0.0, LAB)


def test_no_argument_names_a_path_outside_the_lab():
    assert "outside the lab" in gates.check("register_bars", {"file": "/etc/passwd"}, summary(), 0.0, LAB)
    assert "outside the lab" in gates.check("register_bars", {"file": "../other/bars.toml"}, summary(), 0.0, LAB)
    assert gates.check("register_bars", {"file": "world/bars.toml"}, summary(), 0.0, LAB) is None



def test_a_training_arm_outside_the_labs_train_ranges_is_refused():
    from trainers.recipe import TrainSection, resolve, shape_of_config

    shape = shape_of_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192})
    recipe = resolve(TrainSection.model_validate({"lr_range": [1e-6, 2e-5]}, strict=True), shape, [])
    sound = {"trainer": "sft", "parent": 1, "dataset": 2}
    assert gates.check("train", sound | {"lr": 1e-5}, summary(), 0.1, LAB, recipe) is None
    reason = gates.check("train", sound | {"lr": 1e-3}, summary(), 0.1, LAB, recipe)
    assert reason == "outside the lab's [train] ranges: lr 0.001 is outside [train.sft] lr_range [1e-06, 2e-05]"
    assert gates.check("train", sound | {"lr": 1e-3}, summary(), 0.1, LAB) is None  # no recipe given: no such gate


def test_a_scaled_lr_is_checked_as_scaled():
    from trainers.recipe import TrainSection, out_of_range, resolve, shape_of_config

    shape = shape_of_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192})
    recipe = resolve(TrainSection.model_validate({"lr": 1e-5, "lr_range": [1e-6, 2e-5]}, strict=True), shape, [])
    assert out_of_range(recipe, {"trainer": "sft", "lr_scale": 2.0}) == []
    assert out_of_range(recipe, {"trainer": "sft", "lr_scale": 4.0}) == [
        "lr 4e-05 is outside [train.sft] lr_range [1e-06, 2e-05]"]
