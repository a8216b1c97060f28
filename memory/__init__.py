"""The lab notebook: SQLite (WAL) through sqlite-utils, versioned migrations, the hash-chained
append-only decision log, and the typed API every other module uses to read and write records.
No other package writes SQL.

    memory/notebook.py   Notebook: open (damage checks, migrations), transaction(), typed reads and writes, verify
    memory/records.py    the record models, the Literal field types and one payload model per decision kind
    memory/schema.py     the migrations and the file/schema checks
    memory/chain.py      the decision hash
"""
