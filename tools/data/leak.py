"""Leak audit: no training prompt may reappear in a holdout or an eval suite (DESIGN.md invariant 1).

Two checks per training prompt, both on normalized text (NFKC, case-folded, words only, so changes of
whitespace, case and punctuation do not hide a copy):

- exact: the sha256 of the normalized prompt equals that of a reference prompt;
- n-gram: the prompt shares any word n-gram (default n = 13) with a reference prompt, which catches a
  holdout prompt pasted inside a longer one. 13-grams follow the contamination checks of GPT-3
  (Brown et al., 2020, appendix C).
- short reference inside: a reference of SHORT_MIN..n-1 words has no n-gram at all, so the whole
  of its word sequence is the gram (GPT-3 appendix C likewise shortens N to the task's prompt
  length, with a minimum of 8 words against spurious collisions). Chat prompts are often this short.

A prompt's text is its user turns only: system prompts and earlier assistant turns are shared
boilerplate or model output, and would make every conversation collide with every other one.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from core.util import canonical_json

DEFAULT_NGRAM = 13
SHORT_MIN = 8  # shortest reference matched inside longer prompts (GPT-3 appendix C's minimum N)
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """The normalized words of `text`: NFKC, case-folded, punctuation and whitespace dropped."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).casefold())


def normalized_hash(text: str) -> str:
    """sha256 of the normalized text: equal for copies that differ only in case, spacing or punctuation."""
    return hashlib.sha256(" ".join(words(text)).encode()).hexdigest()


def ngrams(text: str, n: int = DEFAULT_NGRAM) -> set[str]:
    """Every word n-gram of the normalized text, as space-joined strings (none if shorter than n)."""
    ws = words(text)
    return {" ".join(ws[i : i + n]) for i in range(len(ws) - n + 1)}


def short_sequence(text: str, n: int = DEFAULT_NGRAM) -> str | None:
    """The whole normalized word sequence of a SHORT_MIN..n-1 word text (its only n-gram-like key)."""
    ws = words(text)
    return " ".join(ws) if SHORT_MIN <= len(ws) < n else None


def prompt_text(messages: Sequence[dict]) -> str:
    """The audited text of a conversation: its user turns, one per line."""
    return "\n".join(m["content"] for m in messages if m["role"] == "user")


class Reference(BaseModel):
    """One prompt the training data must not contain."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(description="Where the prompt comes from: 'dev', 'sealed' or 'eval:<suite file>'.")
    key: str = Field(description="The prompt's id within its source (battle id, eval item id or row number).")
    text: str = Field(description="The prompt text (user turns).")


class LeakHit(BaseModel):
    """A training row whose prompt matches a reference prompt."""

    model_config = ConfigDict(extra="forbid")

    row: int = Field(description="0-based index of the offending training row in the built dataset.")
    row_id: str | None = Field(None, description="The offending row's id, when rows carry one.")
    kind: str = Field(description="'exact' (normalized-text hash equality) or 'ngram' (a shared word n-gram, or a "
                                  "whole short reference of SHORT_MIN..n-1 words inside the prompt).")
    source: str = Field(description="The reference's source ('dev', 'sealed', 'eval:...').")
    key: str = Field(description="The reference's id within its source.")
    ngram: str | None = Field(None, description="The shared n-gram (normalized), for kind 'ngram'.")


class AuditResult(BaseModel):
    """What a leak audit checked and what it found; part of every dataset manifest."""

    model_config = ConfigDict(extra="forbid")

    ngram: int = Field(description="The word n-gram length used for the overlap check.")
    short_min: int = Field(SHORT_MIN, description="References of short_min..ngram-1 words are matched whole inside prompts.")
    rows_checked: int = Field(description="Number of training prompts checked.")
    references: dict[str, int] = Field(description="Number of reference prompts per source.")
    references_sha256: str = Field(description="sha256 over the sorted normalized hashes of all reference prompts.")
    hits: list[LeakHit] = Field(description="Every training row that matched a reference, in row order.")

    @property
    def passed(self) -> bool:
        return not self.hits

    def sha256(self) -> str:
        """sha256 of the canonical JSON of this result: the value a manifest and a model card cite."""
        return hashlib.sha256(canonical_json(self.model_dump(mode="json")).encode()).hexdigest()


class ReferenceIndex:
    """Reference prompts indexed by normalized hash and by n-gram, for one pass over the training rows."""

    def __init__(self, references: Iterable[Reference], n: int):
        self.n = n
        self.by_hash: dict[str, Reference] = {}
        self.by_ngram: dict[str, Reference] = {}
        self.by_short: dict[int, dict[str, Reference]] = {}  # word length -> whole short reference
        self.counts: dict[str, int] = {}
        for ref in references:
            self.add(ref)

    def add(self, ref: Reference) -> None:
        """Index one more reference (the toy world grows its index while drawing disjoint prompts)."""
        self.counts[ref.source] = self.counts.get(ref.source, 0) + 1
        self.by_hash.setdefault(normalized_hash(ref.text), ref)
        for g in ngrams(ref.text, self.n):
            self.by_ngram.setdefault(g, ref)
        short = short_sequence(ref.text, self.n)
        if short is not None:
            self.by_short.setdefault(len(short.split()), {}).setdefault(short, ref)

    def _gram_hit(self, row: int, text: str) -> LeakHit | None:
        """A shared n-gram, else a whole short reference found among the prompt's grams of its length."""
        tables = [(self.n, self.by_ngram)] + sorted(self.by_short.items())
        for length, table in tables:
            for g in sorted(ngrams(text, length)):
                ref = table.get(g)
                if ref is not None:
                    return LeakHit(row=row, kind="ngram", source=ref.source, key=ref.key, ngram=g)
        return None

    def match(self, row: int, text: str) -> LeakHit | None:
        ref = self.by_hash.get(normalized_hash(text))
        if ref is not None:
            return LeakHit(row=row, kind="exact", source=ref.source, key=ref.key)
        return self._gram_hit(row, text)


def audit(prompts: Iterable[str], references: Sequence[Reference], n: int = DEFAULT_NGRAM,
          ids: Sequence[str | None] | None = None) -> AuditResult:
    """Check every training prompt (in row order; `ids` names the rows in hits) against every reference."""
    index = ReferenceIndex(references, n)
    hits, rows = [], 0
    for row, text in enumerate(prompts):
        rows += 1
        hit = index.match(row, text)
        if hit is not None:
            hits.append(hit.model_copy(update={"row_id": ids[row] if ids is not None else None}))
    ref_hashes = sorted(normalized_hash(r.text) for r in references)
    return AuditResult(
        ngram=n,
        rows_checked=rows,
        references=dict(sorted(index.counts.items())),
        references_sha256=hashlib.sha256("\n".join(ref_hashes).encode()).hexdigest(),
        hits=hits,
    )
