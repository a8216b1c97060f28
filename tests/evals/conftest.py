"""Helpers shared by the eval tests: items and completions built from plain text."""

from __future__ import annotations

import pytest

from evals.types import Completion, Item, Message, completion_from_text


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
