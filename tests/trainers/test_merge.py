"""Merges: dose endpoints bit-exact, midpoint is the mean, sharded streaming, refusals (LoRA merge-back: test_merge_lora)."""

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from core import tiny
from trainers.merge import (
    INDEX,
    DoseConfig,
    MergeError,
    SoupConfig,
    dose,
    shard_map,
    soup,
)


def _all_tensors(model_dir):
    out = {}
    for shard in set(shard_map(model_dir).values()):
        out |= load_file(model_dir / shard)
    return out


def _assert_within_ulps(got: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, ulps: int) -> None:
    """Elementwise |got - expected| <= ulps * eps * scale: merges are elementwise (no reductions), so two float32
    evaluations of one formula in other orders differ by a few roundings of the operands' magnitude `scale`, on
    any CPU (IEEE basic operations are correctly rounded)."""
    bound = ulps * torch.finfo(torch.float32).eps * scale
    assert bool(((got - expected).abs() <= bound).all()), float(((got - expected).abs() - bound).max())


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_dir):
    """Two Llamas with different weights, saved in several small shards (exercises streaming)."""
    root = tmp_path_factory.mktemp("merge")
    dirs = []
    for seed in (0, 1):
        path = tiny.build_model("llama", tokenizer_dir, root / f"src{seed}", seed=seed)
        model = AutoModelForCausalLM.from_pretrained(path)
        sharded = root / f"m{seed}"
        model.save_pretrained(sharded, max_shard_size="200KB")
        for f in path.iterdir():
            if not f.name.endswith("safetensors") and not (sharded / f.name).exists():
                (sharded / f.name).write_bytes(f.read_bytes())
        dirs.append(sharded)
    assert len(set(shard_map(dirs[0]).values())) > 1
    return dirs


def test_dose_endpoints_are_bit_exact_and_midpoint_is_the_mean(pair, tmp_path):
    a, b = _all_tensors(pair[0]), _all_tensors(pair[1])
    at0 = _all_tensors(dose(DoseConfig(a=pair[0], b=pair[1], alpha=0.0, output_dir=tmp_path / "d0")).output_dir)
    at1 = _all_tensors(dose(DoseConfig(a=pair[0], b=pair[1], alpha=1.0, output_dir=tmp_path / "d1")).output_dir)
    mid = _all_tensors(dose(DoseConfig(a=pair[0], b=pair[1], alpha=0.5, output_dir=tmp_path / "dh")).output_dir)
    for k in a:
        # Bit for bit (torch.equal alone would let -0.0 pass for +0.0).
        assert _bits(at0[k]) == _bits(a[k]) and _bits(at1[k]) == _bits(b[k]) and at0[k].dtype == a[k].dtype
        # a + 0.5 * (b - a) against (a + b) / 2: two roundings each side, at most |a| + |b| in magnitude.
        _assert_within_ulps(mid[k], (a[k] + b[k]) / 2, a[k].abs() + b[k].abs(), ulps=2)


def test_extrapolation_and_soup(pair, tmp_path):
    a, b = _all_tensors(pair[0]), _all_tensors(pair[1])
    far = _all_tensors(dose(DoseConfig(a=pair[0], b=pair[1], alpha=1.5, output_dir=tmp_path / "x")).output_dir)
    result = soup(SoupConfig(models=pair, weights=[0.25, 0.75], output_dir=tmp_path / "s"))
    souped = _all_tensors(result.output_dir)
    for k in a:
        # Each side rounds (b - a), the product and the sum (or the two products and the sum), each at most
        # |a| + 1.5|b - a| (or 0.25|a| + 0.75|b|) in magnitude: 3 ulps of that cover both orders.
        _assert_within_ulps(far[k], a[k] + 1.5 * (b[k] - a[k]), a[k].abs() + 1.5 * (b[k] - a[k]).abs(), ulps=3)
        _assert_within_ulps(souped[k], 0.25 * a[k] + 0.75 * b[k], 0.25 * a[k].abs() + 0.75 * b[k].abs(), ulps=3)
        assert not torch.equal(souped[k], a[k]) or torch.equal(a[k], b[k])  # the soup moved every differing tensor
    # Fresh index, copied config/tokenizer: the output loads the way a server loads it.
    index = json.loads((result.output_dir / INDEX).read_text())
    assert set(index["weight_map"]) == set(a) and result.shards == len(set(index["weight_map"].values()))
    assert result.shards == len(set(shard_map(pair[0]).values())) > 1  # written shard by shard, in a's layout
    assert (result.output_dir / "tokenizer.json").is_file() and (result.output_dir / "config.json").is_file()
    AutoModelForCausalLM.from_pretrained(result.output_dir)


