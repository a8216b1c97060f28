"""The one shape of every `python -m X CONFIG.json` job entry point.

    python -m trainers.sft run/config.json
    python -m trainers.merge soup merge/config.json
    python -m evals.job eval/config.json
    python -m tools.data.datasets winner_sft build/config.json

A missing or unreadable file, invalid JSON, or a config that fails validation is one message naming the file
(and the field, or the line and column of the JSON error), exit status 2, never a traceback. A job that fails
for a reason its own module declares as bad input (`bad_input` exceptions) also exits 2; anything else is a
real failure and keeps its traceback for the job log.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

Job = tuple[type[BaseModel], Callable[[Any], Any]]


class EntryError(Exception):
    """The command line or the config file is not what the job needs (exit status 2)."""


def load_config(path: Path, config_type: type[BaseModel]) -> BaseModel:
    """Reads and validates a JSON config file; every problem becomes one EntryError naming the file."""
    if not path.exists():
        raise EntryError(f"{path}: no such file (expected a JSON config for {config_type.__name__})")
    if not path.is_file():
        raise EntryError(f"{path}: not a regular file (expected a JSON config for {config_type.__name__})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EntryError(f"{path}: cannot be read as UTF-8 text ({e.__class__.__name__})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise EntryError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except RecursionError:
        raise EntryError(f"{path}: JSON nested too deeply") from None
    try:
        return config_type.model_validate(data)
    except ValidationError as e:
        raise EntryError(f"{path}: {format_validation(e, config_type.__name__)}") from None


def format_validation(err: ValidationError, what: str) -> str:
    """`N problem(s) in <what>: field a.b: message (got 'x'); ...` on one line, the first five listed."""
    parts = []
    for item in err.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"]) or "-"
        got = item.get("input")
        shown = f" (got {got!r:.60})" if item["type"] != "missing" and not isinstance(got, dict | list) else ""
        parts.append(f"field {where}: {item['msg'].removeprefix('Value error, ')}{shown}")
    more = f"; and {err.error_count() - 5} more" if err.error_count() > 5 else ""
    return f"{err.error_count()} problem(s) in {what}: " + "; ".join(parts) + more


def run_main(
    prog: str,
    jobs: Job | dict[str, Job],
    argv: Sequence[str] | None = None,
    bad_input: tuple[type[BaseException], ...] = (),
    check_failed: tuple[type[BaseException], ...] = (),
    summary: Callable[[Any, Any], str] | None = None,
) -> int:
    """Parses `[KIND] CONFIG.json`, runs the job and prints its result; returns the exit status.

    `bad_input` exceptions exit 2 (the input is wrong), `check_failed` ones exit 1 (a check refused a valid
    input, e.g. a leak audit); `summary(config, result)` is the printed line instead of the result's JSON."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config_type, fn, path = _pick(prog, jobs, args)
        config = load_config(path, config_type)
        result = fn(config)
    except EntryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except check_failed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except bad_input as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    if summary is not None:
        print(summary(config, result))
    elif isinstance(result, BaseModel):
        print(result.model_dump_json(indent=2))
    elif result is not None:
        print(json.dumps(result, indent=2, default=str))
    return 0


def _pick(prog: str, jobs: Job | dict[str, Job], args: list[str]) -> tuple[type[BaseModel], Callable, Path]:
    if isinstance(jobs, dict):
        usage = f"usage: {prog} {{{'|'.join(sorted(jobs))}}} CONFIG.json"
        if len(args) != 2 or args[0] not in jobs:
            raise EntryError(usage)
        return *jobs[args[0]], Path(args[1])
    if len(args) != 1 or args[0].startswith("-"):
        raise EntryError(f"usage: {prog} CONFIG.json")
    return *jobs, Path(args[0])
