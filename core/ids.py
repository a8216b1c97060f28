"""Ids that come from outside (battle ids, eval item ids, training row ids): short printable tokens.

An id is public text that the project stores and shows everywhere (the notebook, the graph checkpoint, logs, the
planner's view, problem lists), so it is held to a token rule instead of being escaped at each of those places:
1 to MAX_ID ASCII letters, digits and `_ . : / # + @ = -`, starting with a letter or digit. That admits the usual
id shapes (`b-0001`, UUIDs, `synthetic/digit_sum/3fa2`, `replay:17`, `b-0001#2`, base64) and no whitespace,
control, quote or non-ASCII character (nothing that could forge a line, a terminal escape or an instruction).

A refusal never repeats the id: it says what is wrong (its length, or the position of the first character outside
the rule), so the message itself carries none of the public's text.
"""

from __future__ import annotations

import re

MAX_ID = 128
ID_CHARS = "ASCII letters, digits and _ . : / # + @ = -"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/#+@=-]*", re.ASCII)
_CHAR_RE = re.compile(r"[A-Za-z0-9_.:/#+@=-]", re.ASCII)


def id_problem(value: str, limit: int = MAX_ID) -> str | None:
    """Why `value` is not an id (without quoting it), or None when it is one. `limit`: the most characters (rows
    minted from a battle id and a suffix get a little more room than the battle id itself)."""
    if not value:
        return "must be a non-empty id"
    if len(value) > limit:
        return f"is {len(value)} characters long; an id has at most {limit} ({ID_CHARS})"
    if _ID_RE.fullmatch(value):
        return None
    if not value[0].isascii() or not value[0].isalnum():
        return f"must start with an ASCII letter or digit (an id is {ID_CHARS}, at most {limit} characters)"
    bad = next(i for i, ch in enumerate(value) if not _CHAR_RE.fullmatch(ch))
    return f"character {bad + 1} is outside the id alphabet ({ID_CHARS}; no spaces, quotes or control characters)"


def checked_id(value: str, limit: int = MAX_ID) -> str:
    """`value` when it is an id; ValueError (the id not quoted) otherwise. For pydantic field validators."""
    problem = id_problem(value, limit)
    if problem is not None:
        raise ValueError(problem)
    return value
