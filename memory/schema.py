"""Notebook schema and its versioned migrations.

`MIGRATIONS[i]` takes a notebook from version i to i+1; the applied version lives in SQLite's
`PRAGMA user_version`, so opening an older notebook upgrades it in one transaction and opening a
newer one is refused. Append migrations; never edit one that has shipped.
"""

from __future__ import annotations

import functools
import sqlite3
from pathlib import Path

from memory.views import V4, V7

V1 = """
CREATE TABLE session (
    name         TEXT PRIMARY KEY,
    lab          TEXT NOT NULL,
    budget_gpuh  REAL NOT NULL,
    reserve_gpuh REAL NOT NULL,
    planner      TEXT NOT NULL,
    executor     TEXT NOT NULL,
    config       TEXT NOT NULL,            -- canonical JSON snapshot of the lab config
    status       TEXT NOT NULL,            -- open | done | failed | stopped
    started_at   TEXT NOT NULL,
    ended_at     TEXT
);

-- Append-only, hash-chained: hash = sha256(prev_hash + canonical record). See memory/chain.py.
CREATE TABLE decision (
    seq        INTEGER PRIMARY KEY,
    session    TEXT NOT NULL,
    at         TEXT NOT NULL,
    kind       TEXT NOT NULL,
    rationale  TEXT NOT NULL,
    payload    TEXT NOT NULL,              -- canonical JSON
    prev_hash  TEXT NOT NULL,
    hash       TEXT NOT NULL
);
CREATE INDEX decision_session ON decision(session, seq);
CREATE TRIGGER decision_no_update BEFORE UPDATE ON decision
    BEGIN SELECT RAISE(ABORT, 'decisions are append-only'); END;
CREATE TRIGGER decision_no_delete BEFORE DELETE ON decision
    BEGIN SELECT RAISE(ABORT, 'decisions are append-only'); END;

CREATE TABLE tool_call (
    id           INTEGER PRIMARY KEY,
    session      TEXT NOT NULL,
    tool         TEXT NOT NULL,
    args         TEXT NOT NULL,            -- canonical JSON
    args_hash    TEXT NOT NULL,            -- idempotency key: sha256(tool + canonical args)
    decision_seq INTEGER,
    job_key      TEXT,
    status       TEXT NOT NULL,            -- open | done | failed | refused
    result       TEXT,                     -- canonical JSON
    started_at   TEXT NOT NULL,
    ended_at     TEXT,
    UNIQUE (session, args_hash)
);

-- One row per attempt: retries and requeues keep their own cost in the ledger.
CREATE TABLE job (
    id             INTEGER PRIMARY KEY,
    key            TEXT NOT NULL,          -- idempotency key (tool + canonical args hash)
    attempt        INTEGER NOT NULL,
    session        TEXT NOT NULL,
    kind           TEXT NOT NULL,          -- sft | dpo | klce | rft | merge | eval | ...
    executor       TEXT NOT NULL,          -- local | slurm
    external_id    TEXT,                   -- Slurm job id or local pid-based id
    folder         TEXT,                   -- submitit folder
    resources      TEXT NOT NULL,          -- canonical JSON
    forecast_gpuh  REAL NOT NULL,
    gpu_hours      REAL,                   -- settled cost; NULL while reserved
    state          TEXT NOT NULL,          -- pending | running | completed | failed
    failure_class  TEXT,
    failure_detail TEXT,
    log_path       TEXT,
    result         TEXT,                   -- canonical JSON of the job's result
    submitted_at   TEXT NOT NULL,
    started_at     TEXT,
    ended_at       TEXT,
    UNIQUE (key, attempt)
);
CREATE INDEX job_session ON job(session, state);

CREATE TABLE artifact (
    id         INTEGER PRIMARY KEY,
    session    TEXT,
    kind       TEXT NOT NULL,              -- checkpoint | dataset | bundle | split | ...
    name       TEXT NOT NULL,
    path       TEXT NOT NULL,
    sha256     TEXT NOT NULL,
    parents    TEXT NOT NULL,              -- JSON list of artifact ids
    recipe     TEXT NOT NULL,              -- canonical JSON (config, manifest)
    job_key    TEXT,
    created_at TEXT NOT NULL
);
CREATE INDEX artifact_sha ON artifact(sha256);

CREATE TABLE eval (
    id              INTEGER PRIMARY KEY,
    session         TEXT NOT NULL,
    artifact_id     INTEGER NOT NULL REFERENCES artifact(id),
    suite           TEXT NOT NULL,
    replicate       INTEGER NOT NULL,
    decoding        TEXT NOT NULL,         -- canonical JSON of evals.decoding.Decoding
    decoding_sha256 TEXT NOT NULL,
    served          INTEGER NOT NULL,      -- 1 if evaluated at the candidate's served decoding
    metrics         TEXT NOT NULL,         -- canonical JSON {metric: value}
    items           TEXT NOT NULL,         -- canonical JSON list of per-item outcomes
    job_key         TEXT,
    created_at      TEXT NOT NULL
);
CREATE INDEX eval_artifact ON eval(artifact_id, suite);

CREATE TABLE noise_floor (
    id             INTEGER PRIMARY KEY,
    session        TEXT NOT NULL,
    suite          TEXT NOT NULL,
    metric         TEXT NOT NULL,
    k              INTEGER NOT NULL,
    spread         REAL NOT NULL,
    mean_abs_delta REAL NOT NULL,
    max_abs_t      REAL NOT NULL,
    source_evals   TEXT NOT NULL,          -- JSON list of eval ids
    created_at     TEXT NOT NULL
);

CREATE TABLE bars (
    id            INTEGER PRIMARY KEY,
    session       TEXT NOT NULL,
    spec          TEXT NOT NULL,           -- canonical JSON of the parsed bars file
    sha256        TEXT NOT NULL,
    registered_at TEXT NOT NULL
);

CREATE TABLE comparison (
    id         INTEGER PRIMARY KEY,
    session    TEXT NOT NULL,
    candidate  INTEGER NOT NULL REFERENCES artifact(id),
    incumbent  INTEGER NOT NULL REFERENCES artifact(id),
    bars_id    INTEGER NOT NULL REFERENCES bars(id),
    verdicts   TEXT NOT NULL,              -- JSON list, one per bar: statistic, value, threshold, holds
    promoted   INTEGER NOT NULL,
    adjustment TEXT NOT NULL,              -- JSON: multiple-comparison method and adjusted p-values
    created_at TEXT NOT NULL
);

CREATE TABLE feedback_split (
    id            INTEGER PRIMARY KEY,
    session       TEXT,
    source_path   TEXT NOT NULL,
    source_sha256 TEXT NOT NULL,
    config        TEXT NOT NULL,           -- canonical JSON: fractions, stratification, salt
    sha256        TEXT NOT NULL,           -- sha256 of the canonical assignment
    counts        TEXT NOT NULL,           -- JSON {split: {vote: n}}
    assignment    TEXT NOT NULL,           -- JSON {battle id: split}
    created_at    TEXT NOT NULL
);
"""

