"""The Mamba kernel path (trainers/mamba_kernels.py) and the GPU refusal without it.

mamba-ssm's Triton kernels need a GPU (its host code calls torch.cuda even under TRITON_INTERPRET=1), so the CPU
tests check what surrounds them: the loader that skips the package's __init__, the selection logic, the per-row
convolution, and the mixer's wiring run on the pure-torch reference scan against transformers' own mixer (the
GPU bench, bench/mamba_kernels.py, checks the Triton kernels against transformers' mixer and packed rows against
unpacked ones).
"""

import copy
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainers import mamba_kernels
from trainers.batch import encode, pack_batch, pad_batch
from trainers.common import (
    check_mamba_kernels,
    fast_mamba,
    mamba_kernels_missing,
    packing_keeps_rows_apart,
)
from trainers.losses import token_logprobs
from trainers.sft import SFTConfig


def test_refusal_logic():
    with pytest.raises(ValueError, match=r"nemotron_h model on a GPU needs the Mamba kernels, missing here: x; .*"
                                         r"allow_slow_mamba"):
        check_mamba_kernels("nemotron_h", ["x"])
    check_mamba_kernels("nemotron_h", [])  # kernels present
    check_mamba_kernels("llama", ["x"])  # no Mamba layers: nothing to refuse


def test_missing_kernels_are_found_by_importing_them():
    if importlib.util.find_spec("mamba_ssm") is None:  # not installed: both paths say so
        assert mamba_kernels_missing("nemotron_h") == ["mamba_ssm's Triton SSD kernels (mamba_ssm is not installed)"]
        assert any(m.startswith("mamba_ssm.") for m in mamba_kernels_missing("mamba2"))
    if importlib.util.find_spec("causal_conv1d") is None:  # Nemotron-H no longer needs it; the others do
        assert not any("causal_conv1d" in m for m in mamba_kernels_missing("nemotron_h"))
        assert any(m.startswith("causal_conv1d.") for m in mamba_kernels_missing("mamba2"))


def test_config_refuses_a_hybrid_on_gpu_without_kernels(model_dirs, sft_data, tmp_path, monkeypatch):
    if not mamba_kernels_missing("nemotron_h"):
        pytest.skip("the Mamba kernels are installed here")
    # The check reads the real device; a CPU-only CI stands in for a GPU host lacking the kernels.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    common = {"data_path": sft_data, "output_dir": tmp_path / "run"}
    with pytest.raises(ValidationError, match="set allow_slow_mamba: true"):
        SFTConfig(model_path=model_dirs["nemotron_h"], **common)
    assert SFTConfig(model_path=model_dirs["nemotron_h"], allow_slow_mamba=True, **common).allow_slow_mamba
    SFTConfig(model_path=model_dirs["llama"], **common)  # attention-only models need no kernels


@pytest.fixture
def fake_mamba_ssm(tmp_path, monkeypatch):
    """A mamba_ssm distribution whose package __init__ fails as the real one does without its CUDA extension,
    and whose Triton modules import each other by absolute name, as the real ones do."""
    root = tmp_path / "site" / "mamba_ssm"
    (root / "ops" / "triton").mkdir(parents=True)
    (root / "__init__.py").write_text("import selective_scan_cuda_that_is_not_built\n")
    (root / "ops" / "__init__.py").write_text("")
    (root / "ops" / "triton" / "__init__.py").write_text("")
    (root / "ops" / "triton" / "layernorm_gated.py").write_text("def rmsnorm_fn():\n    return 'norm'\n")
    (root / "ops" / "triton" / "ssd_combined.py").write_text(
        "from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn\n"
        "def mamba_chunk_scan_combined():\n    return 'scan'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    mamba_kernels.load_ssd.cache_clear()
    yield
    mamba_kernels.load_ssd.cache_clear()


def test_load_ssd_skips_the_package_init(fake_mamba_ssm):
    ssd, norm = mamba_kernels.load_ssd()
    assert ssd.mamba_chunk_scan_combined() == "scan" and norm.rmsnorm_fn() == "norm"
    assert mamba_kernels.missing() == []
    # The names are gone again: transformers' own lookup (`import mamba_ssm`) still fails, so it never picks
    # mamba-ssm's fused path, which would call causal-conv1d's missing extension.
    assert not any(n == "mamba_ssm" or n.startswith("mamba_ssm.") for n in sys.modules)
    with pytest.raises(ImportError, match="selective_scan_cuda_that_is_not_built"):
        import mamba_ssm  # noqa: F401


def test_packing_and_kernels_are_chosen_by_device(fake_mamba_ssm, model_dirs, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["nemotron_h"])
    assert packing_keeps_rows_apart("llama") and not packing_keeps_rows_apart("mamba2")
    assert not packing_keeps_rows_apart("nemotron_h")  # no GPU here
    assert not mamba_kernels.keeps_rows_apart(fast_mamba(model))  # CPU: transformers' own mixer stays
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host with the kernels installed
    assert packing_keeps_rows_apart("nemotron_h")
    assert mamba_kernels.keeps_rows_apart(fast_mamba(model))
    llama = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    assert fast_mamba(llama) is llama  # nothing to bind


def _per_row_conv(x, weight, bias, lengths):
    rows, start = [], 0
    for n in lengths:
        seg = x[:, start:start + n].transpose(1, 2)
        rows.append(F.conv1d(seg, weight, bias, padding=weight.shape[-1] - 1, groups=x.shape[-1])[..., :n])
        start += n
    return torch.cat(rows, -1).transpose(1, 2)


def test_causal_conv_restarts_at_each_packed_row():
    torch.manual_seed(0)
    lengths = [5, 1, 9, 2]
    x, weight, bias = torch.randn(1, sum(lengths), 6), torch.randn(6, 1, 4), torch.randn(6)
    seq_idx = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].int()
    whole = F.conv1d(x.transpose(1, 2), weight, bias, padding=3, groups=6)[..., : x.shape[1]].transpose(1, 2)
    torch.testing.assert_close(mamba_kernels.causal_conv(x, weight, bias, None), whole)
    torch.testing.assert_close(mamba_kernels.causal_conv(x, weight, bias, seq_idx), _per_row_conv(x, weight, bias, lengths))
    assert (whole - _per_row_conv(x, weight, bias, lengths)).abs().max() > 1e-2  # the rows do differ


