"""LoRA on Nemotron-H's routed experts (trainers/lora_experts.py): peft's arithmetic without its per-call
parametrization, so the compiled MoE blocks have no graph breaks and compile once."""

import pytest
import torch
from peft.tuners.lora.layer import ParamWrapper
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from trainers.common import LoRASettings, compile_decoder_blocks, decoder_blocks, make_trainable

LORA = LoRASettings(r=4, alpha=8)


def _hybrid(model_dir, peft_experts: bool = False):
    model = make_trainable(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), model_dir, LORA, 0,
                           False)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: give the adapters something to contribute
            param.data.normal_(0, 0.05)
    if peft_experts:  # peft's own ParamWrapper.forward, as before trainers.lora_experts
        for module in model.modules():
            if isinstance(module, ParamWrapper):
                vars(module).pop("forward", None)
    return model


def _loss_and_grads(model) -> tuple[float, dict[str, torch.Tensor]]:
    ids = torch.randint(4, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def test_experts_forward_equals_peft_in_loss_and_gradients(model_dirs):
    path = model_dirs["nemotron_h"]
    model = _hybrid(path)
    bound = [m for m in model.modules() if isinstance(m, ParamWrapper) and "forward" in vars(m)]
    assert len(bound) == sum(1 for b in decoder_blocks(model) if type(b.mixer).__name__ == "NemotronHMoE") > 0
    expected, expected_grads = _loss_and_grads(_hybrid(path, peft_experts=True))
    got, grads = _loss_and_grads(model)
    assert got == pytest.approx(expected, rel=1e-6)
    assert grads.keys() == expected_grads.keys()
    assert any("experts.lora_A" in n for n in grads)  # the routed experts' factors are trained
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_disabled_adapters_give_the_base_model(model_dirs):
    """KL-CE's parent pass runs under `disable_adapter()`: the experts then fall back to peft's own path."""
    path = model_dirs["nemotron_h"]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(4, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    model = _hybrid(path)
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits)
        assert not torch.allclose(model(input_ids=ids).logits, _hybrid(path)(input_ids=ids).logits)


def test_compiled_lora_hybrid_has_no_graph_breaks_and_eager_gradients(model_dirs):
    """What made the compiled hybrid LoRA step slower than eager on an H200: peft's experts parametrization broke the
    MoE block's graph and recompiled it on every call. Now: no graph break, one graph per block type, the same across
    steps, and the eager loss and gradients (backend aot_eager: dynamo and AOT
    autograd on the CPU, no code generation)."""
    path = model_dirs["nemotron_h"]
    expected, expected_grads = _loss_and_grads(_hybrid(path))
    model = _hybrid(path)
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_blocks(model, backend="aot_eager") == len(decoder_blocks(model))
    for _ in range(2):
        got, grads = _loss_and_grads(model)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    kinds = {type(b.mixer).__name__ for b in decoder_blocks(model)}
    assert counters["stats"]["unique_graphs"] == len(kinds)
    assert got == pytest.approx(expected, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)
