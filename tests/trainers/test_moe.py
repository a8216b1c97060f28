"""Nemotron-H's routed experts as the trainers run them: transformers' grouped matmuls, equal to its expert loop.

transformers 5 (5.17 and 5.24 alike) picks `experts_implementation="grouped_mm"` for Nemotron-H by default: the
token-expert pairs sorted by expert, one grouped product per projection; "eager" loops over the experts hit,
two small products and a host sync each. The GPU bench (bench/mamba_kernels.py) times the two.
"""

import copy

import torch
from transformers import AutoModelForCausalLM

from trainers.common import LoRASettings, load_policy


def test_trainers_run_grouped_experts(model_dirs):
    model = load_policy(model_dirs["nemotron_h"], "float32", None, seed=0)
    assert model.config._experts_implementation == "grouped_mm"


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(grouped, loop, ids):
    loss_g, grads_g = _loss_and_grads(grouped, ids)
    loss_l, grads_l = _loss_and_grads(loop, ids)
    torch.testing.assert_close(loss_g, loss_l, rtol=1e-5, atol=1e-6)
    assert grads_g.keys() == grads_l.keys() and any(".experts." in n for n in grads_g)
    for name, g in grads_g.items():
        assert (g - grads_l[name]).norm() <= 1e-4 * grads_l[name].norm() + 1e-8, name


def test_grouped_experts_equal_the_loop(model_dirs):
    grouped = AutoModelForCausalLM.from_pretrained(model_dirs["nemotron_h"]).train()
    loop = copy.deepcopy(grouped)
    loop.set_experts_implementation("eager")
    assert grouped.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    _assert_same(grouped, loop, ids)


def test_grouped_experts_equal_the_loop_under_lora(model_dirs):
    """LoRA on the routed experts (peft's target_parameters) through the grouped products."""
    lora = LoRASettings(r=4, alpha=8)
    grouped = load_policy(model_dirs["nemotron_h"], "float32", lora, seed=0)
    with torch.no_grad():  # B starts at zero: make the adapters non-trivial so their path is compared
        for name, p in grouped.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    loop = copy.deepcopy(grouped)
    loop.set_experts_implementation("eager")
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    _assert_same(grouped, loop, ids)
