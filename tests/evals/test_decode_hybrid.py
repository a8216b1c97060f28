"""The engine's static decode loop on a tiny Nemotron-H hybrid (Mamba-2, MoE, attention and MLP blocks): the same
tokens as `model.generate`, greedy and sampled with the same seed; the mixers' bound forward is removed after;
a transformers without a static hybrid cache falls back to `generate` and says so once. The GPU checks (Triton
kernels against PyTorch's, the bench hybrid against `generate`) run where CUDA and mamba-ssm are."""

from __future__ import annotations

import logging

import pytest
import torch

from core.chat import render_prompt
from evals import decode_hybrid
from evals import generate as engine
from evals.decoding import Decoding
from evals.generate import generate, load

CUDA = torch.cuda.is_available()


def _items(item, n=7):
    return [item(f"h{i}", "tell me " + "more and more " * i + "about 12 + 7") for i in range(n)]


@pytest.fixture
def hybrid(tiny_models):
    return load(tiny_models["nemotron_h"])


def _decoded_by_engine(monkeypatch) -> list[int]:
    """Counts the engine's static-loop calls (so a test knows the hybrid really took it)."""
    calls = []
    real = engine._decode_static

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "_decode_static", counted)
    return calls


def test_greedy_tokens_equal_generate(hybrid, item, monkeypatch):
    items = _items(item)
    dec = Decoding(max_new_tokens=12, system_prompt="Be brief.")
    reference = generate(hybrid, items, dec, seed=0, batch_size=3)
    calls = _decoded_by_engine(monkeypatch)
    fast = generate(hybrid, items, dec, seed=0, batch_size=3, static_cache=True)
    assert calls == [1, 1, 1]
    assert fast == reference
    assert not any("forward" in vars(m) for m in decode_hybrid._mixers(hybrid.model))  # unbound after


def test_sampled_tokens_equal_generate_with_the_same_seed(hybrid, item, monkeypatch):
    items = _items(item)
    sampled = Decoding(max_new_tokens=10, temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    reference = generate(hybrid, items, sampled, seed=5, batch_size=4)
    calls = _decoded_by_engine(monkeypatch)
    fast = generate(hybrid, items, sampled, seed=5, batch_size=4, static_cache=True)
    assert calls and fast == reference
    assert fast != generate(hybrid, items, sampled, seed=6, batch_size=4, static_cache=True)  # really sampled


def test_stops_and_reused_shapes_equal_generate(hybrid, item):
    items = _items(item)
    prompt = torch.tensor([render_prompt(hybrid.tokenizer, items[0].messages)])
    free = hybrid.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                 do_sample=False)[0, prompt.shape[1]:].tolist()
    dec = Decoding(max_new_tokens=10, stop_token_ids=(free[3],))
    first = generate(hybrid, items, dec, seed=0, batch_size=2, static_cache=True)
    assert first == generate(hybrid, items, dec, seed=0, batch_size=2)
    assert any(c.stopped for c in first) and not all(c.stopped for c in first)
    assert generate(hybrid, items, dec, seed=0, batch_size=2, static_cache=True) == first  # captured shapes reused


def test_default_stays_on_generate(hybrid, item, monkeypatch):
    calls = _decoded_by_engine(monkeypatch)
    generate(hybrid, _items(item, 2), Decoding(max_new_tokens=3), seed=0)
    assert calls == []  # the static loop only when asked (its GPU check is open: evals/decode_hybrid.py)


def test_without_a_static_hybrid_cache_generate_serves_and_says_so_once(hybrid, item, monkeypatch, caplog):
    from transformers import cache_utils

    monkeypatch.setattr(cache_utils, "STATIC_LAYER_TYPE_MAPPING",
                        {k: v for k, v in cache_utils.STATIC_LAYER_TYPE_MAPPING.items() if k != "linear_attention"})
    engine._no_hybrid_loop.cache_clear()
    calls = _decoded_by_engine(monkeypatch)
    items, dec = _items(item, 3), Decoding(max_new_tokens=4)
    with caplog.at_level(logging.WARNING, logger="evals.generate"):
        fast = generate(hybrid, items, dec, seed=0, static_cache=True)
        generate(hybrid, items, dec, seed=0, static_cache=True)
    assert calls == [] and fast == generate(hybrid, items, dec, seed=0)
    assert sum("no static cache for Mamba layers" in r.message for r in caplog.records) == 1
    engine._no_hybrid_loop.cache_clear()