# Jobs survive the agent process (tools/jobs/launcher.py `Launcher.attach`): each row names its job
# function and result model; the cost keeps the measured device-seconds beside the GPU-hours charged.
V2 = """
ALTER TABLE job ADD COLUMN fn TEXT;              -- job function, "module:qualname"
ALTER TABLE job ADD COLUMN result_type TEXT;     -- its pydantic result model, "module:qualname"
ALTER TABLE job ADD COLUMN device_seconds REAL;  -- measured: seconds held x devices; NULL while unsettled
ALTER TABLE job ADD COLUMN charge TEXT;          -- how gpu_hours was settled: measured | simulated
"""

# Indexes for the queries the judges and the launcher run on every step (decisions of one kind,
# a suite's noise floors, a session's comparisons, tool calls by job), so none of them scans a table.
V3 = """
CREATE INDEX decision_kind ON decision(session, kind, seq);
CREATE INDEX noise_floor_metric ON noise_floor(session, suite, metric);
CREATE INDEX eval_session_suite ON eval(session, suite);
CREATE INDEX comparison_session ON comparison(session);
CREATE INDEX tool_call_job ON tool_call(job_key);
"""

# V4 (memory/views.py): read-only views with readable columns for a reviewer browsing the notebook.

# Eval rows are chained (memory/chain.py): each is hashed into the next decision its session writes (the one that
# records it), so an eval edited with sqlite3 fails verify. Rows from before this version stay unchained.
V5 = """
ALTER TABLE eval ADD COLUMN decision_seq INTEGER;  -- the decision whose hash covers this row; NULL before V5
ALTER TABLE eval ADD COLUMN sha256 TEXT;           -- memory.chain.eval_digest of the row when it was chained
CREATE INDEX eval_decision ON eval(decision_seq);
"""

