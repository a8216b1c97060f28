"""The static loop's decode attention (evals/decode_attention.py) and its sparser stop checks, on the CPU.

The Triton kernel itself runs on CUDA only: bench/decode_step.py and bench/gen_throughput.py check it there against
`decode_attention_reference` and a full forward before timing. Here the reference (the kernel's algorithm: split
cache, online softmax, wholly masked blocks skipped) is checked against SDPA, and the registered attention function
against transformers' own SDPA path."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

from evals import decode_attention as da


def _case(seed: int, batch=3, kv_heads=2, groups=4, length=150, dim=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * groups, 1, dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=g) for _ in range(2))
    bias = torch.full((batch, 1, 1, length + 5), torch.finfo(torch.float32).min)
    # row r: left padding of 70 * r positions (row 2 leaves block 0 and most of block 1 unread), then its prompt
    # and decoded tokens up to position 110 + 10 r; the rest is not written yet
    for r in range(batch):
        bias[r, 0, 0, 70 * r if r < 2 else 100 : 110 + 10 * r] = 0
    return q, k, v, bias


def _sdpa(q, k, v, bias):
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         attn_mask=bias[..., : k.shape[2]])
    return out.transpose(1, 2)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_reference_equals_sdpa_and_reads_no_masked_block(splits):
    q, k, v, bias = _case(splits)
    expected = _sdpa(q, k, v, bias)
    # Poison what no row may read: block 2 (positions 128-149) is beyond every row's last position for row 0, and
    # row 2's first block is all padding. NaN read anywhere would spread to the output.
    k[0, :, 128:], v[0, :, 128:] = math.nan, math.nan
    k[2, :, :64], v[2, :, :64] = math.nan, math.nan
    got = da.decode_attention_reference(q, k, v, bias, q.shape[-1] ** -0.5, splits=splits)
    assert got.shape == expected.shape and torch.isfinite(got).all()
    assert (got - expected).norm() / expected.norm() < 1e-5


def test_split_plan_fills_the_gpu_without_empty_splits():
    assert da.split_plan(448, 1024, 528) == (1, 7)  # batch 128 x 8 KV heads: enough programs already
    splits, per = da.split_plan(448, 64, 528)  # batch 8: split the cache
    assert splits * per >= 7 and (splits - 1) * per < 7 and splits == 7
    assert da.split_plan(100, 8, 528) == (2, 1)


def test_registered_attention_is_sdpa_off_cuda(tmp_path):
    from transformers import AutoModelForCausalLM

    from core import tiny

    path = tiny.build_model("llama", tiny.build_tokenizer(tmp_path / "tok"), tmp_path / "llama", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(4, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        model.set_attn_implementation(da.register())
        assert model.config._attn_implementation == da.NAME
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected)
    q, k, v, bias = _case(0)
    assert not da.kernel_applies(q, k, bias)  # CPU: never the kernel


def test_sparse_stop_checks_cut_where_every_step_checks(tiny_models, item):
    """Checking for the end every 5 steps returns exactly what checking after every step returns, also when the
    last row stops between two checks."""
    from core.chat import render_prompt
    from evals.decoding import Decoding
    from evals.generate import (
        WIDTH_BUCKET,
        _decode_static,
        _left_pad,
        generation_config,
        load,
    )

    loaded = load(tiny_models["llama"])
    items = [item(f"q{i}", "tell me " + "more " * i) for i in range(3)]
    pad = loaded.tokenizer.pad_token_id
    prompts = [render_prompt(loaded.tokenizer, it.messages, None) for it in items]
    ids, mask = _left_pad(prompts, pad, loaded.device, WIDTH_BUCKET)

    def decode(stops: list[int], every: int) -> torch.Tensor:
        config = generation_config(Decoding(max_new_tokens=12), stops, pad)
        with torch.inference_mode():
            return _decode_static(loaded.model, ids, mask, config, stops, OrderedDict(), check_every=every)

    free = decode([-1], 1)
    stops = sorted(set(free[:, 6].tolist()))  # every row stops by step 6, the last one between checks 5 and 10
    cut = decode(stops, 1)
    assert cut.shape[1] <= 7 and cut.shape[1] % 5 and all(any(t in stops for t in row) for row in cut.tolist())
    assert torch.equal(decode(stops, 5), cut)
    assert torch.equal(decode([-1], 5), free)


def test_fused_pieces_compute_the_eager_step_and_leave_no_trace(tmp_path):
    """The engine's compiled RMSNorms and MLPs (inductor on CUDA; here the compiler's graph capture alone, backend
    aot_eager) give the eager logits, and the modules are plain again afterwards."""
    from transformers import AutoModelForCausalLM

    from core import tiny
    from evals.generate import fusable, fused_pieces

    path = tiny.build_model("llama", tiny.build_tokenizer(tmp_path / "tok"), tmp_path / "llama", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    pieces = fusable(model)
    layers = model.config.num_hidden_layers
    assert sorted({type(m).__name__ for m in pieces}) == ["LlamaMLP", "LlamaRMSNorm"] and len(pieces) == 3 * layers + 1
    ids = torch.randint(4, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        with fused_pieces(pieces, backend="aot_eager"):
            assert all("forward" in vars(m) for m in pieces)
            got = model(input_ids=ids).logits
    assert not any("forward" in vars(m) for m in pieces)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_captured_decoders_outlive_a_call_up_to_the_bound(tiny_models, item, monkeypatch):
    """The static loop's decoders (a KV cache and a CUDA graph per shape) stay with the loaded model across
    generate calls, at most MAX_DECODERS of them, the least recently used dropped first; answers are unchanged."""
    from evals import generate as engine
    from evals.decoding import Decoding

    loaded = engine.load(tiny_models["llama"])
    items = [item(f"q{i}", "tell me " + "more " * i) for i in range(4)]
    dec = Decoding(max_new_tokens=5)
    first = engine.generate(loaded, items, dec, seed=0, batch_size=4, static_cache=True)
    kept = dict(loaded.decoders)
    assert [k[:3] for k in kept] == [(4, engine.WIDTH_BUCKET, 5)]
    (key,) = kept
    assert engine.generate(loaded, items, dec, seed=0, batch_size=4, static_cache=True) == first
    assert loaded.decoders[key] is kept[key]  # reused, not rebuilt
    sampled = dec.model_copy(update={"temperature": 0.7})
    engine.generate(loaded, items, sampled, seed=0, batch_size=4, static_cache=True)
    assert len(loaded.decoders) == 2  # another decoding is another captured step
    monkeypatch.setattr(engine, "MAX_DECODERS", 1)
    engine.generate(loaded, items[:2], dec, seed=0, batch_size=2, static_cache=True)
    assert [k[:3] for k in loaded.decoders] == [(2, engine.WIDTH_BUCKET, 5)]
