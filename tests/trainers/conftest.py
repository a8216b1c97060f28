"""Fixtures for the trainer tests: the offline tokenizer and tiny models, built once per test session."""

import sys
from pathlib import Path

import pytest
import torch

from core import tiny

# Shared helpers live in trainer_testkit.py beside this file (a unique name, no clash with other suites).
sys.path.insert(0, str(Path(__file__).parent))
from trainer_testkit import MEMO, assistant, user, write_jsonl  # noqa: E402


@pytest.fixture(autouse=True)
def _few_threads():
    # The test machine is shared: with its two cores busy, two intra-op threads ran a tiny model's
    # steps 4x slower than one (1.3 s vs 5.4 s for a 20-step KL-CE run), so one thread it is.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_dir) -> Path:
    return tiny.build_tokenizer(tiny_dir / "tokenizer")


@pytest.fixture(scope="session")
def model_dirs(tiny_dir, tokenizer_dir) -> dict[str, Path]:
    """kind -> a freshly built tiny model directory (nemotron_h, llama, qwen2)."""
    return {kind: tiny.build_model(kind, tokenizer_dir, tiny_dir / kind, seed=0) for kind in tiny.MODEL_KINDS}


@pytest.fixture
def sft_data(tmp_path) -> Path:
    """Eight memorizable question/answer conversations."""
    return write_jsonl(tmp_path / "sft.jsonl", [{"messages": [user(q), assistant(a)]} for q, a in MEMO])