# Tool calls, artifacts, noise floors, bars, comparisons and feedback splits are chained like eval rows (memory/chain.py
# COVERED): a finished tool call (its status and result, the outcome line the planner reads), an artifact (its path and
# sha256, what resume trains from) and the rows the judgments read back are hashed into the next decision their session
# writes, so an edit with sqlite3 fails verify, and resume and replay refuse it.
V6 = """
ALTER TABLE tool_call ADD COLUMN chain_seq INTEGER;  -- the decision whose hash covers this row; NULL while open, or before V6
ALTER TABLE tool_call ADD COLUMN chain_sha256 TEXT;  -- memory.chain.row_digest of the row when it was chained
ALTER TABLE artifact ADD COLUMN chain_seq INTEGER;
ALTER TABLE artifact ADD COLUMN chain_sha256 TEXT;
ALTER TABLE noise_floor ADD COLUMN chain_seq INTEGER;
ALTER TABLE noise_floor ADD COLUMN chain_sha256 TEXT;
ALTER TABLE bars ADD COLUMN chain_seq INTEGER;
ALTER TABLE bars ADD COLUMN chain_sha256 TEXT;
ALTER TABLE comparison ADD COLUMN chain_seq INTEGER;
ALTER TABLE comparison ADD COLUMN chain_sha256 TEXT;
ALTER TABLE feedback_split ADD COLUMN chain_seq INTEGER;
ALTER TABLE feedback_split ADD COLUMN chain_sha256 TEXT;
CREATE INDEX tool_call_chain ON tool_call(chain_seq);
CREATE INDEX artifact_chain ON artifact(chain_seq);
CREATE INDEX noise_floor_chain ON noise_floor(chain_seq);
CREATE INDEX bars_chain ON bars(chain_seq);
CREATE INDEX comparison_chain ON comparison(chain_seq);
CREATE INDEX feedback_split_chain ON feedback_split(chain_seq);
"""

# V7 (memory/views.py): the lineage view reads the `incumbent` decision kind.

# Job attempts are chained too (memory/chain.py JOB_COLUMNS), once settled (completed or failed): the ledger sums their
# GPU-hours, so a settled cost edited with sqlite3 (budget freed) fails verify, and resume and replay refuse it.
V8 = """
ALTER TABLE job ADD COLUMN chain_seq INTEGER;  -- the decision whose hash covers this row; NULL until settled, or before V8
ALTER TABLE job ADD COLUMN chain_sha256 TEXT;  -- memory.chain.row_digest of the row when it was chained
CREATE INDEX job_chain ON job(chain_seq);
"""

MIGRATIONS: list[str] = [V1, V2, V3, V4, V5, V6, V7, V8]
SCHEMA_VERSION = len(MIGRATIONS)

SQLITE_MAGIC = b"SQLite format 3\x00"


def split_sql(script: str) -> list[str]:
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


@functools.cache
def expected_columns(version: int) -> dict[str, frozenset[str]]:
    """table -> columns of a notebook at `version`, read off the migrations applied to an empty database."""
    conn = sqlite3.connect(":memory:")
    for script in MIGRATIONS[:version]:
        for statement in split_sql(script):
            conn.execute(statement)
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    out = {t: frozenset(r[1] for r in conn.execute(f"PRAGMA table_info({t})")) for t in tables}
    conn.close()
    return out


def file_problem(path: Path) -> str | None:
    """What makes `path` unusable as an existing notebook file, read from its 100-byte SQLite header.

    Catches what SQLite itself would only report later, mid-query: an empty file, a file that is
    not SQLite, and one truncated below the page count its header declares (format:
    https://www.sqlite.org/fileformat.html#the_database_header).
    """
    if path.is_dir():
        return "is a directory, not a notebook file"
    if not path.is_file():
        return "is not a regular file"
    size = path.stat().st_size
    if size == 0:
        return "is an empty file (0 bytes), not a notebook; remove it to start a new one"
    with path.open("rb") as f:
        header = f.read(100)
    if not header.startswith(SQLITE_MAGIC):
        return f"is not an SQLite database (it starts with {header[:16]!r})"
    if len(header) < 100:
        return f"is truncated: {size} bytes, shorter than the 100-byte SQLite header"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    valid_for, changes = header[92:96], header[24:28]
    if page_size and (size % page_size or (valid_for == changes and size < pages * page_size)):
        return (f"is truncated: {size} bytes, but its header declares {pages} pages of {page_size} bytes "
                f"({pages * page_size} bytes)")
    return None
