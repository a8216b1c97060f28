"""Canonical JSON and the decision hash chain.

Each decision's hash is sha256(prev_hash || "\\n" || canonical record), where the canonical record
is the JSON of (seq, session, at, kind, rationale, payload) with sorted keys and no whitespace. An
edit changes that record's hash; a deletion or reordering breaks the seq sequence or a prev_hash
link, so a re-walk names the first bad record. Eval rows (schema V5 on) are chained too: a decision's record
also holds the [id, digest] of each eval row its session wrote since its previous decision (the rows the
decision records), and an eval row written after the first chained one must be in some decision's record.
(The construction is a plain hash chain, as in
Haber & Stornetta, "How to time-stamp a digital document", 1991.)
"""

from __future__ import annotations

import hashlib

from core.util import canonical_json

GENESIS = "0" * 64


# The eval columns a digest covers (all of the row but its chaining): what the planner, the report and the card read.
EVAL_COLUMNS = ("id", "session", "artifact_id", "suite", "replicate", "decoding", "decoding_sha256", "served",
                "metrics", "items", "job_key", "created_at")


def decision_hash(prev_hash: str, seq: int, session: str, at: str, kind: str, rationale: str, payload: str,
                  evals: str | None = None) -> str:
    """Hash of one decision; `payload` is already canonical JSON text, `evals` the canonical list of [eval id,
    eval_digest] of the eval rows chained into it (None when none are: the record is then exactly the one a
    decision had before evals were chained, so older chains verify unchanged)."""
    fields = {"seq": seq, "session": session, "at": at, "kind": kind, "rationale": rationale, "payload": payload}
    record = canonical_json(fields if evals is None else fields | {"evals": evals})
    return hashlib.sha256(f"{prev_hash}\n{record}".encode()).hexdigest()


def eval_digest(row: tuple) -> str:
    """sha256 of one eval row's EVAL_COLUMNS values as stored (the JSON columns are canonical text already)."""
    return hashlib.sha256(canonical_json(list(row)).encode()).hexdigest()


def evals_text(chained: list[tuple[int, str]]) -> str | None:
    """The `evals` part of a decision's record: canonical [[id, digest], ...] in id order, None for no evals."""
    return canonical_json([list(c) for c in sorted(chained)]) if chained else None
