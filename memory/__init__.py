"""The lab notebook: SQLite (WAL) through sqlite-utils, versioned migrations, the hash-chained
append-only decision log, and the typed API every other module uses to read and write records.
No other package writes SQL.
"""
