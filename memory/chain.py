"""Canonical JSON and the decision hash chain.

Each decision's hash is sha256(prev_hash || "\\n" || canonical record), where the canonical record
is the JSON of (seq, session, at, kind, rationale, payload) with sorted keys and no whitespace. An
edit changes that record's hash; a deletion or reordering breaks the seq sequence or a prev_hash
link, so a re-walk names the first bad record. Eval rows (schema V5 on) are chained too: a decision's record
also holds the [id, digest] of each eval row its session wrote since its previous decision (the rows the
decision records), and an eval row written after the first chained one must be in some decision's record. From schema
V6 on, tool calls (once finished: their status and result are final), artifacts (their paths and hashes), noise
floors, bars, comparisons and feedback splits are chained the same way, each under its own record key (COVERED); from
V8 on, job attempts too (once settled: their state, cost and result are final; the budget ledger sums their GPU-hours).
A decision that chains none of a kind has no such key, so every older chain verifies unchanged.
(The construction is a plain hash chain, as in
Haber & Stornetta, "How to time-stamp a digital document", 1991.)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from core.util import canonical_json

GENESIS = "0" * 64


# The eval columns a digest covers (all of the row but its chaining): what the planner, the report and the card read.
EVAL_COLUMNS = ("id", "session", "artifact_id", "suite", "replicate", "decoding", "decoding_sha256", "served",
                "metrics", "items", "job_key", "created_at")


# The tool-call and artifact columns a digest covers: the whole row but its chaining.
TOOL_CALL_COLUMNS = ("id", "session", "tool", "args", "args_hash", "decision_seq", "job_key", "status", "result",
                     "started_at", "ended_at")
ARTIFACT_COLUMNS = ("id", "session", "kind", "name", "path", "sha256", "parents", "recipe", "job_key", "created_at")
# The rows the judgments read back (noise floors, bars, comparisons) and the feedback splits a session's data comes from.
NOISE_FLOOR_COLUMNS = ("id", "session", "suite", "metric", "k", "spread", "mean_abs_delta", "max_abs_t", "source_evals",
                       "created_at")
BARS_COLUMNS = ("id", "session", "spec", "sha256", "registered_at")
COMPARISON_COLUMNS = ("id", "session", "candidate", "incumbent", "bars_id", "verdicts", "promoted", "adjustment",
                      "created_at")
SPLIT_COLUMNS = ("id", "session", "source_path", "source_sha256", "config", "sha256", "counts", "assignment", "created_at")
# A job attempt's columns: what the ledger sums (gpu_hours, forecast_gpuh; device_seconds and charge say how it was
# settled), where it ran and its forecast (resources), its state and failure class, and its result (the artifacts and
# metrics the tools record from it). All of the row but failure_detail, a line for a person that a refused requeue
# extends after the attempt is settled (launcher `_refuse_requeue`); the `fail` decision's payload holds it, chained.
JOB_COLUMNS = ("id", "key", "attempt", "session", "kind", "executor", "external_id", "folder", "resources",
               "forecast_gpuh", "gpu_hours", "state", "failure_class", "log_path", "result", "submitted_at", "started_at",
               "ended_at", "fn", "result_type", "device_seconds", "charge")


@dataclass(frozen=True)
class Covered:
    """A table whose rows are chained into decisions: the key of its [id, digest] list in a decision's record, the
    columns hashed, the columns that hold the covering decision's seq and the row's digest at chaining, the condition
    a row meets once it is final (None: at once), and the schema version its chaining starts at."""

    table: str
    key: str
    columns: tuple[str, ...]
    seq_column: str
    digest_column: str
    final: str | None
    since: int


COVERED = (
    Covered("eval", "evals", EVAL_COLUMNS, "decision_seq", "sha256", None, 5),
    Covered("tool_call", "tool_calls", TOOL_CALL_COLUMNS, "chain_seq", "chain_sha256", "status != 'open'", 6),
    Covered("artifact", "artifacts", ARTIFACT_COLUMNS, "chain_seq", "chain_sha256", None, 6),
    Covered("noise_floor", "noise_floors", NOISE_FLOOR_COLUMNS, "chain_seq", "chain_sha256", None, 6),
    Covered("bars", "bars", BARS_COLUMNS, "chain_seq", "chain_sha256", None, 6),
    Covered("comparison", "comparisons", COMPARISON_COLUMNS, "chain_seq", "chain_sha256", None, 6),
    Covered("feedback_split", "splits", SPLIT_COLUMNS, "chain_seq", "chain_sha256", None, 6),
    Covered("job", "jobs", JOB_COLUMNS, "chain_seq", "chain_sha256", "state IN ('completed', 'failed')", 8),
)


def decision_hash(prev_hash: str, seq: int, session: str, at: str, kind: str, rationale: str, payload: str,
                  evals: str | None = None, **covered: str | None) -> str:
    """Hash of one decision; `payload` is already canonical JSON text, `evals` (and each of `covered`, by its COVERED
    key: tool_calls, artifacts) the canonical list of [row id, row_digest] of the rows chained into it (None when none
    are: the record is then exactly the one a decision had before such rows were chained, so older chains verify
    unchanged)."""
    fields = {"seq": seq, "session": session, "at": at, "kind": kind, "rationale": rationale, "payload": payload}
    chained = {k: v for k, v in ({"evals": evals} | covered).items() if v is not None}
    record = canonical_json(fields | chained)
    return hashlib.sha256(f"{prev_hash}\n{record}".encode()).hexdigest()


def row_digest(row: tuple) -> str:
    """sha256 of one covered row's columns as stored (the JSON columns are canonical text already); a REAL column that
    is not finite (a noise floor's max |t| of two identical replicates is inf) is hashed as its text."""
    values = [repr(v) if isinstance(v, float) and not math.isfinite(v) else v for v in row]
    return hashlib.sha256(canonical_json(values).encode()).hexdigest()


eval_digest = row_digest  # an eval row's digest (EVAL_COLUMNS), by its older name


def evals_text(chained: list[tuple[int, str]]) -> str | None:
    """The `evals` part of a decision's record: canonical [[id, digest], ...] in id order, None for no evals."""
    return canonical_json([list(c) for c in sorted(chained)]) if chained else None
