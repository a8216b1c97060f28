"""The lab notebook: the single source of truth of a lab, one SQLite file.

    nb = Notebook.open("lab/notebook.db")
    nb.open_session("s1", lab="lab", budget_gpuh=60, reserve_gpuh=2, planner="playbook", executor="local", config={})
    nb.record_decision("s1", "plan", "why", {"next": "sft"})
    nb.verify()            # re-walks the hash chain

SQLite in WAL mode, opened through sqlite-utils, so a reader (another process, `datasette
lab/notebook.db`) reads while the agent writes. Every write is one short explicit transaction
(BEGIN IMMEDIATE ... COMMIT): a process killed mid-write loses only the uncommitted transaction.
`synchronous=NORMAL` in WAL mode survives a killed process (not a power cut: the last commits may
then be lost, never corrupted). This module is the only one that writes SQL.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

import sqlite_utils
from pydantic import BaseModel, ConfigDict

from core.util import canonical_json, sha256_text
from memory.chain import GENESIS, decision_hash
from memory.schema import MIGRATIONS, SCHEMA_VERSION

DecisionKind = Literal[
    "open", "plan", "launch", "refuse", "compare", "promote", "reject", "calibrate",
    "register_bars", "ingest", "build", "evaluate", "confirm", "fail", "nominate", "stop",
]
JobState = Literal["pending", "running", "completed", "failed"]


class NotebookError(Exception):
    """A notebook operation that cannot proceed (bad schema version, unknown session, ...)."""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True)


class Session(_Record):
    name: str
    lab: str
    budget_gpuh: float
    reserve_gpuh: float
    planner: str
    executor: str
    config: dict[str, Any]
    status: str
    started_at: str
    ended_at: str | None


class Decision(_Record):
    seq: int
    session: str
    at: str
    kind: str
    rationale: str
    payload: dict[str, Any]
    prev_hash: str
    hash: str


class ToolCall(_Record):
    id: int
    session: str
    tool: str
    args: dict[str, Any]
    args_hash: str
    decision_seq: int | None
    job_key: str | None
    status: str
    result: dict[str, Any] | None
    started_at: str
    ended_at: str | None


class JobRecord(_Record):
    id: int
    key: str
    attempt: int
    session: str
    kind: str
    executor: str
    external_id: str | None
    folder: str | None
    resources: dict[str, Any]
    forecast_gpuh: float
    gpu_hours: float | None
    state: str
    failure_class: str | None
    failure_detail: str | None
    log_path: str | None
    result: dict[str, Any] | None
    submitted_at: str
    started_at: str | None
    ended_at: str | None
    fn: str | None = None  # the job function, "module:qualname" (None on rows from before schema 2)
    result_type: str | None = None  # its pydantic result model, "module:qualname"
    device_seconds: float | None = None  # measured seconds held x devices of the settled run
    charge: Literal["measured", "simulated"] | None = None  # how gpu_hours was settled from device_seconds


class Ledger(_Record):
    """GPU-hours of one session: spent (settled), reserved (forecasts of unsettled jobs), left."""

    budget_gpuh: float
    reserve_gpuh: float
    spent_gpuh: float
    reserved_gpuh: float

    @property
    def left_gpuh(self) -> float:
        return self.budget_gpuh - self.spent_gpuh - self.reserved_gpuh

    def admits(self, forecast_gpuh: float) -> bool:
        """Whether a job of this forecast fits while keeping the nomination reserve."""
        return forecast_gpuh + self.spent_gpuh + self.reserved_gpuh + self.reserve_gpuh <= self.budget_gpuh


class Artifact(_Record):
    id: int
    session: str | None
    kind: str
    name: str
    path: str
    sha256: str
    parents: list[int]
    recipe: dict[str, Any]
    job_key: str | None
    created_at: str


class EvalRecord(_Record):
    id: int
    session: str
    artifact_id: int
    suite: str
    replicate: int
    decoding: dict[str, Any]
    decoding_sha256: str
    served: bool
    metrics: dict[str, float]
    items: list[dict[str, Any]]
    job_key: str | None
    created_at: str


class NoiseFloor(_Record):
    id: int
    session: str
    suite: str
    metric: str
    k: int
    spread: float
    mean_abs_delta: float
    max_abs_t: float
    source_evals: list[int]
    created_at: str


class BarsRecord(_Record):
    id: int
    session: str
    spec: dict[str, Any]
    sha256: str
    registered_at: str


class Comparison(_Record):
    id: int
    session: str
    candidate: int
    incumbent: int
    bars_id: int
    verdicts: list[dict[str, Any]]
    promoted: bool
    adjustment: dict[str, Any]
    created_at: str


class FeedbackSplit(_Record):
    id: int
    session: str | None
    source_path: str
    source_sha256: str
    config: dict[str, Any]
    sha256: str
    counts: dict[str, Any]
    assignment: dict[str, str]
    created_at: str


class VerifyReport(_Record):
    """Outcome of re-walking the decision chain; `problem` names the first bad record."""

    ok: bool
    count: int
    head: str
    problem: str | None = None


# Columns stored as canonical JSON text, decoded when a row becomes a record.
_JSON_COLUMNS = {
    "config", "payload", "args", "result", "resources", "parents", "recipe", "decoding", "metrics",
    "items", "source_evals", "spec", "verdicts", "adjustment", "counts", "assignment",
}
_BOOL_COLUMNS = {"served", "promoted"}


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if key in _JSON_COLUMNS and value is not None:
            value = json.loads(value)
        elif key in _BOOL_COLUMNS:
            value = bool(value)
        out[key] = value
    return out


class Notebook:
    """Typed access to one lab notebook file. Open with `Notebook.open(path)`."""

    def __init__(self, db: sqlite_utils.Database, path: Path, readonly: bool):
        self.db = db
        self.path = path
        self.readonly = readonly

    # ---- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, readonly: bool = False) -> Notebook:
        """Open (creating and migrating if needed) a notebook; `readonly` never creates or writes."""
        path = Path(path)
        if readonly:
            if not path.exists():
                raise NotebookError(f"{path}: no notebook here")
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, timeout=30)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(path), isolation_level=None, timeout=30)
        conn.execute("PRAGMA busy_timeout = 30000")
        nb = cls(sqlite_utils.Database(conn), path, readonly)
        if not readonly:
            nb.db.enable_wal()
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            nb._migrate()
        nb._check_version()
        return nb

    def close(self) -> None:
        self.db.conn.close()

    def __enter__(self) -> Notebook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def _check_version(self) -> None:
        version = self._version()
        if version > SCHEMA_VERSION:
            raise NotebookError(
                f"{self.path}: notebook schema version {version} is newer than this code ({SCHEMA_VERSION})"
            )

    def _migrate(self) -> None:
        with self._tx():
            version = self._version()
            for target, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in _split_sql(script):
                    self.db.execute(statement)
                self.db.execute(f"PRAGMA user_version = {target}")

    @contextmanager
    def _tx(self) -> Iterator[None]:
        """One explicit write transaction; BEGIN IMMEDIATE serialises writers across processes."""
        if self.readonly:
            raise NotebookError(f"{self.path}: opened read-only")
        conn = self.db.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _insert(self, table: str, row: dict[str, Any]) -> int:
        row = {k: canonical_json(v) if k in _JSON_COLUMNS and v is not None else v for k, v in row.items()}
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        cur = self.db.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", list(row.values()))
        return cur.lastrowid

    def _update(self, table: str, where: str, params: list[Any], fields: dict[str, Any]) -> None:
        fields = {k: canonical_json(v) if k in _JSON_COLUMNS and v is not None else v for k, v in fields.items()}
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE {table} SET {sets} WHERE {where}", [*fields.values(), *params])

    def _rows(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        return [_decode(r) for r in self.db.query(sql, params)]

    def _one(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> dict[str, Any] | None:
        rows = self._rows(sql, params)
        return rows[0] if rows else None

    # ---- sessions ------------------------------------------------------------------------------

    def open_session(
        self, name: str, *, lab: str, budget_gpuh: float, reserve_gpuh: float, planner: str, executor: str,
        config: dict[str, Any],
    ) -> Session:
        """Create a session row and its opening decision in one transaction."""
        with self._tx():
            if self._one("SELECT name FROM session WHERE name = ?", [name]):
                raise NotebookError(f"session {name!r} already exists in {self.path}")
            self._insert("session", {
                "name": name, "lab": lab, "budget_gpuh": budget_gpuh, "reserve_gpuh": reserve_gpuh,
                "planner": planner, "executor": executor, "config": config, "status": "open",
                "started_at": now(),
            })
            self._append_decision(name, "open", "session opened", {
                "budget_gpuh": budget_gpuh, "reserve_gpuh": reserve_gpuh, "planner": planner,
                "executor": executor, "config_sha256": sha256_text(canonical_json(config)),
            })
        return self.session(name)

    def session(self, name: str) -> Session:
        row = self._one("SELECT * FROM session WHERE name = ?", [name])
        if row is None:
            raise NotebookError(f"no session {name!r} in {self.path}")
        return Session(**row)

    def sessions(self) -> list[Session]:
        return [Session(**r) for r in self._rows("SELECT * FROM session ORDER BY started_at")]

    def end_session(self, name: str, status: Literal["done", "failed", "stopped"], rationale: str) -> None:
        with self._tx():
            self._update("session", "name = ?", [name], {"status": status, "ended_at": now()})
            self._append_decision(name, "stop", rationale, {"status": status})

    # ---- decisions (append-only, hash-chained) -------------------------------------------------

    def record_decision(self, session: str, kind: DecisionKind, rationale: str, payload: dict[str, Any]) -> Decision:
        """Append one decision to the chain and return it."""
        with self._tx():
            return self._append_decision(session, kind, rationale, payload)

    def _append_decision(self, session: str, kind: str, rationale: str, payload: dict[str, Any]) -> Decision:
        # Must run inside _tx(): the head is read under the write lock, so two writers cannot fork the chain.
        head = self.db.execute("SELECT seq, hash FROM decision ORDER BY seq DESC LIMIT 1").fetchone()
        seq, prev = (head[0] + 1, head[1]) if head else (1, GENESIS)
        at, body = now(), canonical_json(payload)
        digest = decision_hash(prev, seq, session, at, kind, rationale, body)
        self._insert("decision", {
            "seq": seq, "session": session, "at": at, "kind": kind, "rationale": rationale,
            "payload": payload, "prev_hash": prev, "hash": digest,
        })
        return Decision(seq=seq, session=session, at=at, kind=kind, rationale=rationale, payload=payload,
                        prev_hash=prev, hash=digest)

    def decisions(self, session: str | None = None, kind: str | None = None) -> list[Decision]:
        sql, params = "SELECT * FROM decision WHERE 1=1", []
        if session is not None:
            sql, params = sql + " AND session = ?", [*params, session]
        if kind is not None:
            sql, params = sql + " AND kind = ?", [*params, kind]
        return [Decision(**r) for r in self._rows(sql + " ORDER BY seq", params)]

    def verify(self) -> VerifyReport:
        """Re-walk the whole chain in storage order; report the first record that does not fit."""
        prev, expected, count = GENESIS, 1, 0
        cursor = self.db.execute(
            "SELECT seq, session, at, kind, rationale, payload, prev_hash, hash FROM decision ORDER BY rowid"
        )
        for seq, session, at, kind, rationale, payload, prev_hash, digest in cursor:
            problem = None
            if seq != expected:
                problem = f"decision seq {seq}: expected seq {expected} (a decision was deleted or reordered)"
            elif prev_hash != prev:
                problem = f"decision seq {seq}: prev_hash does not match decision {seq - 1} (chain broken)"
            elif decision_hash(prev, seq, session, at, kind, rationale, payload) != digest:
                problem = f"decision seq {seq}: content does not match its hash (edited after it was written)"
            if problem:
                return VerifyReport(ok=False, count=count, head=prev, problem=problem)
            prev, expected, count = digest, expected + 1, count + 1
        return VerifyReport(ok=True, count=count, head=prev)

    # ---- tool calls ----------------------------------------------------------------------------

    def record_tool_call(
        self, session: str, tool: str, args: dict[str, Any], *, decision_seq: int | None = None,
        job_key: str | None = None,
    ) -> ToolCall:
        """Record a tool call before it runs; a repeat of the same (tool, args) returns the first."""
        args_hash = tool_call_key(tool, args)
        with self._tx():
            existing = self._one("SELECT * FROM tool_call WHERE session = ? AND args_hash = ?", [session, args_hash])
            if existing is None:
                self._insert("tool_call", {
                    "session": session, "tool": tool, "args": args, "args_hash": args_hash,
                    "decision_seq": decision_seq, "job_key": job_key, "status": "open", "started_at": now(),
                })
        return self.tool_call(session, args_hash)

    def tool_call(self, session: str, args_hash: str) -> ToolCall:
        row = self._one("SELECT * FROM tool_call WHERE session = ? AND args_hash = ?", [session, args_hash])
        if row is None:
            raise NotebookError(f"no tool call {args_hash[:12]} in session {session!r}")
        return ToolCall(**row)

    def finish_tool_call(
        self, call_id: int, status: Literal["done", "failed", "refused"], result: dict[str, Any],
    ) -> None:
        with self._tx():
            self._update("tool_call", "id = ?", [call_id], {"status": status, "result": result, "ended_at": now()})

    def tool_calls(self, session: str) -> list[ToolCall]:
        return [ToolCall(**r) for r in self._rows("SELECT * FROM tool_call WHERE session = ? ORDER BY id", [session])]

    # ---- jobs and the GPU-hour ledger ----------------------------------------------------------

    def start_job(
        self, key: str, *, session: str, kind: str, executor: str, resources: dict[str, Any],
        forecast_gpuh: float, attempt: int = 1, folder: str | None = None, fn: str | None = None,
        result_type: str | None = None,
    ) -> JobRecord:
        """Record a job attempt (state pending) before it is submitted; its forecast is reserved."""
        with self._tx():
            self._insert("job", {
                "key": key, "attempt": attempt, "session": session, "kind": kind, "executor": executor,
                "resources": resources, "forecast_gpuh": forecast_gpuh, "state": "pending", "folder": folder,
                "submitted_at": now(), "fn": fn, "result_type": result_type,
            })
        return self.get_job(key, attempt)

    def update_job(self, key: str, attempt: int, **fields: Any) -> JobRecord:
        """Update one attempt: state, external_id, started_at, ended_at, gpu_hours, failure_*, result..."""
        allowed = {"state", "external_id", "folder", "started_at", "ended_at", "gpu_hours", "failure_class",
                   "failure_detail", "log_path", "result", "device_seconds", "charge"}
        unknown = set(fields) - allowed
        if unknown:
            raise NotebookError(f"update_job: unknown fields {sorted(unknown)}")
        if "state" in fields and fields["state"] not in get_args(JobState):
            raise NotebookError(f"update_job: state {fields['state']!r} is not one of {get_args(JobState)}")
        with self._tx():
            self._update("job", "key = ? AND attempt = ?", [key, attempt], fields)
        return self.get_job(key, attempt)

    def get_job(self, key: str, attempt: int | None = None) -> JobRecord | None:
        """One attempt of a job, or its latest attempt when `attempt` is None."""
        if attempt is None:
            row = self._one("SELECT * FROM job WHERE key = ? ORDER BY attempt DESC LIMIT 1", [key])
        else:
            row = self._one("SELECT * FROM job WHERE key = ? AND attempt = ?", [key, attempt])
        return JobRecord(**row) if row else None

    def jobs(self, session: str | None = None, kind: str | None = None) -> list[JobRecord]:
        sql, params = "SELECT * FROM job WHERE 1=1", []
        if session is not None:
            sql, params = sql + " AND session = ?", [*params, session]
        if kind is not None:
            sql, params = sql + " AND kind = ?", [*params, kind]
        return [JobRecord(**r) for r in self._rows(sql + " ORDER BY id", params)]

    def ledger(self, session: str) -> Ledger:
        s = self.session(session)
        spent, reserved = self.db.execute(
            "SELECT COALESCE(SUM(gpu_hours), 0),"
            " COALESCE(SUM(CASE WHEN gpu_hours IS NULL THEN forecast_gpuh ELSE 0 END), 0)"
            " FROM job WHERE session = ?", [session],
        ).fetchone()
        return Ledger(budget_gpuh=s.budget_gpuh, reserve_gpuh=s.reserve_gpuh, spent_gpuh=spent, reserved_gpuh=reserved)

    # ---- artifacts -----------------------------------------------------------------------------

    def add_artifact(
        self, *, kind: str, name: str, path: str, sha256: str, parents: list[int] | None = None,
        recipe: dict[str, Any] | None = None, job_key: str | None = None, session: str | None = None,
    ) -> Artifact:
        with self._tx():
            rowid = self._insert("artifact", {
                "session": session, "kind": kind, "name": name, "path": path, "sha256": sha256,
                "parents": parents or [], "recipe": recipe or {}, "job_key": job_key, "created_at": now(),
            })
        return self.artifact(rowid)

    def artifact(self, artifact_id: int) -> Artifact:
        row = self._one("SELECT * FROM artifact WHERE id = ?", [artifact_id])
        if row is None:
            raise NotebookError(f"no artifact {artifact_id} in {self.path}")
        return Artifact(**row)

    def artifacts(self, kind: str | None = None, session: str | None = None) -> list[Artifact]:
        sql, params = "SELECT * FROM artifact WHERE 1=1", []
        if kind is not None:
            sql, params = sql + " AND kind = ?", [*params, kind]
        if session is not None:
            sql, params = sql + " AND session = ?", [*params, session]
        return [Artifact(**r) for r in self._rows(sql + " ORDER BY id", params)]

    # ---- evals, noise floors, bars, comparisons ------------------------------------------------

    def add_eval(
        self, *, session: str, artifact_id: int, suite: str, replicate: int, decoding: dict[str, Any],
        decoding_sha256: str, served: bool, metrics: dict[str, float], items: list[dict[str, Any]],
        job_key: str | None = None,
    ) -> EvalRecord:
        with self._tx():
            rowid = self._insert("eval", {
                "session": session, "artifact_id": artifact_id, "suite": suite, "replicate": replicate,
                "decoding": decoding, "decoding_sha256": decoding_sha256, "served": int(served),
                "metrics": metrics, "items": items, "job_key": job_key, "created_at": now(),
            })
        return self.eval(rowid)

    def eval(self, eval_id: int) -> EvalRecord:
        row = self._one("SELECT * FROM eval WHERE id = ?", [eval_id])
        if row is None:
            raise NotebookError(f"no eval {eval_id} in {self.path}")
        return EvalRecord(**row)

    def evals(self, *, artifact_id: int | None = None, suite: str | None = None,
              session: str | None = None) -> list[EvalRecord]:
        sql, params = "SELECT * FROM eval WHERE 1=1", []
        for column, value in (("artifact_id", artifact_id), ("suite", suite), ("session", session)):
            if value is not None:
                sql, params = sql + f" AND {column} = ?", [*params, value]
        return [EvalRecord(**r) for r in self._rows(sql + " ORDER BY id", params)]

    def add_noise_floor(
        self, *, session: str, suite: str, metric: str, k: int, spread: float, mean_abs_delta: float,
        max_abs_t: float, source_evals: list[int],
    ) -> NoiseFloor:
        with self._tx():
            rowid = self._insert("noise_floor", {
                "session": session, "suite": suite, "metric": metric, "k": k, "spread": spread,
                "mean_abs_delta": mean_abs_delta, "max_abs_t": max_abs_t, "source_evals": source_evals,
                "created_at": now(),
            })
        return NoiseFloor(**self._one("SELECT * FROM noise_floor WHERE id = ?", [rowid]))

    def noise_floors(self, session: str, suite: str, metric: str) -> list[NoiseFloor]:
        """Every calibration of (suite, metric) in a session, oldest first."""
        rows = self._rows("SELECT * FROM noise_floor WHERE session = ? AND suite = ? AND metric = ? ORDER BY id",
                          [session, suite, metric])
        return [NoiseFloor(**r) for r in rows]

    def register_bars(self, session: str, spec: dict[str, Any]) -> BarsRecord:
        """Store the canonical bars spec with its sha256 and time, plus a register_bars decision."""
        digest = sha256_text(canonical_json(spec))
        with self._tx():
            rowid = self._insert("bars", {"session": session, "spec": spec, "sha256": digest, "registered_at": now()})
            self._append_decision(session, "register_bars", "promotion bars registered before scoring",
                                  {"bars_id": rowid, "sha256": digest})
        return self.bars(rowid)

    def bars(self, bars_id: int) -> BarsRecord:
        row = self._one("SELECT * FROM bars WHERE id = ?", [bars_id])
        if row is None:
            raise NotebookError(f"no bars {bars_id} in {self.path}")
        return BarsRecord(**row)

    def add_comparison(
        self, *, session: str, candidate: int, incumbent: int, bars_id: int, verdicts: list[dict[str, Any]],
        promoted: bool, adjustment: dict[str, Any], rationale: str,
    ) -> Comparison:
        """Store a comparison and its promote/reject decision in one transaction."""
        with self._tx():
            rowid = self._insert("comparison", {
                "session": session, "candidate": candidate, "incumbent": incumbent, "bars_id": bars_id,
                "verdicts": verdicts, "promoted": int(promoted), "adjustment": adjustment, "created_at": now(),
            })
            self._append_decision(session, "promote" if promoted else "reject", rationale, {
                "comparison_id": rowid, "candidate": candidate, "incumbent": incumbent, "bars_id": bars_id,
            })
        return Comparison(**self._one("SELECT * FROM comparison WHERE id = ?", [rowid]))

    def comparisons(self, session: str) -> list[Comparison]:
        return [Comparison(**r) for r in self._rows("SELECT * FROM comparison WHERE session = ? ORDER BY id", [session])]

    # ---- feedback splits -----------------------------------------------------------------------

    def record_split(
        self, *, source_path: str, source_sha256: str, config: dict[str, Any], counts: dict[str, Any],
        assignment: dict[str, str], session: str | None = None,
    ) -> FeedbackSplit:
        """Store a feedback split; its sha256 covers the canonical id -> split assignment."""
        with self._tx():
            rowid = self._insert("feedback_split", {
                "session": session, "source_path": source_path, "source_sha256": source_sha256,
                "config": config, "sha256": sha256_text(canonical_json(assignment)), "counts": counts,
                "assignment": assignment, "created_at": now(),
            })
        return FeedbackSplit(**self._one("SELECT * FROM feedback_split WHERE id = ?", [rowid]))

    def latest_split(self, source_sha256: str | None = None) -> FeedbackSplit | None:
        sql, params = "SELECT * FROM feedback_split", []
        if source_sha256 is not None:
            sql, params = sql + " WHERE source_sha256 = ?", [source_sha256]
        row = self._one(sql + " ORDER BY id DESC LIMIT 1", params)
        return FeedbackSplit(**row) if row else None


def tool_call_key(tool: str, args: dict[str, Any]) -> str:
    """Idempotency key of a tool call: sha256 of the tool name and its canonical arguments."""
    return sha256_text(f"{tool}\n{canonical_json(args)}")


def _split_sql(script: str) -> list[str]:
    """Split a migration into statements, keeping trigger bodies (BEGIN ... END;) whole."""
    statements, current = [], []
    for line in script.splitlines():
        if line.strip().startswith("--") or not line.strip():
            continue
        current.append(line)
        text = "\n".join(current)
        if sqlite3.complete_statement(text):
            statements.append(text)
            current = []
    return statements
