"""CUDA graphs over the Mamba mixers of a training step (trainers/step_graphs.py, trainers.common.graph_mamba_mixers).

The policy (when a call replays, captures or runs eagerly) is plain logic and runs everywhere; the graphs need a GPU
with mamba-ssm's Triton kernels, so the loss-and-gradient tests run only there (on the device machine:
`python3 -m pytest --confcutdir=tests/trainers tests/trainers/test_step_graphs.py`) and skip on the CPU."""

import pytest
import torch

from core import loading
from trainers import mamba_kernels
from trainers.common import LoRASettings, graph_mamba_mixers, make_trainable
from trainers.step_graphs import decide

GPU = torch.cuda.is_available() and not mamba_kernels.missing()
needs_gpu = pytest.mark.skipif(not GPU, reason="CUDA graphs over mamba-ssm's Triton kernels need a GPU with them")


def test_a_key_is_captured_on_its_second_call_in_a_row_then_replayed():
    a, b = ("shape a",), ("shape b",)
    assert decide(a, None, None, usable=True) == "eager"  # first sighting
    assert decide(a, None, a, usable=True) == "capture"  # the same key again
    assert decide(a, a, a, usable=True) == "replay"
    assert decide(b, a, a, usable=True) == "eager"  # a new shape: eager, and remembered
    assert decide(a, a, b, usable=True) == "replay"  # alternating shapes never recapture
    assert decide(b, a, b, usable=True) == "capture"  # a new shape that repeats replaces the graphs
    assert decide(a, a, a, usable=False) == "eager"  # no gradients, a backward due, or no CUDA input


def test_nothing_is_graphed_on_the_cpu(model_dirs):
    """The CPU path stays exactly the mixers' own (no Triton kernels bound), with compile_blocks on too."""
    path = model_dirs["nemotron_h"]
    model = make_trainable(loading.load_causal_lm(path, dtype=torch.float32), path, None, 0, False)
    assert graph_mamba_mixers(model) == 0
    assert mamba_kernels.graph_regions(model) == []
    mamba_kernels.use_reference_ssd(model)  # bound, but not on the Triton kernels: still nothing to graph
    assert graph_mamba_mixers(model) == 0


def _pair(path, lora, activation_checkpointing=False):
    """The same model twice on the GPU: mixers on the Triton kernels eagerly, and graphed."""
    def one():
        model = loading.load_causal_lm(path, dtype=torch.float32).cuda()
        model = make_trainable(model, path, lora, 0, activation_checkpointing)
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: give the adapters a gradient path through A
                param.data.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        return model

    eager, graphed = one(), one()
    return eager, graphed, graph_mamba_mixers(graphed)


def _step(model, ids, optimizer):
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), grads


@needs_gpu
@pytest.mark.parametrize("lora", [None, LoRASettings(r=4, alpha=8)], ids=["full", "lora"])
def test_graphed_steps_equal_eager_in_loss_and_gradients(model_dirs, lora):
    eager, graphed, n = _pair(model_dirs["nemotron_h"], lora)
    assert n == 1
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (eager, graphed)]
    for step in range(4):  # fresh rows each step (copied into the graph's inputs), weights updated in place
        ids = torch.randint(4, 500, (2, 64), generator=torch.Generator().manual_seed(step)).cuda()
        expected, expected_grads = _step(eager, ids, optimizers[0])
        got, grads = _step(graphed, ids, optimizers[1])
        assert got == pytest.approx(expected, rel=1e-5), step
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    (region,) = mamba_kernels.graph_regions(graphed)
    assert region.counts == {"eager": 1, "capture": 1, "replay": 2}


@needs_gpu
def test_a_second_forward_before_backward_runs_eagerly(model_dirs):
    """Two forwards of one region before one backward (the graph's saved activations would be overwritten), and a
    no-grad pass between steps: gradients still equal eager."""
    eager, graphed, _ = _pair(model_dirs["nemotron_h"], None)
    ids = [torch.randint(4, 500, (2, 64), generator=torch.Generator().manual_seed(s)).cuda() for s in range(2)]
    for _ in range(2):  # the second step captures
        for model in (eager, graphed):
            model(input_ids=ids[0]).logits.sum().backward()
            model.zero_grad(set_to_none=True)
    for model in (eager, graphed):
        with torch.no_grad():
            model(input_ids=ids[1])
        (model(input_ids=ids[0]).logits.float().logsumexp(-1).mean()
         + model(input_ids=ids[1]).logits.float().square().mean()).backward()
    (region,) = mamba_kernels.graph_regions(graphed)
    assert region.counts["replay"] == 1 and region.counts["eager"] == 3  # first step, no-grad pass, second forward
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@needs_gpu
def test_a_stale_backward_over_a_replayed_graph_raises(model_dirs):
    _, graphed, _ = _pair(model_dirs["nemotron_h"], None)
    ids = torch.randint(4, 500, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    for _ in range(2):
        graphed(input_ids=ids).logits.sum().backward()
    kept = graphed(input_ids=ids).logits.sum()  # a replay
    kept.backward(retain_graph=True)
    graphed(input_ids=ids).logits.sum().backward()  # another replay overwrites the first one's activations
    with pytest.raises(RuntimeError, match="replayed again before this backward"):
        kept.backward()


@needs_gpu
def test_no_graphs_with_activation_checkpointing(model_dirs):
    *_, n = _pair(model_dirs["nemotron_h"], None, activation_checkpointing=True)
    assert n == 0


def test_blocks_compile_by_default_only_on_cuda_for_models_worth_the_compile():
    from trainers.common import COMPILE_BLOCKS_ABOVE, compiles_by_default

    assert compiles_by_default("cuda", 8_000_000_000) and compiles_by_default("cuda", COMPILE_BLOCKS_ABOVE + 1)
    assert not compiles_by_default("cuda", 1_000_000)  # a toy world's model: eager, no minutes of compiling
    assert not compiles_by_default("cpu", 8_000_000_000)
