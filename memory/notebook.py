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
import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import sqlite_utils
from pydantic import BaseModel, TypeAdapter, ValidationError

from core.redact import redact, redact_data
from core.util import canonical_json, sha256_text
from memory.chain import COVERED, GENESIS, JOB_COLUMNS, Covered, decision_hash, evals_text, row_digest
from memory.place import Place
from memory.records import (
    DECISION,
    PAYLOADS,
    Adjustment,
    Artifact,
    BarsRecord,
    BarsSpec,
    BarVerdict,
    ChatTemplateRef,
    Comparison,
    Decision,
    DecisionKind,
    EvalRecord,
    FailureClass,
    FeedbackSplit,
    JobRecord,
    JobState,
    Ledger,
    NoiseFloor,
    OpenPayload,
    Session,
    ToolCall,
    VerifyReport,
)
from memory.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    expected_columns,
    file_problem,
    split_sql,
)

__all__ = [  # the records are defined in memory/records.py and re-exported here for callers
    "Artifact", "BarsRecord", "ChatTemplateRef", "Comparison", "Decision", "DecisionKind", "EvalRecord", "FailureClass", "FeedbackSplit",
    "JobRecord", "JobState", "Ledger", "NoiseFloor", "Notebook", "NotebookError", "Session", "ToolCall",
    "VerifyReport", "now", "session_sha256", "tool_call_key",
]

class NotebookError(Exception):
    """A notebook that cannot be used (damaged, wrong schema version, unknown record) or a write it refuses.

    Its message is one line naming the file and the record; the CLI prints it and exits 2.
    """


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def session_sha256(session: Session) -> str:
    """sha256 of a session row as its `open` decision vouches for it: every field but status and
    ended_at, the two that legitimately change when the session ends."""
    return sha256_text(canonical_json(session.model_dump(mode="json", exclude={"status", "ended_at"})))


# Columns stored as canonical JSON text, decoded when a row becomes a record.
_JSON_COLUMNS = {
    "config", "payload", "args", "result", "resources", "parents", "recipe", "decoding", "metrics",
    "items", "source_evals", "spec", "verdicts", "adjustment", "counts", "assignment",
}
_BOOL_COLUMNS = {"served", "promoted"}
# Columns that may hold paths into the lab (or text naming them): stored lab-relative, read at the lab's current
# location (memory/place.py). Not tool_call.args (ids only, hashed as the caller passed them) nor eval rows (numbers
# and per-item outcomes) nor session.lab (where the session ran: the location old records are read from).
_PLACED_COLUMNS = {"config", "payload", "rationale", "result", "resources", "folder", "log_path", "failure_detail",
                   "path", "recipe", "source_path"}
_TABLE = re.compile(r"\bFROM\s+(\w+)", re.IGNORECASE)
R = TypeVar("R", bound=BaseModel)


def _decode(row: dict[str, Any], where: str, place: Place | None) -> dict[str, Any]:
    """A stored row as a record's fields; `place`: paths into the lab resolved at its current location (None: as
    stored, for the checks that hash what is stored)."""
    out = {}
    for key, value in row.items():
        if key in _JSON_COLUMNS and value is not None:
            try:
                value = json.loads(value)
            except (TypeError, ValueError) as err:  # JSONDecodeError, or bytes that are not UTF-8
                raise NotebookError(f"{where} {_row_name(row)}: column {key} is not JSON ({err})") from None
        elif key in _BOOL_COLUMNS:
            value = bool(value)
        if place is not None and key in _PLACED_COLUMNS:
            value = place.resolved(value)
        out[key] = value
    return out