@pytest.fixture
def hybrid(model_dirs):
    """(transformers' own Nemotron-H, the same weights with the mixers on the reference scan)."""
    own = AutoModelForCausalLM.from_pretrained(model_dirs["nemotron_h"]).train()
    ref = copy.deepcopy(own)
    assert mamba_kernels.use_reference_ssd(ref) == 1 and mamba_kernels.keeps_rows_apart(ref)
    return own, ref


def test_mixer_wiring_matches_transformers(hybrid):
    """The kernel path's wiring (splits, per-row conv, scan arguments, gated norm) on the reference scan gives
    transformers' mixer's logits and gradients: the GPU path differs from this only in the two kernels."""
    own, ref = hybrid
    ids = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # a padded row: padding must feed nothing into the state
    outs = [m(input_ids=ids, attention_mask=mask, use_cache=False).logits for m in (own, ref)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for out in outs:
        (out[mask.bool()].square().mean()).backward()
    for (name, p), q in zip(own.named_parameters(), ref.parameters(), strict=True):
        if p.grad is not None:
            assert (q.grad - p.grad).norm() <= 1e-4 * p.grad.norm() + 1e-7, name


def test_packed_rows_equal_unpacked_with_seq_idx(hybrid, model_dirs):
    own, ref = hybrid
    tok = AutoTokenizer.from_pretrained(model_dirs["nemotron_h"])
    rows = [encode(tok, [{"role": "user", "content": q}, {"role": "assistant", "content": a}], None, 256)
            for q, a in [("What is two plus two?", "Four."), ("Name a colour.", "Blue, like the sky at noon.")]]
    ref.eval()
    with torch.no_grad():
        alone = torch.cat([token_logprobs(ref, pad_batch([r], tok.pad_token_id), 64)[0] for r in rows])
        packed = token_logprobs(ref, pack_batch([rows], tok.pad_token_id, seq_idx=True), 64)[0]
        leaky = token_logprobs(ref, pack_batch([rows], tok.pad_token_id), 64)[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (leaky - alone).abs().max() > 1e-3  # without seq_idx the second row sees the first's state
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):  # transformers' mixer refuses
        token_logprobs(own, pack_batch([rows], tok.pad_token_id, seq_idx=True), 64)


def test_generation_with_a_cache_runs_the_mixers_own_forward(hybrid):
    own, ref = hybrid
    prompt = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        torch.testing.assert_close(ref.eval().generate(prompt, max_new_tokens=4, do_sample=False),
                                   own.eval().generate(prompt, max_new_tokens=4, do_sample=False))


def test_pack_batch_numbers_rows_and_padding():
    from trainers.batch import Encoded

    rows = [Encoded([1, 2, 3], [0, 1, 1], False), Encoded([4, 5], [0, 1], False)]
    batch = pack_batch([rows, rows[:1]], pad_id=0, seq_idx=True)
    assert batch.seq_idx.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]  # second pack: one row, then padding
    assert batch.seq_idx.dtype == torch.int32
    assert pack_batch([rows], pad_id=0).seq_idx is None
