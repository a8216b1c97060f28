"""Read-only SQL views of the notebook with readable columns, for a reviewer who does not know the schema.

    datasette lab/notebook.db          # browse them (datasette is a dev extra), or plain sqlite3:
    sqlite3 lab/notebook.db "SELECT * FROM leaderboard WHERE suite = 'digits' ORDER BY first_look DESC"

    decisions_readable   one row per decision: the artifact, comparison, job and refusal reason pulled out of the payload
    leaderboard          one row per (session, artifact, suite, metric) of served-decoding evals: first look, mean, spread
    budget_by_kind       GPU-hours per (session, job kind, state, charge): settled, reserved, measured device-hours
    lineage              one row per checkpoint-parent edge (a root has one row with no parent): method, job, incumbent

They are migration V4 (memory/schema.py): a view stores no data, so creating them rewrites nothing of
an old notebook. JSON columns are read with SQLite's built-in JSON functions (SQLite >= 3.38).
A shipped migration never changes: a later change to a view is a new migration that drops and recreates it.
"""

from __future__ import annotations

# How an artifact was made, in one word, from its recipe: the merge (with its dose), the trainer
# family, a serving alternative, or the recipe's role (the parent); else the artifact kind.
_METHOD = """CASE
    WHEN json_extract(a.recipe, '$.merge') IS NOT NULL
        THEN json_extract(a.recipe, '$.merge') || COALESCE(' alpha ' || json_extract(a.recipe, '$.alpha'), '')
    WHEN json_extract(a.recipe, '$.hparams.trainer') IS NOT NULL THEN json_extract(a.recipe, '$.hparams.trainer')
    WHEN json_extract(a.recipe, '$.serving_of') IS NOT NULL THEN 'serving'
    ELSE COALESCE(json_extract(a.recipe, '$.role'), a.kind) END"""

# The artifact a decision is about: an explicit artifact_id, else a comparison's or refusal's candidate.
_SUBJECT = "COALESCE(json_extract(d.payload, '$.artifact_id'), json_extract(d.payload, '$.candidate'))"


def _lineage(incumbent_kinds: str) -> str:
    """The lineage view; `incumbent_kinds` is the SQL condition on the decision kinds that record a change of
    incumbent (V4: `promote` with `action: incumbent`; V7: the `incumbent` kind as well)."""
    return f"""CREATE VIEW lineage AS
SELECT a.id AS artifact_id, a.session, a.name, {_METHOD} AS method,
       p.value AS parent_id, pa.name AS parent_name,
       a.job_key, j.kind AS job_kind, j.external_id AS job_external_id,
       EXISTS (SELECT 1 FROM decision AS d WHERE {incumbent_kinds} AND d.session = a.session
               AND json_extract(d.payload, '$.action') = 'incumbent'
               AND json_extract(d.payload, '$.artifact_id') = a.id) AS became_incumbent,
       a.sha256, a.path, a.created_at
FROM artifact AS a
LEFT JOIN json_each(a.parents) AS p
LEFT JOIN artifact AS pa ON pa.id = p.value
LEFT JOIN job AS j ON j.key = a.job_key AND j.attempt = (SELECT MAX(attempt) FROM job WHERE key = a.job_key)
WHERE a.kind = 'checkpoint'
ORDER BY a.id, p.value;
"""


V4 = f"""
CREATE VIEW decisions_readable AS
SELECT d.seq, d.session, d.at, d.kind, d.rationale,
       {_SUBJECT} AS artifact_id,
       a.name AS artifact_name,
       json_extract(d.payload, '$.comparison_id') AS comparison_id,
       json_extract(d.payload, '$.key') AS job_key,
       json_extract(d.payload, '$.failure_class') AS failure_class,
       CASE WHEN d.kind = 'refuse' THEN COALESCE(
           json_extract(d.payload, '$.reason'),
           (SELECT group_concat(r.value, '; ') FROM json_each(d.payload, '$.reasons') AS r),
           d.rationale) END AS refusal_reason,
       d.payload
FROM decision AS d LEFT JOIN artifact AS a ON a.id = {_SUBJECT}
ORDER BY d.seq;

CREATE VIEW leaderboard AS
SELECT e.session, e.artifact_id, a.name AS artifact_name, {_METHOD} AS method, e.suite, m.key AS metric,
       (SELECT json_extract(f.metrics, '$."' || m.key || '"') FROM eval AS f
        WHERE f.artifact_id = e.artifact_id AND f.suite = e.suite AND f.served = 1 AND f.replicate = 0
        ORDER BY f.id LIMIT 1) AS first_look,
       AVG(m.value) AS mean, MIN(m.value) AS min, MAX(m.value) AS max, COUNT(*) AS evals,
       EXISTS (SELECT 1 FROM comparison AS c WHERE c.candidate = e.artifact_id AND c.promoted = 1) AS cleared_bars
FROM eval AS e JOIN artifact AS a ON a.id = e.artifact_id, json_each(e.metrics) AS m
WHERE e.served = 1 AND m.type IN ('integer', 'real')
GROUP BY e.session, e.artifact_id, e.suite, m.key
ORDER BY e.session, e.suite, m.key, first_look DESC;

CREATE VIEW budget_by_kind AS
SELECT session, kind, state, COALESCE(charge, 'unsettled') AS charge, COUNT(*) AS attempts,
       SUM(COALESCE(gpu_hours, 0)) AS gpu_hours,
       SUM(CASE WHEN gpu_hours IS NULL THEN forecast_gpuh ELSE 0 END) AS reserved_gpuh,
       SUM(device_seconds) / 3600.0 AS device_hours,
       group_concat(DISTINCT failure_class) AS failure_classes
FROM job
GROUP BY session, kind, state, charge
ORDER BY session, gpu_hours DESC;

""" + _lineage("d.kind = 'promote'")

# V7: the change of incumbent is its own decision kind (`incumbent`); a notebook from before it recorded the change
# as a `promote` decision with `action: incumbent`, so the lineage view reads both.
V7 = "\nDROP VIEW lineage;\n" + _lineage("d.kind IN ('incumbent', 'promote')")
