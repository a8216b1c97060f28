"""The one JSON-lines reader: every JSONL file of the lab (feedback, data rows, eval items,
completions) is read through here, so they all agree on what a line is and what JSON is accepted.

- Lines are split on b"\\n" only. `str.splitlines()` also splits on U+2028, U+2029, U+0085 and
  other separators, which `canonical_json` (ensure_ascii=False) writes raw inside strings: a
  battle whose answer holds U+2028 would be cut in two by the next reader in the chain.
- Each line is strict JSON: a key repeated in one object is refused (`{"vote": "own", "vote":
  "other"}` is ambiguous; Python's json would silently keep the last), nesting deeper than
  MAX_DEPTH is refused, integers longer than MAX_INT_DIGITS digits are refused (Python's own
  4300-digit limit fails with an obscure message, and no count, id or seed is that long), NaN,
  Infinity and numbers that overflow to infinity are refused (they are not JSON and cannot be
  stored canonically), and so are strings holding lone UTF-16 surrogates (`"\\ud800"` parses in
  Python but cannot be encoded to UTF-8, so it could never be written to the notebook or a
  dataset).
- The input must be a regular file: a directory, FIFO (which would block the reader forever),
  socket or device is refused by name.

    lines = read_lines(path)            # every non-blank line: Line(number, value, problem)
    values = read_values(path)          # [(number, value)], or JSONLError at the first bad line
    is_parquet(path)                    # feedback and data files may be Parquet instead
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, NamedTuple

MAX_DEPTH = 64
MAX_INT_DIGITS = 100
_BLANK = " \t\r"  # JSON whitespace on a line already split on \n


class JSONLineError(ValueError):
    """One line is not acceptable JSON; the message says why (without the line number)."""


class JSONLError(ValueError):
    """A JSONL file (or what was given as one) cannot be read; the message names the file and line."""


class Line(NamedTuple):
    """One non-blank line: its 1-based number and either its value or what is wrong with it."""

    number: int
    value: Any
    problem: str | None


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        keys = [k for k, _ in pairs]
        dup = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise JSONLineError(f"key {_short(dup)} appears twice in one object (which value is meant is ambiguous)")
    return obj


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONLineError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS} are accepted)")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONLineError(f"number {_short(text)} is out of range (it would be infinite)")
    return value


def _constant(name: str) -> Any:
    raise JSONLineError(f"{name} is not a JSON number (NaN and Infinity are refused)")


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _check_tree(value: Any) -> None:
    """Depth and lone-surrogate check, iterative (a deep tree must not recurse either)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > MAX_DEPTH:
                raise JSONLineError(f"nested deeper than {MAX_DEPTH} levels")
            children = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in children:
                if isinstance(key, str):
                    _check_string(key)
                stack.append((child, depth + 1))
        elif isinstance(node, str):
            _check_string(node)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JSONLineError(f"a string holds a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}), "
                            "which is not a character and cannot be stored") from None


def loads(text: str) -> Any:
    """One strict JSON document (the rules of the module docstring); JSONLineError otherwise."""
    try:
        value = json.loads(text, object_pairs_hook=_pairs, parse_int=_int, parse_float=_float,
                           parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise JSONLineError(f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise JSONLineError(f"nested deeper than {MAX_DEPTH} levels") from None
    # Fast path: a line with few brackets and no \u escape cannot be deep or hold a surrogate.
    if text.count("[") + text.count("{") > MAX_DEPTH or "\\u" in text or "\\U" in text:
        _check_tree(value)
    return value


def parse_lines(data: bytes) -> list[Line]:
    """Every non-blank line of JSONL bytes, split on b"\\n" only, each parsed or given its problem."""
    out = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            out.append(Line(number, None, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)"))
            continue
        if number == 1:
            text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
        if not text.strip(_BLANK):
            continue
        try:
            out.append(Line(number, loads(text), None))
        except JSONLineError as e:
            out.append(Line(number, None, str(e)))
    return out


def describe_non_file(path: Path) -> str | None:
    """Why `path` cannot be read as a data file (missing, directory, FIFO, ...), or None if it is a regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a dangling symbolic link" if os.path.islink(path) else "does not exist"
    except OSError as e:  # ELOOP (a symlink loop), EACCES on a parent, ENAMETOOLONG, ...
        return f"cannot be opened ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    kind = next((name for test, name in kinds.items() if test(mode)), "not a regular file")
    return f"is {kind}, not a file"


PARQUET_MAGIC = b"PAR1"


def is_parquet(path: str | Path) -> bool:
    """A data file is Parquet when its name ends in .parquet (any case) or its first bytes are Parquet's magic."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        return True
    with open(path, "rb") as f:  # callers check describe_non_file first: this is a regular file
        return f.read(len(PARQUET_MAGIC)) == PARQUET_MAGIC


def read_file_bytes(path: str | Path) -> bytes:
    """The bytes of a regular file; JSONLError naming what the path is otherwise (a FIFO is never opened)."""
    path = Path(path)
    problem = describe_non_file(path)
    if problem is not None:
        raise JSONLError(f"{path}: {problem}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise JSONLError(f"{path}: cannot be read ({e.strerror})") from None


def read_lines(path: str | Path) -> list[Line]:
    """Every non-blank line of a JSONL file (see parse_lines); JSONLError if the path is no readable file."""
    return parse_lines(read_file_bytes(path))


def read_values(path: str | Path) -> list[tuple[int, Any]]:
    """(line number, value) of every non-blank line; JSONLError naming the file and line of the first bad one."""
    out = []
    for line in read_lines(path):
        if line.problem is not None:
            raise JSONLError(f"{path}:{line.number}: {line.problem}")
        out.append((line.number, line.value))
    return out
