"""Tokenize a dataset once: an Arrow cache keyed by the data file's sha256, the tokenizer and the rendering settings.

`<data dir>/token_cache/<key>/` holds a `datasets` Arrow table, one row per data row: `input_ids`, `loss_mask`,
`truncated` (for preference pairs, the same for the chosen and the rejected side, and `dropped`). Rank 0 builds it
(`Dataset.map` over `num_proc` worker processes), writes it to a temporary directory and renames it into place; the
other ranks wait, then every rank memory-maps the same files (the page cache holds one copy per node). A requeued
job, a second rank and any later run on the same data, tokenizer and settings read it instead of tokenizing again.

The key covers everything the encoding depends on: CACHE_FORMAT (bump when rendering changes), the trainer kind,
the data file's and tokenizer.json's sha256, the chat template's and the rendering settings (system prompt, length
limits).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import lru_cache, partial
from pathlib import Path

from pydantic import BaseModel

from core import chat
from core.util import file_sha256, sha256_text
from trainers import distributed
from trainers.batch import Encoded, cut_answer, encode

CACHE_FORMAT = 2  # 2: rows rendered in the model's own chat template (core.chat), not always ChatML


@lru_cache(maxsize=2)
def _tokenizer(path: str):
    from core import loading

    return loading.load_tokenizer(path)


def _encode_messages(row: dict, *, tokenizer_path: str, system_prompt: str | None, max_len: int) -> dict:
    e = encode(_tokenizer(tokenizer_path), row["messages"], system_prompt, max_len)
    return {"input_ids": e.input_ids, "loss_mask": e.loss_mask, "truncated": e.truncated}


def _encode_pair(row: dict, *, tokenizer_path: str, settings: dict) -> dict:
    tok = _tokenizer(tokenizer_path)
    sides = {side: cut_answer(tok, row["prompt"], row[side], **settings) for side in ("chosen", "rejected")}
    dropped = any(e is None for e in sides.values())
    out: dict = {"dropped": dropped}
    for side, e in sides.items():
        e = e or Encoded([], [], False)
        out |= {f"{side}_input_ids": e.input_ids, f"{side}_loss_mask": e.loss_mask, f"{side}_truncated": e.truncated}
    return out


def cache_key(kind: str, data_path: Path, tokenizer_path: Path, settings: dict) -> str:
    parts = {"format": CACHE_FORMAT, "kind": kind, "data": file_sha256(data_path),
             "tokenizer": file_sha256(tokenizer_path / "tokenizer.json"), "settings": settings,
             "template": sha256_text(chat.template_of(_tokenizer(str(tokenizer_path))))}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _cached(kind: str, rows: list[BaseModel], data_path: Path, tokenizer_path: Path, settings: dict, fn,
            num_proc: int):
    """The Arrow table for (data, tokenizer, settings), built by rank 0 if absent; and whether it was reused.
    `rows` are the data file's rows as the trainer validated them."""
    from datasets import Dataset, load_from_disk

    root = data_path.parent / "token_cache" / cache_key(kind, data_path, tokenizer_path, settings)
    reused = distributed.broadcast_object(root.is_dir())
    if not reused and distributed.setup().is_main:
        plain = [r.model_dump(mode="json") for r in rows]
        table = Dataset.from_list(plain).map(fn, num_proc=num_proc if num_proc > 1 else None,
                                             remove_columns=list(plain[0]))
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        table.save_to_disk(str(tmp))
        try:
            tmp.rename(root)
        except OSError:  # another job on the same data finished first: its identical table stays
            shutil.rmtree(tmp)
    distributed.barrier()
    return load_from_disk(str(root)), reused


def _num_proc() -> int:
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def encoded_rows(rows: list[BaseModel], data_path: Path, tokenizer_path: Path, system_prompt: str | None,
                 max_len: int, kind: str) -> tuple[list[Encoded], bool]:
    """Chat rows (SFT, KL-CE): one Encoded per data row, and whether the cache was reused."""
    settings = {"system_prompt": system_prompt, "max_len": max_len}
    fn = partial(_encode_messages, tokenizer_path=str(tokenizer_path), **settings)
    table, reused = _cached(kind, rows, data_path, tokenizer_path, settings, fn, _num_proc())
    cols = table.to_dict()
    return [Encoded(i, m, t) for i, m, t in zip(cols["input_ids"], cols["loss_mask"], cols["truncated"],
                                                strict=True)], reused


def encoded_pairs(rows: list[BaseModel], data_path: Path, tokenizer_path: Path, system_prompt: str | None,
                  max_len: int, max_prompt_length: int | None,
                  max_completion_length: int | None) -> tuple[list[tuple[Encoded, Encoded] | None], bool]:
    """Preference rows (DPO): (chosen, rejected) per data row, None where the pair was dropped by its length
    limits; and whether the cache was reused."""
    settings = {"system_prompt": system_prompt, "max_len": max_len, "max_prompt_length": max_prompt_length,
                "max_completion_length": max_completion_length}
    fn = partial(_encode_pair, tokenizer_path=str(tokenizer_path), settings=settings)
    table, reused = _cached("dpo", rows, data_path, tokenizer_path, settings, fn, _num_proc())
    cols = table.to_dict()
    out = []
    for i, dropped in enumerate(cols["dropped"]):
        def side(name, i=i):
            return Encoded(cols[f"{name}_input_ids"][i], cols[f"{name}_loss_mask"][i], cols[f"{name}_truncated"][i])

        out.append(None if dropped else (side("chosen"), side("rejected")))
    return out, reused
