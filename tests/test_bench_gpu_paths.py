"""Code paths that the GPU benchmarks found broken or slow, checked for correctness on the CPU.

- bench/train_memory.py on an H200: LoRA with the FP32 head copy under FSDP2's bf16 mixed-precision policy failed
  its first forward (the head's pre-hook cast the input to float32, the gathered head weight was bf16);
- bench/train_step_variants.py on an H200: on one process, peft's float32 adapters made the LoRA step 1.6x slower
  than bf16 adapters; the trainer now stores them in the compute dtype there;
- bench/gen_throughput.py's check of the engine's static-cache decoder against one full forward (the check every
  GPU run makes before timing) tells a right decoder from a wrong context;
- bench/train_step_variants.py on an H200: compiling the decoder blocks (the trainer's default on one GPU) must
  give the eager loss and gradients, LoRA and activation checkpointing included.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from core import tiny
from trainers import distributed
from trainers.batch import Encoded
from trainers.common import LoRASettings, load_policy, make_trainable
from trainers.sft import SFTObjective

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

LORA_HEAD = LoRASettings(r=4, alpha=8, train_lm_head=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu-paths")
    return tiny.build_model("llama", tiny.build_tokenizer(root / "tok"), root / "llama", seed=0)


def _rows(vocab: int) -> list[Encoded]:
    g = torch.Generator().manual_seed(0)
    return [Encoded(torch.randint(4, vocab, (24,), generator=g).tolist(), [0] * 6 + [1] * 18, False) for _ in range(2)]


def _loss_and_backward(model, vocab: int) -> float:
    objective = SFTObjective(_rows(vocab), 0, None, chunk=16)
    part = objective.loss(model, [0, 1], objective.normalizer([0, 1]))
    part.loss.backward()
    return float(part.loss)


@pytest.fixture
def one_rank_group(tmp_path):
    """A 1-process gloo group in this process (FSDP2 needs one), left again afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fp32_head_trains_under_fsdp2_bf16_policy(llama, one_rank_group):
    vocab = AutoModelForCausalLM.from_pretrained(llama).config.vocab_size
    torch.manual_seed(0)
    reference = make_trainable(AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32), llama, LORA_HEAD, 0,
                               False)
    expected = _loss_and_backward(reference, vocab)
    model = make_trainable(AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32), llama, LORA_HEAD, 0, False)
    distributed.shard(model, torch.bfloat16)  # float32 masters, bf16 compute: the GPU configuration
    got = _loss_and_backward(model, vocab)
    head = model.get_output_embeddings().modules_to_save["default"]
    assert head.weight.dtype == torch.float32 and head.weight.grad is not None  # the master head takes the update
    assert got == pytest.approx(expected, rel=2e-2)  # bf16 compute against float32, same weights


def test_one_process_lora_adapters_in_compute_dtype(llama):
    assert not distributed.setup().distributed
    vocab = AutoModelForCausalLM.from_pretrained(llama).config.vocab_size
    fp32 = load_policy(llama, "float32", LORA_HEAD, 0)
    bf16 = load_policy(llama, "bfloat16", LORA_HEAD, 0)
    adapters = {n: p for n, p in bf16.named_parameters() if p.requires_grad and "lora_" in n}
    assert adapters and all(p.dtype == torch.bfloat16 for p in adapters.values())
    assert all(p.dtype == torch.float32 for n, p in fp32.named_parameters() if p.requires_grad)
    assert bf16.get_output_embeddings().modules_to_save["default"].weight.dtype == torch.float32  # head stays FP32
    got, expected = _loss_and_backward(bf16, vocab), _loss_and_backward(fp32, vocab)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in adapters.values())
    assert got == pytest.approx(expected, rel=2e-2)


def test_static_decoder_check_tells_right_from_wrong_context(llama):
    import gen_throughput

    from evals.generate import load

    check = gen_throughput.check_static_decoder(load(llama), gen_throughput.make_items(4), steps=5)
    assert check["rows"] == 4 and check["steps"] == 5 and not check["graph_replayed"]  # CPU: plain calls
    assert check["relative_error"] < gen_throughput.DECODER_TOLERANCE["float32"]
    assert check["wrong_context_relative_error"] > 100 * check["relative_error"]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [None, LoRASettings(r=4, alpha=8)], ids=["full", "lora"])
def test_compiled_blocks_give_the_eager_loss_and_gradients(llama, lora):
    """bench/train_step_variants.py on an H200: compiling the decoder blocks is what lifts the dense step's MFU.
    On the CPU the compiler's graph capture runs (backend aot_eager: dynamo and AOT autograd, no code generation),
    with activation checkpointing inside the compiled blocks, over the LoRA wrappers too."""
    from trainers.common import compile_decoder_blocks, decoder_blocks

    vocab = AutoModelForCausalLM.from_pretrained(llama).config.vocab_size
    eager = make_trainable(AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32), llama, lora, 0, True)
    expected, expected_grads = _loss_and_backward(eager, vocab), _grads(eager)
    model = make_trainable(AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32), llama, lora, 0, True)
    names = [n for n, _ in model.named_parameters()]
    torch._dynamo.reset()
    assert compile_decoder_blocks(model, backend="aot_eager") == model.config.num_hidden_layers
    assert all(b._compiled_call_impl is not None for b in decoder_blocks(model))
    got = _loss_and_backward(model, vocab)
    assert [n for n, _ in model.named_parameters()] == names  # state dict names unchanged
    assert got == pytest.approx(expected, rel=1e-5)
    grads = _grads(model)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_blocks_compile_by_default_on_cuda_only(llama, tmp_path):
    """load_policy's default: compiled on one CUDA process (LoRA on a hybrid too); never on the CPU (this
    test) and never for a Nemotron-H block that holds a Mamba mixer."""
    from trainers.common import decoder_blocks

    model = load_policy(llama, "float32", None, 0)
    assert decoder_blocks(model) and all(b._compiled_call_impl is None for b in decoder_blocks(model))
    hybrid_dir = tiny.build_model("nemotron_h", tiny.build_tokenizer(tmp_path / "tok"), tmp_path / "hybrid")
    hybrid = AutoModelForCausalLM.from_pretrained(hybrid_dir)
    kinds = [type(b.mixer).__name__ for b in decoder_blocks(hybrid)]
    assert kinds and not any("Mamba" in k for k in kinds)
    assert len(kinds) < len(hybrid.model.layers)