def _json_object(text: str) -> dict[str, Any]:
    """A stored payload as a dict; {} when it is not a JSON object (verify then names the mismatch)."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _row_name(row: dict[str, Any]) -> str:
    for key in ("id", "seq", "name"):
        if key in row:
            return f"{key} {row[key]!r}"
    return "row"


def _in_memory(conn: sqlite3.Connection) -> sqlite3.Connection:
    """A copy of `conn`'s database in memory, taken in one read transaction (the backup API copies every page in
    one step); `conn` is closed."""
    copy = sqlite3.connect(":memory:", isolation_level=None)
    try:
        conn.backup(copy, pages=-1)
    finally:
        conn.close()
    return copy


class Notebook:
    """Typed access to one lab notebook file. Open with `Notebook.open(path)`."""

    def __init__(self, db: sqlite_utils.Database, path: Path, readonly: bool, lab: Path | None = None):
        self.db = db
        self.path = path
        self.readonly = readonly
        # The lab this notebook records (its directory, unless a scratch copy elsewhere says which): paths into it
        # are stored lab-relative and read where it is now. The locations its sessions recorded are added on opening.
        self.place = Place.of(lab if lab is not None else path.parent)
        self._depth = 0  # nesting of transaction(): 0 outside, 1 in the outer one, more in savepoints

    # ---- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, readonly: bool = False, lab: Path | None = None,
             snapshot: bool = False) -> Notebook:
        """Open (creating and migrating if needed) a notebook; `readonly` never creates or writes.

        `lab`: the lab directory it records, when the file lies elsewhere (replay's scratch notebook); by default
        its own directory. `snapshot` (read-only): read one consistent copy of the file, taken in one read
        transaction through SQLite's backup API into memory, so that a reader that asks many questions (replay)
        sees one state of a notebook another process is writing, not a mix of before and after its commits.

        A damaged file (not SQLite, truncated, empty, a directory, a damaged page, a table or column
        missing, a schema version this code never wrote, a session row that does not parse) raises
        NotebookError with one line naming it; nothing is written to it.

        A read-only handle opened while no writer has the file open reads it as immutable (so it
        leaves no -wal/-shm behind) and does not see writes that start later; one opened while a
        writer is active (its -wal exists) reads the writer's commits as they land.
        """
        path = Path(path)
        existed = path.exists()
        problem = file_problem(path) if existed else "no notebook here" if readonly else None
        if problem:
            raise NotebookError(f"{path}: {problem}")
        try:
            conn = cls._connect(path, readonly)
            if snapshot and readonly:
                conn = _in_memory(conn)
        except (OSError, sqlite3.Error) as err:
            raise NotebookError(f"{path}: cannot open the notebook: {err}") from None
        nb = cls(sqlite_utils.Database(conn), path, readonly, lab)
        try:
            nb._prepare(existed)
        except (NotebookError, sqlite3.DatabaseError) as err:
            conn.close()
            if isinstance(err, NotebookError):
                raise
            raise NotebookError(f"{path}: not a readable notebook: {err}") from None
        return nb

    @staticmethod
    def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
        if readonly:
            # With no -wal/-shm beside it the file is fully checkpointed: read it as immutable, which
            # creates no -wal/-shm of its own. A live writer's WAL must be read, so then plain mode=ro.
            live = any(path.with_name(path.name + s).exists() for s in ("-wal", "-shm"))
            uri = path.absolute().as_uri() + ("?mode=ro" if live else "?mode=ro&immutable=1")
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(path), isolation_level=None, timeout=30)
        conn.execute("PRAGMA busy_timeout = 30000")
        return conn

    def _prepare(self, existed: bool) -> None:
        """Check the version, migrate (writable) and check the tables the version must have."""
        self._check_damage()
        self._check_version(existed)
        if self._version():
            self._check_tables()  # before migrating: a damaged notebook is named, never half-upgraded
        if not self.readonly:
            self.db.enable_wal()
            self.db.execute("PRAGMA synchronous = NORMAL")
            self.db.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        self._check_tables()
        self.place = self.place.with_recorded(*(r[0] for r in self.db.execute("SELECT DISTINCT lab FROM session")))
        self.sessions()  # a session row that does not parse (its config not JSON) is named now, not mid-run

    def close(self) -> None:
        self.db.conn.close()

    def __enter__(self) -> Notebook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def _tables(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]

    def _check_version(self, existed: bool) -> None:
        version = self._version()
        if version > SCHEMA_VERSION:
            raise NotebookError(
                f"{self.path}: notebook schema version {version} is newer than this code ({SCHEMA_VERSION})"
            )
        if version < 0:
            raise NotebookError(f"{self.path}: schema version {version} (PRAGMA user_version) is not one "
                                "this code writes: not a notebook, or its header was edited")
        if version == 0 and self._tables():
            raise NotebookError(f"{self.path}: holds tables ({', '.join(self._tables()[:3])}, ...) but schema "
                                "version 0: not a notebook this code wrote, or its version was reset")
        if version == 0 and existed:
            # Only a path that did not exist becomes a new notebook: an existing database with no
            # tables is someone else's file, or a notebook whose first write never committed.
            raise NotebookError(f"{self.path}: an empty SQLite database (no tables), not a notebook; "
                                "remove it to start a new one")

    def _check_damage(self) -> None:
        """SQLite's own page-level check (0.3 s on a 43 MB notebook of 100,000 decisions, measured on
        the shared 2-core machine at load 10): a damaged page is found on opening, not mid-session,
        wherever it lies (an index, the free list, a row no query reads)."""
        try:
            damage = self.db.execute("PRAGMA quick_check(1)").fetchone()[0]
        except sqlite3.DatabaseError as err:  # a page so damaged that the check itself cannot read it
            raise NotebookError(f"{self.path}: the file is damaged: {err}") from None
        if damage != "ok":
            detail = " ".join(damage.replace("*** in database main ***", "").split())
            raise NotebookError(f"{self.path}: the file is damaged: {detail}")

    def _check_tables(self) -> None:
        """Every table and column the schema version promises is there (a dropped table is named)."""
        version = self._version()
        actual = {t: {r[1] for r in self.db.execute(f"PRAGMA table_info({t})")} for t in self._tables()}
        for table, columns in sorted(expected_columns(version).items()):
            if table not in actual:
                raise NotebookError(f"{self.path}: table {table} is missing (schema version {version})")
            missing = sorted(columns - actual[table])
            if missing:
                raise NotebookError(f"{self.path}: table {table} lacks column(s) {', '.join(missing)} "
                                    f"(schema version {version})")

    def _migrate(self) -> None:
        with self.transaction():
            version = self._version()
            for target, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in split_sql(script):
                    self.db.execute(statement)
                self.db.execute(f"PRAGMA user_version = {target}")

    # ---- transactions and rows -----------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic write: every write method called inside joins it, so all land or none do.

            with nb.transaction():
                call = nb.record_tool_call(...)
                nb.start_job(...)
                nb.record_decision(...)

        The outer block is BEGIN IMMEDIATE ... COMMIT (it serialises writers across processes and
        takes the decision chain's head under the lock); a nested block is a SAVEPOINT inside it,
        so an exception caught around the nested block undoes only that block's writes, and an
        exception leaving the outer block undoes everything.
        """
        if self.readonly:
            raise NotebookError(f"{self.path}: opened read-only")
        conn = self.db.conn
        if self._depth:
            name = f"nested_{self._depth}"
            begin, commit, undo = f"SAVEPOINT {name}", f"RELEASE {name}", f"ROLLBACK TO {name}; RELEASE {name}"
        else:
            begin, commit, undo = "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"
        conn.execute(begin)
        self._depth += 1
        try:
            yield
            conn.execute(commit)
        except BaseException:
            for statement in undo.split("; "):
                conn.execute(statement)
            raise
        finally:
            self._depth -= 1

    def _insert(self, table: str, row: dict[str, Any]) -> int:
        # Every row passes here (and _update): secrets the process holds never reach the file (core/redact.py),
        # and paths into the lab are stored lab-relative (memory/place.py).
        row = self._stored(redact_data(row))
        row = {k: canonical_json(v) if k in _JSON_COLUMNS and v is not None else v for k, v in row.items()}
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        cur = self.db.execute(f"INSERT INTO {table} ({cols}) VALUES ({marks})", list(row.values()))
        return cur.lastrowid

    def _update(self, table: str, where: str, params: list[Any], fields: dict[str, Any]) -> None:
        fields = self._stored(redact_data(fields))
        fields = {k: canonical_json(v) if k in _JSON_COLUMNS and v is not None else v for k, v in fields.items()}
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE {table} SET {sets} WHERE {where}", [*fields.values(), *params])

    def _stored(self, row: dict[str, Any]) -> dict[str, Any]:
        return {k: self.place.stored(v) if k in _PLACED_COLUMNS else v for k, v in row.items()}

    def _rows(self, sql: str, params: list[Any] | tuple[Any, ...] = (), *,
              as_stored: bool = False) -> list[dict[str, Any]]:
        match = _TABLE.search(sql)
        table = match.group(1) if match else "row"
        place = None if as_stored else self.place
        try:
            return [_decode(r, f"{self.path}: {table}", place) for r in self.db.query(sql, params)]
        except sqlite3.DatabaseError as err:
            raise NotebookError(f"{self.path}: reading {table}: {err}") from None

    def _one(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> dict[str, Any] | None:
        rows = self._rows(sql, params)
        return rows[0] if rows else None

    def _records(self, cls: type[R] | TypeAdapter[Any], sql: str, params: list[Any] | tuple[Any, ...] = (), *,
                 as_stored: bool = False) -> list[Any]:
        """Rows of a query parsed into records; a row that does not fit its record is named. `as_stored`: paths as
        the row stores them (lab-relative), for checks of what the chain hashed."""
        validate = cls.validate_python if isinstance(cls, TypeAdapter) else cls.model_validate
        out = []
        for row in self._rows(sql, params, as_stored=as_stored):
            try:
                out.append(validate(row))
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise NotebookError(f"{self.path}: {_TABLE.search(sql).group(1)} {_row_name(row)}: {where}: "
                                    f"{first['msg']}") from None
        return out

    def _record(self, cls: type[R], sql: str, params: list[Any] | tuple[Any, ...] = ()) -> R | None:
        found = self._records(cls, sql, params)
        return found[0] if found else None

    # ---- sessions ------------------------------------------------------------------------------

    def open_session(
        self, name: str, *, lab: str, budget_gpuh: float, reserve_gpuh: float, planner: str, executor: str,
        config: dict[str, Any], policy: dict[str, Any] | None = None, chat_template: ChatTemplateRef | None = None,
    ) -> Session:
        """Create a session row and its opening decision, which carries the row's hash, in one transaction.
        `chat_template` is the chat format the session renders with; the decision says when it is the ChatML
        default (a tokenizer with no template of its own)."""
        # Hashed as stored: its config's paths into the lab lab-relative, so the hashes hold wherever the lab moves.
        self.place = self.place.with_recorded(lab)
        session = Session(name=name, lab=lab, budget_gpuh=budget_gpuh, reserve_gpuh=reserve_gpuh, planner=planner,
                          executor=executor, config=self.place.stored(redact_data(config)), status="open",
                          started_at=now(), ended_at=None)
        with self.transaction():
            if self._one("SELECT name FROM session WHERE name = ?", [name]):
                raise NotebookError(f"session {name!r} already exists in {self.path}")
            self._insert("session", session.model_dump(mode="json"))
            rationale = "session opened"
            if chat_template is not None and chat_template.source == "chatml-default":
                rationale += "; the tokenizer has no chat template of its own, so ChatML is used"
            self._append_decision(name, "open", rationale, OpenPayload(
                budget_gpuh=session.budget_gpuh, reserve_gpuh=session.reserve_gpuh, planner=planner,
                executor=executor, config_sha256=sha256_text(canonical_json(session.model_dump(mode="json")["config"])),
                session_sha256=session_sha256(session), policy=policy, chat_template=chat_template,
            ))
        return self.session(name)

    def session(self, name: str) -> Session:
        found = self._record(Session, "SELECT * FROM session WHERE name = ?", [name])
        if found is None:
            raise NotebookError(f"no session {name!r} in {self.path}")
        return found

    def sessions(self) -> list[Session]:
        return self._records(Session, "SELECT * FROM session ORDER BY started_at")

    def end_session(self, name: str, status: Literal["done", "failed", "stopped"], rationale: str) -> None:
        with self.transaction():
            self._update("session", "name = ?", [name], {"status": status, "ended_at": now()})
            self._append_decision(name, "stop", rationale, {"status": status})

    # ---- decisions (append-only, hash-chained) -------------------------------------------------

    def record_decision(
        self, session: str, kind: DecisionKind, rationale: str, payload: dict[str, Any] | BaseModel,
    ) -> Decision:
        """Append one decision to the chain and return it; `payload` must fit its kind's model
        (memory/records.py), else NotebookError names the field."""
        with self.transaction():
            return self._append_decision(session, kind, rationale, payload)

    def _append_decision(self, session: str, kind: str, rationale: str, payload: dict[str, Any] | BaseModel) -> Decision:
        # Runs inside transaction(): the head is read under the write lock, so two writers cannot fork the chain.
        # Redacted before hashing: the chain covers what is stored, and a stored secret could never be removed.
        # Paths into the lab are made lab-relative before hashing too: the hash covers the record as stored.
        body, rationale = self.place.stored(redact_data(_payload_json(kind, payload))), self.place.stored(redact(rationale))
        head = self.db.execute("SELECT seq, hash FROM decision ORDER BY seq DESC LIMIT 1").fetchone()
        seq, prev = (head[0] + 1, head[1]) if head else (1, GENESIS)
        at = now()
        chained = {c.key: evals_text(self._chain_rows(c, session, seq)) for c in COVERED}
        digest = decision_hash(prev, seq, session, at, kind, rationale, canonical_json(body), **chained)
        row = {"seq": seq, "session": session, "at": at, "kind": kind, "rationale": rationale, "payload": body,
               "prev_hash": prev, "hash": digest}
        self._insert("decision", row)
        return DECISION.validate_python(self.place.resolved(row))

    def _chain_rows(self, c: Covered, session: str, seq: int) -> list[tuple[int, str]]:
        """The rows of `c`'s table that its session (or no session: lab-level artifacts) wrote and that are final but
        not yet chained, marked as covered by decision `seq`: (id, digest) each."""
        cols = ", ".join(c.columns)
        final = f" AND {c.final}" if c.final else ""
        owner = "(session = ? OR session IS NULL)"  # lab-level rows (artifacts, splits) join the next decision
        rows = self.db.execute(f"SELECT {cols} FROM {c.table} WHERE {owner} AND {c.seq_column} IS NULL{final} "
                               "ORDER BY id", [session]).fetchall()
        chained = [(row[0], row_digest(row)) for row in rows]
        for row_id, digest in chained:
            self.db.execute(f"UPDATE {c.table} SET {c.seq_column} = ?, {c.digest_column} = ? WHERE id = ?",
                            [seq, digest, row_id])
        return chained

    def decisions(self, session: str | None = None, kind: str | None = None) -> list[Decision]:
        """Decisions in chain order, each parsed into its kind's record (payload typed)."""
        sql, params = "SELECT * FROM decision WHERE 1=1", []
        if session is not None:
            sql, params = sql + " AND session = ?", [*params, session]
        if kind is not None:
            sql, params = sql + " AND kind = ?", [*params, kind]
        return self._records(DECISION, sql + " ORDER BY seq", params)

    def recorded_hash(self, session: str, seq: int) -> str | None:
        """The hash the notebook holds for decision `seq` of `session` (None when it has no such decision): a record
        that names a decision by (seq, hash), as a bundle's training evidence does, is in the chain when they match."""
        found = self.db.execute("SELECT hash FROM decision WHERE seq = ? AND session = ?", [seq, session]).fetchone()
        return found[0] if found else None

    def verify(self, pending: bool = False) -> VerifyReport:
        """Re-walk the whole chain in storage order, then check every session row against its `open` and `stop`
        decisions; report the first record that does not fit. `pending` (resume, replay): the final rows of a session
        still open that no decision records yet (its process was killed between writing them and its next decision)
        are pending, not a problem: that session's next decision chains them."""
        try:
            report = self._verify_chain(pending)
            problem = self._verify_sessions() if report.ok else None
        except sqlite3.DatabaseError as err:
            raise NotebookError(f"{self.path}: reading the decision log: {err}") from None
        return report.model_copy(update={"ok": False, "problem": problem}) if problem else report

    def _verify_chain(self, pending: bool = False) -> VerifyReport:
        prev, expected, count = GENESIS, 1, 0
        covered = [c for c in COVERED if self._version() >= c.since]  # a read-only open of an older file is not migrated
        chained: dict[str, dict[int, list[tuple[int, str]]]] = {}
        edited: dict[str, set[int]] = {}
        for c in covered:
            chained[c.key], edited[c.key] = self._chained_rows(c)
        cursor = self.db.execute(
            "SELECT seq, session, at, kind, rationale, payload, prev_hash, hash FROM decision ORDER BY rowid"
        )
        for seq, session, at, kind, rationale, payload, prev_hash, digest in cursor:
            problem = None
            rows = {c.key: chained[c.key].pop(seq, []) for c in covered}
            if seq != expected:
                problem = f"decision seq {seq}: expected seq {expected} (a decision was deleted or reordered)"
            elif prev_hash != prev:
                problem = f"decision seq {seq}: prev_hash does not match decision {seq - 1} (chain broken)"
            elif decision_hash(prev, seq, session, at, kind, rationale, payload,
                               **{k: evals_text(v) for k, v in rows.items()}) != digest:
                changed = [(c.table, i) for c in covered for i, _ in rows[c.key] if i in edited[c.key]]
                problem = (f"{changed[0][0]} {changed[0][1]}: its row does not match the hash decision seq {seq} "
                           "recorded for it (edited after it was recorded)" if changed else
                           f"decision seq {seq}: content does not match its hash (edited after it was written)")
            if problem:
                return VerifyReport(ok=False, count=count, head=prev, problem=problem)
            prev, expected, count = digest, expected + 1, count + 1
        for c in covered:
            problem = self._unchained_row(c, chained[c.key], pending)
            if problem:
                return VerifyReport(ok=False, count=count, head=prev, problem=problem)
        return VerifyReport(ok=True, count=count, head=prev)

    def _chained_rows(self, c: Covered) -> tuple[dict[int, list[tuple[int, str]]], set[int]]:
        """decision seq -> [(row id, digest of the row as it is now)] of `c`'s table, and the ids whose digest differs
        from the one stored when they were chained (to name an edited row; the decision's hash is what proves it)."""
        by_seq: dict[int, list[tuple[int, str]]] = {}
        edited = set()
        cols = ", ".join(c.columns)
        for row in self.db.execute(f"SELECT {c.seq_column}, {c.digest_column}, {cols} FROM {c.table} "
                                   f"WHERE {c.seq_column} IS NOT NULL ORDER BY id"):
            digest = row_digest(row[2:])
            by_seq.setdefault(row[0], []).append((row[2], digest))
            if digest != row[1]:
                edited.add(row[2])
        return by_seq, edited

    def _unchained_row(self, c: Covered, left: dict[int, list[tuple[int, str]]], pending: bool) -> str | None:
        """A row of `c`'s table chained to no decision that exists, or (after the first chained row: older rows predate
        chaining) final and chained to none at all (with `pending`: unless its session is still open)."""
        if left:
            seq, rows = min(left.items())
            return f"{c.table} {rows[0][0]}: chained to decision seq {seq}, which is not in the notebook (added outside it)"
        first = self.db.execute(f"SELECT MIN(id) FROM {c.table} WHERE {c.seq_column} IS NOT NULL").fetchone()[0]
        if first is None:
            return None
        final = f" AND {c.final}" if c.final else ""
        # a lab-level row (no session) is never pending: the next decision of any session would chain it
        other = " AND (session IS NULL OR session NOT IN (SELECT name FROM session WHERE status = 'open'))" if pending else ""
        loose = self.db.execute(f"SELECT id, session FROM {c.table} WHERE {c.seq_column} IS NULL AND id > ?{final}"
                                f"{other} ORDER BY id LIMIT 1", [first]).fetchone()
        if loose:
            what = {"tool_call": "every finished tool call", "job": "every settled job attempt"}.get(
                c.table, f"every {c.table} row")
            return (f"{c.table} {loose[0]} (session {loose[1]!r}): in no decision's hash; expected {what} to be "
                    "recorded by a decision (added outside the notebook, or written after the session's last decision: "
                    "resume the session to record it)")
        return None

    def _verify_sessions(self) -> str | None:
        """The chain vouches for each session row through its `open` decision's payload."""
        opens: dict[str, tuple[int, dict[str, Any]]] = {}
        for seq, name, payload in self.db.execute("SELECT seq, session, payload FROM decision WHERE kind = 'open' "
                                                  "ORDER BY seq"):
            opens.setdefault(name, (seq, _json_object(payload)))
        stops: dict[str, tuple[str, int]] = {}  # a session's status is the one its last stop decision recorded
        for seq, name, payload in self.db.execute("SELECT seq, session, payload FROM decision WHERE kind = 'stop' "
                                                  "ORDER BY seq"):
            stops[name] = (_json_object(payload).get("status"), seq)
        # As stored: the open decision hashed the row as it was written (its paths lab-relative, or in an older
        # notebook absolute at the location it was written in), not as read at the lab's current location.
        sessions = self._records(Session, "SELECT * FROM session ORDER BY started_at", as_stored=True)
        for s in sessions:
            if s.name not in opens:
                return f"session {s.name!r}: no open decision vouches for its row (added outside the notebook)"
            seq, vouched = opens[s.name]
            for field in ("budget_gpuh", "reserve_gpuh", "planner", "executor"):
                if getattr(s, field) != vouched.get(field):
                    return (f"session {s.name!r}: {field} is {getattr(s, field)!r} in its row but "
                            f"{vouched.get(field)!r} in its open decision (seq {seq}): the row was edited after it opened")
            if sha256_text(canonical_json(s.config)) != vouched.get("config_sha256"):
                return (f"session {s.name!r}: its config does not match the hash in its open decision (seq {seq}): "
                        "the row was edited after it opened")
            if vouched.get("session_sha256") not in (None, session_sha256(s)):
                return (f"session {s.name!r}: its row (lab or start time) does not match the hash in its open "
                        f"decision (seq {seq}): the row was edited after it opened")
            ended, stop_seq = stops.get(s.name, ("open", None))
            if s.status != ended:
                said = f"its last stop decision (seq {stop_seq}) says {ended!r}" if stop_seq else "no stop decision ended it"
                return (f"session {s.name!r}: status is {s.status!r} in its row but {said}: the row was edited after "
                        "the fact")
        missing = sorted(set(opens) - {s.name for s in sessions})
        if missing:
            return f"session {missing[0]!r}: opened at decision seq {opens[missing[0]][0]} but its row is gone"
        return None

    # ---- tool calls ----------------------------------------------------------------------------

    def record_tool_call(
        self, session: str, tool: str, args: dict[str, Any], *, decision_seq: int | None = None,
        job_key: str | None = None,
    ) -> ToolCall:
        """Record a tool call before it runs; a repeat of the same (tool, args) returns the first."""
        args_hash = tool_call_key(tool, args)
        with self.transaction():
            existing = self._one("SELECT id FROM tool_call WHERE session = ? AND args_hash = ?", [session, args_hash])
            if existing is None:
                self._insert("tool_call", {
                    "session": session, "tool": tool, "args": args, "args_hash": args_hash,
                    "decision_seq": decision_seq, "job_key": job_key, "status": "open", "started_at": now(),
                })
        return self.tool_call(session, args_hash)

    def tool_call(self, session: str, args_hash: str) -> ToolCall:
        found = self._record(ToolCall, "SELECT * FROM tool_call WHERE session = ? AND args_hash = ?", [session, args_hash])
        if found is None:
            raise NotebookError(f"no tool call {args_hash[:12]} in session {session!r}")
        return found

    def finish_tool_call(
        self, call_id: int, status: Literal["done", "failed", "refused"], result: dict[str, Any], *,
        decision_seq: int | None = None,
    ) -> None:
        """Close a tool call with its result and, when its outcome was a decision, that decision's seq."""
        fields: dict[str, Any] = {"status": status, "result": result, "ended_at": now()}
        if decision_seq is not None:
            fields["decision_seq"] = decision_seq
        with self.transaction():
            chained = self.db.execute("SELECT chain_seq FROM tool_call WHERE id = ?", [call_id]).fetchone()
            if chained and chained[0] is not None:  # its outcome is in the chain: a second one would fail verify
                raise NotebookError(f"tool call {call_id}: already finished and recorded by decision seq {chained[0]}")
            self._update("tool_call", "id = ?", [call_id], fields)

    def tool_calls(self, session: str) -> list[ToolCall]:
        return self._records(ToolCall, "SELECT * FROM tool_call WHERE session = ? ORDER BY id", [session])

    # ---- jobs and the GPU-hour ledger ----------------------------------------------------------

    def start_job(
        self, key: str, *, session: str, kind: str, executor: str, resources: dict[str, Any],
        forecast_gpuh: float, attempt: int = 1, folder: str | None = None, fn: str | None = None,
        result_type: str | None = None,
    ) -> JobRecord:
        """Record a job attempt (state pending) before it is submitted; its forecast is reserved."""
        with self.transaction():
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
        if fields.get("failure_class") not in (None, *get_args(FailureClass)):
            raise NotebookError(f"update_job: failure_class {fields['failure_class']!r} is not one of "
                                f"{get_args(FailureClass)}")
        with self.transaction():
            chained = self.db.execute("SELECT chain_seq FROM job WHERE key = ? AND attempt = ?", [key, attempt]).fetchone()
            if chained and chained[0] is not None and set(fields) & set(JOB_COLUMNS):  # a change would fail verify
                raise NotebookError(f"job {key[:12]} attempt {attempt}: settled and recorded by decision seq "
                                    f"{chained[0]}; only its failure_detail may change")
            self._update("job", "key = ? AND attempt = ?", [key, attempt], fields)
        return self.get_job(key, attempt)

    def get_job(self, key: str, attempt: int | None = None) -> JobRecord | None:
        """One attempt of a job, or its latest attempt when `attempt` is None (indexed by key)."""
        if attempt is None:
            return self._record(JobRecord, "SELECT * FROM job WHERE key = ? ORDER BY attempt DESC LIMIT 1", [key])
        return self._record(JobRecord, "SELECT * FROM job WHERE key = ? AND attempt = ?", [key, attempt])

    def jobs(self, session: str | None = None, kind: str | None = None, key: str | None = None) -> list[JobRecord]:
        """Job attempts, oldest first; `key` selects one job's attempts through its index."""
        sql, params = "SELECT * FROM job WHERE 1=1", []
        for column, value in (("session", session), ("kind", kind), ("key", key)):
            if value is not None:
                sql, params = sql + f" AND {column} = ?", [*params, value]
        return self._records(JobRecord, sql + " ORDER BY id", params)

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
        with self.transaction():
            rowid = self._insert("artifact", {
                "session": session, "kind": kind, "name": name, "path": path, "sha256": sha256,
                "parents": parents or [], "recipe": recipe or {}, "job_key": job_key, "created_at": now(),
            })
        return self.artifact(rowid)

    def artifact(self, artifact_id: int) -> Artifact:
        found = self._record(Artifact, "SELECT * FROM artifact WHERE id = ?", [artifact_id])
        if found is None:
            raise NotebookError(f"no artifact {artifact_id} in {self.path}")
        return found

    def artifacts(self, kind: str | None = None, session: str | None = None, sha256: str | None = None,
                  job_key: str | None = None) -> list[Artifact]:
        """Artifacts, oldest first; `sha256` finds every record of the same content through its index,
        `job_key` what one job produced."""
        sql, params = "SELECT * FROM artifact WHERE 1=1", []
        for column, value in (("kind", kind), ("session", session), ("sha256", sha256), ("job_key", job_key)):
            if value is not None:
                sql, params = sql + f" AND {column} = ?", [*params, value]
        return self._records(Artifact, sql + " ORDER BY id", params)

    # ---- evals, noise floors, bars, comparisons ------------------------------------------------

    def add_eval(
        self, *, session: str, artifact_id: int, suite: str, replicate: int, decoding: dict[str, Any],
        decoding_sha256: str, served: bool, metrics: dict[str, Any], items: list[dict[str, Any]],
        job_key: str | None = None,
    ) -> EvalRecord:
        with self.transaction():
            rowid = self._insert("eval", {
                "session": session, "artifact_id": artifact_id, "suite": suite, "replicate": replicate,
                "decoding": decoding, "decoding_sha256": decoding_sha256, "served": int(served),
                "metrics": metrics, "items": items, "job_key": job_key, "created_at": now(),
            })
            return self.eval(rowid)

    def eval(self, eval_id: int) -> EvalRecord:
        found = self._record(EvalRecord, "SELECT * FROM eval WHERE id = ?", [eval_id])
        if found is None:
            raise NotebookError(f"no eval {eval_id} in {self.path}")
        return found

    def evals(self, *, artifact_id: int | None = None, suite: str | None = None,
              session: str | None = None) -> list[EvalRecord]:
        sql, params = "SELECT * FROM eval WHERE 1=1", []
        for column, value in (("artifact_id", artifact_id), ("suite", suite), ("session", session)):
            if value is not None:
                sql, params = sql + f" AND {column} = ?", [*params, value]
        return self._records(EvalRecord, sql + " ORDER BY id", params)

    def add_noise_floor(
        self, *, session: str, suite: str, metric: str, k: int, spread: float, mean_abs_delta: float,
        max_abs_t: float, source_evals: list[int],
    ) -> NoiseFloor:
        with self.transaction():
            rowid = self._insert("noise_floor", {
                "session": session, "suite": suite, "metric": metric, "k": k, "spread": spread,
                "mean_abs_delta": mean_abs_delta, "max_abs_t": max_abs_t, "source_evals": source_evals,
                "created_at": now(),
            })
            return self._record(NoiseFloor, "SELECT * FROM noise_floor WHERE id = ?", [rowid])

    def noise_floor(self, floor_id: int) -> NoiseFloor:
        found = self._record(NoiseFloor, "SELECT * FROM noise_floor WHERE id = ?", [floor_id])
        if found is None:
            raise NotebookError(f"no noise floor {floor_id} in {self.path}")
        return found

    def noise_floors(self, session: str, suite: str, metric: str) -> list[NoiseFloor]:
        """Every calibration of (suite, metric) in a session, oldest first."""
        return self._records(NoiseFloor, "SELECT * FROM noise_floor WHERE session = ? AND suite = ? AND metric = ? "
                             "ORDER BY id", [session, suite, metric])

    def register_bars(self, session: str, spec: BarsSpec) -> BarsRecord:
        """Store the canonical bars spec with its sha256 and time, plus a register_bars decision."""
        canonical = spec.canonical()
        digest = sha256_text(canonical_json(canonical))
        with self.transaction():
            rowid = self._insert("bars", {"session": session, "spec": canonical, "sha256": digest,
                                          "registered_at": now()})
            self._append_decision(session, "register_bars", "promotion bars registered before scoring",
                                  {"bars_id": rowid, "sha256": digest})
            return self.bars(rowid)

    def bars(self, bars_id: int) -> BarsRecord:
        found = self._record(BarsRecord, "SELECT * FROM bars WHERE id = ?", [bars_id])
        if found is None:
            raise NotebookError(f"no bars {bars_id} in {self.path}")
        return found

    def add_comparison(
        self, *, session: str, candidate: int, incumbent: int, bars_id: int, verdicts: list[BarVerdict],
        promoted: bool, adjustment: Adjustment, rationale: str,
    ) -> tuple[Comparison, Decision]:
        """Store a comparison and its verdict decision (`promote`: every bar held, else `reject`) in one transaction."""
        with self.transaction():
            rowid = self._insert("comparison", {
                "session": session, "candidate": candidate, "incumbent": incumbent, "bars_id": bars_id,
                "verdicts": [v.model_dump(mode="json") for v in verdicts], "promoted": int(promoted), "adjustment": adjustment.model_dump(mode="json"), "created_at": now(),
            })
            decision = self._append_decision(session, "promote" if promoted else "reject", rationale, {
                "comparison_id": rowid, "candidate": candidate, "incumbent": incumbent, "bars_id": bars_id,
            })
            return self._record(Comparison, "SELECT * FROM comparison WHERE id = ?", [rowid]), decision

    def comparisons(self, session: str) -> list[Comparison]:
        return self._records(Comparison, "SELECT * FROM comparison WHERE session = ? ORDER BY id", [session])

    # ---- feedback splits -----------------------------------------------------------------------

    def record_split(
        self, *, source_path: str, source_sha256: str, config: dict[str, Any], counts: dict[str, Any],
        assignment: dict[str, str], session: str | None = None,
    ) -> FeedbackSplit:
        """Store a feedback split; its sha256 covers the canonical id -> split assignment."""
        with self.transaction():
            rowid = self._insert("feedback_split", {
                "session": session, "source_path": source_path, "source_sha256": source_sha256,
                "config": config, "sha256": sha256_text(canonical_json(assignment)), "counts": counts,
                "assignment": assignment, "created_at": now(),
            })
            return self._record(FeedbackSplit, "SELECT * FROM feedback_split WHERE id = ?", [rowid])

    def latest_split(self, source_sha256: str | None = None, before_session: str | None = None) -> FeedbackSplit | None:
        """The latest split (of that source); with `before_session`, the latest one that session did not make."""
        where, params = [], []
        if source_sha256 is not None:
            where, params = [*where, "source_sha256 = ?"], [*params, source_sha256]
        if before_session is not None:
            where, params = [*where, "session IS NOT ?"], [*params, before_session]
        sql = "SELECT * FROM feedback_split" + (" WHERE " + " AND ".join(where) if where else "")
        return self._record(FeedbackSplit, sql + " ORDER BY id DESC LIMIT 1", params)


def tool_call_key(tool: str, args: dict[str, Any]) -> str:
    """Idempotency key of a tool call: sha256 of the tool name and its canonical arguments."""
    return sha256_text(f"{tool}\n{canonical_json(args)}")


def _payload_json(kind: str, payload: dict[str, Any] | BaseModel) -> dict[str, Any]:
    """The payload validated against its kind's model, as the JSON that is hashed and stored."""
    if kind not in PAYLOADS:
        raise NotebookError(f"decision kind {kind!r} is not one of {sorted(PAYLOADS)}")
    raw = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    try:
        return PAYLOADS[kind].dump_python(PAYLOADS[kind].validate_python(raw), mode="json")
    except ValidationError as err:
        first = err.errors()[0]
        raise NotebookError(f"{kind} decision payload: {'.'.join(str(p) for p in first['loc']) or 'payload'}: "
                            f"{first['msg']}") from None
