"""The model's own files are inputs (issue 44, item 6): the base and parent directories' config.json and safetensors
headers are checked with bounds when lab.toml loads, before any session opens and before anything hands them to
transformers. Each refusal names the file and the key and what was expected; at the CLI exit 2, no traceback,
nothing written, and in a bounded time (50 million layers took 48 s of CPU)."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from agent.config import LabConfigError, load_lab_config

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import assert_refused, files, make_lab, run_cli  # noqa: E402

NEMOTRON = {"model_type": "nemotron_h", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256}

# config.json contents of models/base -> what the refusal names (file and key, and what was expected)
CONFIGS = {
    "list as int": (NEMOTRON | {"num_hidden_layers": [2]},
                    "config.json: num_hidden_layers: a JSON list of length 1; expected an integer from 1 to 1024"),
    "dict as int": (NEMOTRON | {"hidden_size": {"a": 1}},
                    "config.json: hidden_size: a JSON dict of length 1; expected an integer from 1 to 131072"),
    "string vocab_size": (NEMOTRON | {"vocab_size": "256"},
                          "config.json: vocab_size: a JSON string of length 3; expected an integer from 1 to"),
    "bool as int": (NEMOTRON | {"num_attention_heads": True}, "config.json: num_attention_heads: true; expected an integer"),
    "float as int": (NEMOTRON | {"intermediate_size": 128.5}, "config.json: intermediate_size: 128.5; expected an integer"),
    "50 million layers": (NEMOTRON | {"num_hidden_layers": 50_000_000},
                          "config.json: num_hidden_layers: 50000000; expected an integer from 1 to 1024"),
    "5 million layer pattern": (NEMOTRON | {"hybrid_override_pattern": "M" * 5_000_000},
                                 "config.json: hybrid_override_pattern: a JSON string of length 5000000; expected a "
                                 "string of at most 1024 characters"),
    "absurd expert count": (NEMOTRON | {"n_routed_experts": 10**9},
                            "config.json: n_routed_experts: 1000000000; expected an integer from 0 to 4096"),
    "experts multiplying past any model": (
        NEMOTRON | {"hidden_size": 2**17, "num_hidden_layers": 1024, "n_routed_experts": 4096,
                    "moe_intermediate_size": 2**20, "hybrid_override_pattern": "E" * 1024},
        "models/base/config.json describes a model of 1.15e+18 parameters (layers x experts x widths); expected at "
        "most 1e+13"),
    "huge integer": (NEMOTRON | {"vocab_size": 10**40}, "config.json: vocab_size: an integer of 41 digits"),
    "text_config of the wrong type": (NEMOTRON | {"text_config": [1]},
                                      "config.json: text_config: a JSON list of length 1; expected an object"),
    "text_config out of bounds": (NEMOTRON | {"text_config": {"num_hidden_layers": -1}},
                                  "config.json text_config: num_hidden_layers: -1; expected an integer from 1 to 1024"),
    "auto_map": (NEMOTRON | {"auto_map": {"AutoModelForCausalLM": "modeling.Model"}},
                 "config.json: names custom code (auto_map); expected a model transformers implements itself"),
    "layer list of dicts": (NEMOTRON | {"layer_types": [{"x": 1}]},
                            "config.json: layer_types: a JSON list of length 1; expected a list of at most 1024 layer"),
}


def _header(path: Path, header: dict, data: bytes = b"", length: int | None = None) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)


# models/base/model.safetensors -> what the refusal names
WEIGHTS = {
    "header length 2^64-1": (lambda p: _header(p, {}, length=2**64 - 1),
                             "model.safetensors: a header of 18446744073709551615 bytes in a file of"),
    "1e24 parameters claimed": (lambda p: _header(p, {"w": {"dtype": "BF16", "shape": [10**12, 10**12],
                                                            "data_offsets": [0, 8]}}, b"\0" * 8),
                                "model.safetensors: tensors of more than 10000000000000 parameters"),
    "tensor past the end": (lambda p: _header(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                                              b"\0" * 8),
                            "model.safetensors: tensor w ends at byte 16 of 8 bytes of data"),
    "span unlike the shape": (lambda p: _header(p, {"w": {"dtype": "F32", "shape": [4096], "data_offsets": [0, 8]}},
                                                b"\0" * 8),
                              "model.safetensors: tensor w spans 8 bytes, its shape and dtype 16384"),
    "header not an object": (lambda p: _header(p, [1]), "model.safetensors: a header that is a JSON list"),
}


def _lab(tmp_path: Path) -> Path:
    lab = make_lab(tmp_path / "lab")
    (lab / "models/base/config.json").write_text(json.dumps(NEMOTRON))
    return lab


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_config_json_out_of_bounds_is_refused_at_load(tmp_path, case):
    lab = _lab(tmp_path)
    config, expected = CONFIGS[case]
    (lab / "models/base/config.json").write_text(json.dumps(config))
    started = time.process_time()
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    assert time.process_time() - started < 5, "refused by its bounds, not after the work they bound"
    where = "model: base: " if "describes a model" in expected else "model.base: path 'models/base': "
    assert where in str(err.value) and expected in str(err.value), str(err.value)


@pytest.mark.parametrize("case", list(WEIGHTS))
def test_a_safetensors_header_out_of_bounds_is_refused_at_load(tmp_path, case):
    lab = _lab(tmp_path)
    write, expected = WEIGHTS[case]
    write(lab / "models/parent/model.safetensors")
    (lab / "models/parent/config.json").write_text(json.dumps(NEMOTRON))
    with pytest.raises(LabConfigError) as err:
        load_lab_config(lab)
    assert "model.parent: path 'models/parent': " in str(err.value) and expected in str(err.value), str(err.value)


def test_a_model_in_bounds_loads(tmp_path):
    lab = _lab(tmp_path)
    _header(lab / "models/base/model.safetensors", {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                                                    "__metadata__": {"format": "pt"}}, b"\0" * 16)
    (lab / "models/base/config.json").write_text(json.dumps(NEMOTRON | {"text_config": {"vocab_size": 256},
                                                                        "head_dim": None}))
    assert load_lab_config(lab).model.base == (lab / "models/base").resolve()


def test_the_cli_refuses_them_with_exit_2_and_writes_nothing(tmp_path):
    """The worst two at the command line: a header length of 2^64-1 (a traceback before) and 50 million layers
    (48 s of CPU before)."""
    labs = {}
    for case in ("header length 2^64-1", "50 million layers"):
        lab = _lab(tmp_path / case.replace(" ", "_"))
        if case in WEIGHTS:
            WEIGHTS[case][0](lab / "models/base/model.safetensors")
        else:
            (lab / "models/base/config.json").write_text(json.dumps(CONFIGS[case][0]))
        labs[case] = (lab, files(lab))
    procs = run_cli([["--budget", "1gpuh", "--lab", str(lab)] for lab, _ in labs.values()])
    for (case, (lab, before)), proc in zip(labs.items(), procs, strict=True):
        expected = WEIGHTS[case][1] if case in WEIGHTS else CONFIGS[case][1]
        assert_refused(proc.returncode, proc.stderr, "lab.toml", "model.base", expected)
        assert files(lab) == before, case


def test_a_model_directory_without_weights_is_refused_before_a_session_opens(tmp_path):
    """A config.json alone passed every check, opened a session and failed its first job with a traceback (the
    parent's active parameters, 0, refused by the job's resources), the session left open."""
    from agent.inputs import runtime_problems

    lab = _lab(tmp_path)
    _header(lab / "models/base/model.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8)
    problems = runtime_problems(load_lab_config(lab), {"CUDA_VISIBLE_DEVICES": ""}, "playbook", "local")
    weightless = [p for p in problems if "holds no safetensors weights" in p]
    assert len(weightless) == 1 and weightless[0].startswith("[model] parent "), problems
