"""Helpers shared by the eval tests: items and completions built from plain text."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.chat import Message
from evals.types import Completion, Item, completion_from_text


def make_item(item_id: str, prompt: str = "q", **fields) -> Item:
    return Item(id=item_id, messages=(Message(role="user", content=prompt),), **fields)


def make_completion(item_id: str, text: str, n_tokens: int | None = None, stopped: bool = True) -> Completion:
    return completion_from_text(item_id, text, len(text.split()) if n_tokens is None else n_tokens, stopped)


@pytest.fixture
def item():
    return make_item


@pytest.fixture
def completion():
    return make_completion


@pytest.fixture(autouse=True)
def _few_threads():
    # The test machine is shared: with its cores busy, two threads per tiny model mostly spin (four
    # engine tests: 24 s of CPU with two threads, 1.8 s with one, at load 15).
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """The offline tokenizer and tiny models (llama, nemotron_h, reward), built once per session."""
    from core import tiny

    root = tmp_path_factory.mktemp("evals-tiny")
    tok = tiny.build_tokenizer(root / "tokenizer")
    return {
        "tokenizer": tok,
        "llama": tiny.build_model("llama", tok, root / "llama", seed=0),
        "nemotron_h": tiny.build_model("nemotron_h", tok, root / "nemotron_h", seed=0),
        "reward": tiny.build_reward_model(tok, root / "reward", seed=0),
    }