def test_missing_kernels_fall_back_to_pytorch_and_say_so_once(monkeypatch, caplog):
    monkeypatch.setattr(decode_hybrid, "import_without_init", _raise_import_error)
    decode_hybrid._triton_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="evals.decode_hybrid"):
            first = decode_hybrid.kernels_for(torch.device("cuda"))
            second = decode_hybrid.kernels_for(torch.device("cuda"))
    finally:
        decode_hybrid._triton_kernels.cache_clear()
    assert first.name == second.name == "torch"
    assert len([r for r in caplog.records if "hybrid decode" in r.message]) == 1
    assert decode_hybrid.kernels_for(torch.device("cpu")).name == "torch"


def _raise_import_error(*names):
    raise ImportError("mamba_ssm is not installed")


def test_capturable_experts_decode_the_same_tokens(hybrid, item):
    # The MoE layers' capturable experts (what the CUDA step captures) against the model's own loop.
    model = hybrid.model
    items, dec = _items(item, 4), Decoding(max_new_tokens=8)
    model.set_experts_implementation("eager")
    try:
        reference = generate(hybrid, items, dec, seed=0, batch_size=4)
        with decode_hybrid.use_capturable_experts(model):
            assert model.config._experts_implementation == "batched_mm"  # float32
            grouped = generate(hybrid, items, dec, seed=0, batch_size=4)
        assert model.config._experts_implementation == "eager"
    finally:
        model.set_experts_implementation("grouped_mm")
    assert grouped == reference


@pytest.mark.skipif(not CUDA, reason="needs a GPU with triton")
def test_triton_conv_update_equals_pytorch():
    torch.manual_seed(0)
    b, c, k = 5, 300, 4
    x = torch.randn(b, c, 1, device="cuda")
    state = torch.randn(b, c, k, device="cuda")
    w, bias = torch.randn(c, k, device="cuda"), torch.randn(c, device="cuda")
    ref_state = state.clone()
    ref = decode_hybrid.torch_kernels().conv_update(x, ref_state, w, bias, activation="silu")
    got = decode_hybrid.conv_update_triton(x, state, w, bias, activation="silu")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state)


