"""GPU training of Mamba models without their kernels is refused unless the config allows the slow path."""

import importlib.util

import pytest
import torch
from pydantic import ValidationError

from trainers.common import check_mamba_kernels, mamba_kernels_missing
from trainers.sft import SFTConfig


def test_refusal_logic():
    with pytest.raises(ValueError, match=r"nemotron_h model on a GPU needs the Mamba kernels, missing here: x; .*"
                                         r"allow_slow_mamba"):
        check_mamba_kernels("nemotron_h", ["x"])
    check_mamba_kernels("nemotron_h", [])  # kernels present
    check_mamba_kernels("llama", ["x"])  # no Mamba layers: nothing to refuse


def test_missing_kernels_are_found_by_importing_them():
    missing = mamba_kernels_missing()
    absent = [name for name in ("causal_conv1d", "mamba_ssm") if importlib.util.find_spec(name) is None]
    for name in absent:  # a package that is not installed is always reported
        assert any(m.startswith(name + ".") for m in missing), (name, missing)
    assert len(missing) <= 2


def test_config_refuses_a_hybrid_on_gpu_without_kernels(model_dirs, sft_data, tmp_path, monkeypatch):
    if not mamba_kernels_missing():
        pytest.skip("the Mamba kernels are installed here")
    # The check reads the real device; a CPU-only CI stands in for a GPU host lacking the kernels.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    common = {"data_path": sft_data, "output_dir": tmp_path / "run"}
    with pytest.raises(ValidationError, match="set allow_slow_mamba: true"):
        SFTConfig(model_path=model_dirs["nemotron_h"], **common)
    assert SFTConfig(model_path=model_dirs["nemotron_h"], allow_slow_mamba=True, **common).allow_slow_mamba
    SFTConfig(model_path=model_dirs["llama"], **common)  # attention-only models need no kernels
