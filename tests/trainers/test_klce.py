"""KL-leashed CE: CE + forward KL to the parent; replay rows carry KL only."""

import json

import pytest
import torch
from trainer_testkit import (
    MEMO,
    assert_trained,
    assistant,
    metric_series,
    reload_and_generate,
    user,
    write_jsonl,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainers.batch import encode
from trainers.common import LoRASettings
from trainers.klce import KLCEConfig, KLCEObjective, forward_kl, train


@pytest.fixture
def klce_data(tmp_path):
    rows = [{"messages": [user(q), assistant(a)]} for q, a in MEMO[:6]]
    rows += [{"messages": [user(q), assistant("Sure, here you are.")], "kl_only": True} for q, _ in MEMO[6:]]
    return write_jsonl(tmp_path / "klce.jsonl", rows)


@pytest.mark.parametrize(("kind", "lora"), [("nemotron_h", None), ("llama", LoRASettings(r=8, alpha=16, train_lm_head=True))])
def test_klce_learns_and_reloads(kind, lora, model_dirs, klce_data, tmp_path):
    result = train(KLCEConfig(model_path=model_dirs[kind], data_path=klce_data, output_dir=tmp_path / "run",
                              lr=1e-2, steps=20, batch_size=8, micro_batch_size=4, kl_coef=0.5, lora=lora))
    losses = metric_series(tmp_path / "run")
    kls = metric_series(tmp_path / "run", "kl")
    assert losses[-1] < 0.5 * losses[0]
    assert kls[0] == pytest.approx(0.0, abs=1e-5) and kls[-1] > 0  # starts at the parent, then drifts
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 20
    assert_trained(result)
    reload_and_generate(result)


def test_replay_rows_carry_kl_only(model_dirs):
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    parent = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    policy = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"]).eval()  # same vocab, other weights
    rows = [encode(tok, [user(q), assistant(a)], None, 256) for q, a in MEMO[:2]]
    replay = KLCEObjective(rows, [True, True], parent, tok.pad_token_id, kl_coef=0.3)
    target = KLCEObjective(rows, [False, False], parent, tok.pad_token_id, kl_coef=0.0)
    with torch.no_grad():
        # Against itself, a replay row has no loss at all: no one-hot CE hides in it.
        assert float(KLCEObjective(rows, [True, True], parent, 0, 1.0).loss(parent, [0, 1], 1.0).loss) == 0.0
        r = replay.loss(policy, [0, 1], replay.normalizer([0, 1]))
        t = target.loss(policy, [0, 1], target.normalizer([0, 1]))
    assert r.metrics["ce"] == 0.0 and r.metrics["kl"] > 0
    assert float(r.loss) == pytest.approx(0.3 * r.metrics["kl"], rel=1e-5)
    assert float(t.loss) == pytest.approx(t.metrics["ce"], rel=1e-5) and t.metrics["ce"] > 0


def test_forward_kl_matches_definition():
    p, q = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    expected = torch.nn.functional.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(forward_kl(p, q), expected)
    assert torch.all(forward_kl(p, p).abs() < 1e-6)


def test_lora_parent_by_disabled_adapter_equals_separate_parent(model_dirs):
    from trainers.common import load_policy

    tok = AutoTokenizer.from_pretrained(model_dirs["nemotron_h"])
    parent = AutoModelForCausalLM.from_pretrained(model_dirs["nemotron_h"]).eval()
    policy = load_policy(model_dirs["nemotron_h"], "float32", LoRASettings(r=4, alpha=8, train_lm_head=True), 0)
    with torch.no_grad():  # move the adapter and head away from the parent
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    rows = [encode(tok, [user(q), assistant(a)], None, 256) for q, a in MEMO[:3]]
    own = KLCEObjective(rows, [True, False, True], None, tok.pad_token_id, kl_coef=0.7)
    separate = KLCEObjective(rows, [True, False, True], parent, tok.pad_token_id, kl_coef=0.7)
    policy.eval()
    a = own.loss(policy, [0, 1, 2], own.normalizer([0, 1, 2]))
    b = separate.loss(policy, [0, 1, 2], separate.normalizer([0, 1, 2]))
    assert a.metrics["kl"] > 1e-4
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