def _triton_or_skip() -> decode_hybrid.MambaKernels:
    kernels = decode_hybrid.kernels_for(torch.device("cuda"))
    if kernels.name != "triton":
        pytest.skip("mamba-ssm's Triton kernels are missing")
    return kernels


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_triton_state_update_equals_pytorch():
    ssu = _triton_or_skip().state_update
    torch.manual_seed(0)
    b, h, p, n, g = 3, 8, 16, 32, 2
    state = torch.randn(b, h, p, n, device="cuda")
    x, z = torch.randn(b, h, p, device="cuda"), None
    dt = torch.randn(b, h, device="cuda")[..., None].expand(-1, -1, p)
    A = -torch.rand(h, device="cuda")[:, None, None].expand(-1, p, n)
    B, C = torch.randn(b, g, n, device="cuda"), torch.randn(b, g, n, device="cuda")
    D, dt_bias = (torch.randn(h, device="cuda")[:, None].expand(-1, p) for _ in range(2))
    ref_state = state.clone()
    ref = decode_hybrid.torch_kernels().state_update(ref_state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias,
                                                     dt_softplus=True)
    got = ssu(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_engine_equals_generate_in_float32(tiny_models, item, monkeypatch):
    # On CUDA the engine (static cache, graph replays, capturable experts); here on
    # PyTorch's Mamba functions, so float32 tokens must be `generate`'s exactly (the Triton kernels' own check is
    # the next test: their tf32 products move logits by ~1e-4, enough to flip a random model's near-ties).
    monkeypatch.setattr(decode_hybrid, "kernels_for", lambda device: decode_hybrid.torch_kernels())
    loaded = load(tiny_models["nemotron_h"], device="cuda")
    items = _items(item)
    decodings = (Decoding(max_new_tokens=12), Decoding(max_new_tokens=12, repetition_penalty=1.2))
    calls = _decoded_by_engine(monkeypatch)
    fast = [generate(loaded, items, dec, seed=0, batch_size=4, static_cache=True) for dec in decodings]
    assert len(calls) == 4
    assert fast == [generate(loaded, items, dec, seed=0, batch_size=4) for dec in decodings]


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_triton_decoder_equals_a_full_forward(tiny_models, item):
    # The captured step on the Triton kernels (prefill scan, conv window, state update) against one full forward
    # over the same tokens (bench/gen_throughput.py's check: right context vs a wrong one).
    import sys
    from pathlib import Path

    _triton_or_skip()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gen_throughput import check_static_decoder

    loaded = load(tiny_models["nemotron_h"], device="cuda")
    check = check_static_decoder(loaded, _items(item, 8))
    assert check["graph_replayed"] and check["relative_error"] < 5e-3
    assert check["relative_error"] < 0.05 * check["wrong_context_relative_error"]


def test_own_prefill_and_step_equal_generate(hybrid, item, monkeypatch):
    # The CUDA wiring (the mixers' own prefill into the cache, then their one-token step) on PyTorch functions of
    # the same signatures as mamba-ssm's: transformers' chunked scan stands in for the Triton SSD scan.
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    kernels = decode_hybrid.MambaKernels("torch-scan", m.causal_conv1d_update, m.mamba2_selective_state_update,
                                         scan=m.mamba2_chunk_scan)
    items, dec = _items(item), Decoding(max_new_tokens=10)
    reference = generate(hybrid, items, dec, seed=0, batch_size=4)
    seen = []
    monkeypatch.setattr(decode_hybrid, "kernels_for", lambda device: kernels)
    real_prefill, real_step = decode_hybrid._prefill, decode_hybrid._step
    monkeypatch.setattr(decode_hybrid, "_prefill", lambda *a: seen.append("prefill") or real_prefill(*a))
    monkeypatch.setattr(decode_hybrid, "_step", lambda *a: seen.append("step") or real_step(*a))
    assert generate(hybrid, items, dec, seed=0, batch_size=4, static_cache=True) == reference
    assert {"prefill", "step"} <= set(seen)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_triton_prefill_and_step_equal_pytorch(tiny_models, item):
    # One prefill and three steps through the model on the Triton kernels and on PyTorch's, each on a fresh static
    # cache, no graphs: logits and every Mamba state buffer close (tf32 products in the SSD scan).
    from transformers import StaticCache

    triton_kernels = _triton_or_skip()
    loaded = load(tiny_models["nemotron_h"], device="cuda")
    model, tok = loaded.model, loaded.tokenizer
    ids, mask = engine._left_pad([render_prompt(tok, i.messages) for i in _items(item, 4)], tok.pad_token_id,
                                 loaded.device, engine.WIDTH_BUCKET)
    steps = torch.randint(4, 1000, (4, 3), device="cuda")
    runs = []
    for kernels in (triton_kernels, decode_hybrid.torch_kernels()):
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 3)
        with torch.inference_mode(), decode_hybrid.bind(model, kernels):
            logits = [model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]]
            full = torch.cat([mask, torch.ones_like(steps)], 1)
            for t in range(3):
                logits.append(model(input_ids=steps[:, t:t + 1], attention_mask=full[:, : ids.shape[1] + t + 1],
                                    cache=cache, use_cache=True).logits[:, -1])
        states = [s for layer in cache.layers if hasattr(layer, "recurrent_states")
                  for s in (layer.conv_states[0], layer.recurrent_states[0])]
        runs.append((torch.stack(logits, 1).float(), [s.float() for s in states]))
    (got, got_states), (ref, ref_states) = runs
    assert float((got - ref).norm() / ref.norm()) < 5e-3
    for a, b in zip(got_states, ref_states, strict=True):
        assert float((a - b).norm() / b.norm()) < 5e-3


def test_fed_logits_are_copies_not_views_of_the_step_output(hybrid, item):
    # On CUDA the step's output is one buffer the graph rewrites at every replay; the hybrid's logits are already
    # float32, so a `.float()` view of it made every fed step read the last one (the H200 check's 1.2 "error").
    tok = hybrid.tokenizer
    ids, mask = engine._left_pad([render_prompt(tok, i.messages) for i in _items(item, 2)], tok.pad_token_id,
                                 hybrid.device, engine.WIDTH_BUCKET)
    with torch.inference_mode():
        decoder = engine._Decoder(hybrid.model, 2, ids.shape[1], 3)
        decoder.prefill(ids, mask)
        fed = decoder.feed(torch.tensor([5, 6]))
        assert fed.dtype == torch.float32
        assert fed.untyped_storage().data_ptr() != decoder.logits.untyped_storage().data_ptr()