def test_bf16_dose_is_computed_in_fp32_and_cast_back(pair, tmp_path):
    halves = []
    for i, src in enumerate(pair):
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(tmp_path / f"h{i}")
        halves.append(tmp_path / f"h{i}")
    a, b = _all_tensors(halves[0]), _all_tensors(halves[1])
    out = _all_tensors(dose(DoseConfig(a=halves[0], b=halves[1], alpha=0.3, output_dir=tmp_path / "d")).output_dir)
    for k in a:
        assert out[k].dtype == torch.bfloat16
        assert torch.equal(out[k], (a[k].float() + 0.3 * (b[k].float() - a[k].float())).to(torch.bfloat16))
    # The same formula in BF16 arithmetic rounds differently: the FP32 path really matters here.
    assert any(not torch.equal(out[k], a[k] + 0.3 * (b[k] - a[k])) for k in a)


def test_mismatches_are_refused_without_output(pair, tokenizer_dir, tmp_path):
    nemo = tiny.build_model("nemotron_h", tokenizer_dir, tmp_path / "nemo")
    with pytest.raises(MergeError, match="model_type 'nemotron_h' differs"):
        dose(DoseConfig(a=pair[0], b=nemo, alpha=0.5, output_dir=tmp_path / "out"))
    qwen = tiny.build_model("qwen2", tokenizer_dir, tmp_path / "qwen")
    cfg = json.loads((qwen / "config.json").read_text()) | {"model_type": "llama"}
    (qwen / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MergeError, match="tensor names differ"):  # Qwen2 has q/k/v biases
        dose(DoseConfig(a=pair[0], b=qwen, alpha=0.5, output_dir=tmp_path / "out"))
    wide = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pair[0], intermediate_size=96))
    wide.save_pretrained(tmp_path / "wide")
    with pytest.raises(MergeError, match=r"tensor model.layers.0.mlp.\w+_proj.weight is F32\[(64, 96|96, 64)\], .* has F32"):
        dose(DoseConfig(a=pair[0], b=tmp_path / "wide", alpha=0.5, output_dir=tmp_path / "out"))
    half = tmp_path / "half"
    AutoModelForCausalLM.from_pretrained(pair[1], dtype=torch.bfloat16).save_pretrained(half)
    with pytest.raises(MergeError, match=r"is BF16\[.*F32"):
        soup(SoupConfig(models=[pair[0], half], weights=[0.5, 0.5], output_dir=tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_bad_merge_configs(pair, tmp_path):
    with pytest.raises(ValidationError, match="weights: must sum to 1"):
        SoupConfig(models=pair, weights=[0.5, 0.6], output_dir=tmp_path / "o")
    with pytest.raises(ValidationError, match="output directory already exists"):
        DoseConfig(a=pair[0], b=pair[1], alpha=0.5, output_dir=tmp_path)
    with pytest.raises(ValidationError, match="no config.json"):
        DoseConfig(a=tmp_path, b=pair[1], alpha=0.5, output_dir=tmp_path / "o")


def _mixed_checkpoint(path, seed):
    """Two shards of mixed dtypes, odd sizes, a scalar and an empty tensor: every edge of chunked streaming."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shards = {
        "a.safetensors": {"big": torch.randn(37, 101, generator=gen).to(torch.bfloat16),
                          "wide": torch.randn(2500, generator=gen),
                          "scalar": torch.randn((), generator=gen)},
        "b.safetensors": {"half": torch.randn(3, 777, generator=gen).to(torch.float16),
                          "count": torch.randint(-1000, 1000, (999,), generator=gen),
                          "empty": torch.zeros(0, 4)},
    }
    path.mkdir()
    for name, tensors in shards.items():
        save_file(tensors, path / name, metadata={"format": "pt"})
    (path / INDEX).write_text(json.dumps({"weight_map": {k: n for n, ts in shards.items() for k in ts}}))
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def test_chunked_streaming_equals_the_whole_tensor_formula(tmp_path, monkeypatch):
    from core.util import file_sha256
    from trainers import merge
    from trainers.common import WEIGHTS_MANIFEST, weights_sha256

    a_dir, b_dir = _mixed_checkpoint(tmp_path / "a", 0), _mixed_checkpoint(tmp_path / "b", 1)
    monkeypatch.setattr(merge, "CHUNK_ELEMENTS", 1000)  # every tensor but the scalar spans several chunks
    result = soup(SoupConfig(models=[a_dir, b_dir], weights=[0.25, 0.75], output_dir=tmp_path / "s"))
    mid = dose(DoseConfig(a=a_dir, b=b_dir, alpha=0.3, output_dir=tmp_path / "d"))
    a, b, souped, dosed = (_all_tensors(d) for d in (a_dir, b_dir, result.output_dir, mid.output_dir))
    assert souped.keys() == a.keys() and dosed.keys() == a.keys()
    for k in a:
        fa, fb = a[k].float(), b[k].float()
        assert souped[k].dtype == a[k].dtype and souped[k].shape == a[k].shape
        assert torch.equal(souped[k], (0.25 * fa + 0.75 * fb).to(a[k].dtype)), k
        assert torch.equal(dosed[k], (fa + 0.3 * (fb - fa)).to(a[k].dtype)), k
    # The digest taken while writing is the one a second read of the files gives (the manifest set aside, so
    # the bytes are hashed), and the output's manifest is its own, not the first model's copied along.
    for out in (result, mid):
        (out.output_dir / WEIGHTS_MANIFEST).rename(tmp_path / "manifest")
        assert out.weights_sha256 == weights_sha256(out.output_dir)
        (tmp_path / "manifest").rename(out.output_dir / WEIGHTS_MANIFEST)
        assert json.loads((out.output_dir / WEIGHTS_MANIFEST).read_text())["weights_sha256"] == out.weights_sha256
    assert result.weights_sha256 != weights_sha256(a_dir)
    assert len({file_sha256(f) for f in result.output_dir.glob("*.safetensors")}) == result.shards == 2


def test_a_failing_shard_write_stops_the_merge(tmp_path, monkeypatch):
    """Hashing and writing run on a thread of their own: a write that fails there (here a full disk, /dev/full)
    is raised in the merge, not lost with the thread."""
    from pathlib import Path

    from trainers import merge

    a_dir, b_dir = _mixed_checkpoint(tmp_path / "a", 0), _mixed_checkpoint(tmp_path / "b", 1)
    monkeypatch.setattr(merge, "CHUNK_ELEMENTS", 1000)
    sources = merge._sources([a_dir, b_dir], [shard_map(a_dir), shard_map(b_dir)])
    keys = sorted(sources[0])
    with pytest.raises(OSError):
        merge._write_shard(Path("/dev/full"), keys, sources, merge._soup_combine([0.5, 0.5]), 1)


def test_pipelined_shards_are_hashed_and_flushed_as_whole_files(tmp_path, monkeypatch):
    """Shard pipelines with two slots and a flush every few chunks: each shard's digest, taken on the writer thread
    while the combining and the flusher run beside it, is hashlib's sha256 of the whole file as it lies on disk,
    and the bytes are the formula's, for any number of intra-op threads."""
    from core.util import file_sha256
    from trainers import merge
    from trainers.common import WEIGHTS_MANIFEST

    a_dir, b_dir = _mixed_checkpoint(tmp_path / "a", 0), _mixed_checkpoint(tmp_path / "b", 1)
    monkeypatch.setattr(merge, "CHUNK_ELEMENTS", 500)
    monkeypatch.setattr(merge, "PIPELINE_DEPTH", 2)  # slots are reused many times per shard
    monkeypatch.setattr(merge, "FLUSH_BYTES", 3000)  # the flusher runs several times per shard
    monkeypatch.setattr(merge.os, "cpu_count", lambda: 8)  # several intra-op threads per shard, even on 2 cores
    threads = torch.get_num_threads()
    result = soup(SoupConfig(models=[a_dir, b_dir], weights=[0.5, 0.5], output_dir=tmp_path / "s"))
    assert torch.get_num_threads() == threads  # the workers' own thread counts are not left behind
    recorded = json.loads((result.output_dir / WEIGHTS_MANIFEST).read_text())["sha256"]
    files = sorted(result.output_dir.glob("*.safetensors"))
    assert len(files) == 2 and recorded == {f.name: file_sha256(f) for f in files}
    a, b, souped = (_all_tensors(d) for d in (a_dir, b_dir, result.output_dir))
    for k in a:
        assert torch.equal(souped[k], (0.5 * a[k].float() + 0.5 * b[k].float()).to(a[k].dtype)), k
    # Any number of intra-op threads writes the same bytes, hashed as hashlib hashes the file.
    sources = merge._sources([a_dir, b_dir], [shard_map(a_dir), shard_map(b_dir)])
    keys = sorted(sources[0])
    for threads in (1, 3):
        path = tmp_path / f"threads{threads}.safetensors"
        digest = merge._write_shard(path, keys, sources, merge._soup_combine([0.5, 0.5]), threads)
        assert digest == file_sha256(path) == file_sha256(tmp_path / "threads1.safetensors")


def test_a_failing_stage_stops_the_merge_and_leaves_nothing(tmp_path, monkeypatch):
    """An error in a shard's pipeline is raised in the merge, and no thread is left waiting on another (the merge
    returns): a read of an input cut short after its header was read (safetensors itself refuses a short file when
    the merge checks its inputs, so the shard writer is called after that check), and a failing combine, where the
    merge leaves no output or partial directory. (A failing write: the next test.)"""
    import threading
    from pathlib import Path

    from trainers import merge

    a_dir, b_dir = _mixed_checkpoint(tmp_path / "a", 0), _mixed_checkpoint(tmp_path / "b", 1)
    monkeypatch.setattr(merge, "CHUNK_ELEMENTS", 500)
    monkeypatch.setattr(merge, "PIPELINE_DEPTH", 2)

    def returns(fn, *args):
        raised = []
        worker = threading.Thread(target=lambda: raised.append(_raises(fn, *args)))
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "a pipeline stage is waiting forever"
        return raised[0]

    sources = merge._sources([a_dir, b_dir], [shard_map(a_dir), shard_map(b_dir)])
    shard = b_dir / "a.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3000])
    keys = sorted(k for k, (path, _) in sources[1].items() if path == shard)
    err = returns(merge._write_shard, tmp_path / "out.safetensors", keys, sources, merge._soup_combine([0.5, 0.5]), 1)
    assert isinstance(err, MergeError) and "file ends inside a tensor" in str(err)

    calls = []

    def failing_combine(key, first, chunks, out, acc, tmp):
        calls.append(key)
        if len(calls) == 3:
            raise RuntimeError("combine failed")
        out.copy_(chunks[0])

    out = tmp_path / "c"
    err = returns(merge.stream_merge, [a_dir], failing_combine, out)
    assert isinstance(err, RuntimeError) and str(err) == "combine failed"
    assert not out.exists() and not Path(f"{out}.partial").exists()


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - the test inspects what was raised
        return err
    return None
