"""GPU only (skipped without CUDA; bench/gpu_session.sh runs it on the H200): an eval job placed on the GPU runs
there in bfloat16 with the engine's fast path, chooses its batch from free memory, and records where it ran; a
training job given the GPU trains there in bfloat16 and records it too.

    python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/evals tests/evals/test_gpu_jobs.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["llama", "nemotron_h"])
def test_an_eval_job_on_the_gpu_records_cuda_bf16_and_its_throughput(tiny_models, tmp_path: Path, kind: str) -> None:
    from evals import synthetic
    from evals.decoding import Decoding
    from evals.job import EvalJobConfig, SuiteSpec, run

    items = [t.item for t in synthetic.generate("digit_sum", 24, seed=1)]
    (tmp_path / "digits.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in items))
    cfg = EvalJobConfig(checkpoint=tiny_models[kind], decoding=Decoding(max_new_tokens=16),
                        suites=(SuiteSpec(name="digits", scorer="synthetic", items_path=tmp_path / "digits.jsonl"),),
                        device="cuda", dtype="bfloat16", static_cache=True, batch_size=None, output_dir=tmp_path / "out")
    result = run(cfg)
    p = result.placement
    assert p is not None and (p.device, p.dtype, p.devices) == ("cuda", "bfloat16", 1)
    assert p.device_name == torch.cuda.get_device_name(0) and p.tokens_per_s and p.tokens_per_s > 0
    assert result.batch_size is not None and result.batch_size >= 1  # chosen from free memory
    assert json.loads((tmp_path / "out" / "result.json").read_text())["placement"]["device"] == "cuda"


def test_a_training_job_on_the_gpu_records_cuda_bf16(tiny_models, tmp_path: Path) -> None:
    from trainers import sft

    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"The answer is {2 * i}."}]} for i in range(8)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = sft.train(sft.SFTConfig(model_path=tiny_models["llama"], data_path=tmp_path / "sft.jsonl",
                                     output_dir=tmp_path / "run", steps=2, lr=1e-3, batch_size=4, micro_batch_size=4))
    p = result.placement
    assert p is not None and (p.device, p.dtype) == ("cuda", "bfloat16") and p.tokens_per_s > 0
