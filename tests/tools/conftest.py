"""Fixtures for the data tests: battle rows, feedback files and the offline tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers import tiny


def make_battle(bid: str, prompt: str = "q", vote: str = "own", own: str = "own answer",
                other: str = "other answer", meta: dict | None = None, messages: list | None = None) -> dict:
    row = {"id": bid, "messages": messages or [{"role": "user", "content": prompt}],
           "own": own, "other": other, "vote": vote}
    if meta is not None:
        row["meta"] = meta
    return row


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def battle():
    return make_battle


@pytest.fixture
def jsonl():
    return write_jsonl


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return tiny.build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")
