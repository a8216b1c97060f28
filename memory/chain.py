"""Canonical JSON and the decision hash chain.

Each decision's hash is sha256(prev_hash || "\\n" || canonical record), where the canonical record
is the JSON of (seq, session, at, kind, rationale, payload) with sorted keys and no whitespace. An
edit changes that record's hash; a deletion or reordering breaks the seq sequence or a prev_hash
link, so a re-walk names the first bad record. (The construction is a plain hash chain, as in
Haber & Stornetta, "How to time-stamp a digital document", 1991.)
"""

from __future__ import annotations

import hashlib

from core.util import canonical_json

GENESIS = "0" * 64


def decision_hash(prev_hash: str, seq: int, session: str, at: str, kind: str, rationale: str, payload: str) -> str:
    """Hash of one decision; `payload` is already canonical JSON text."""
    record = canonical_json(
        {"seq": seq, "session": session, "at": at, "kind": kind, "rationale": rationale, "payload": payload}
    )
    return hashlib.sha256(f"{prev_hash}\n{record}".encode()).hexdigest()
