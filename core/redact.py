"""Secrets out of every message: the one redaction the notebook, the logs, the planner's prompt and the
endpoint clients' errors apply before text is stored, logged, rendered or sent.

Two kinds of secret are removed: the values this process holds (the API keys read from the
environment variables lab.toml names: `hold()` is called where a key is read), whatever shape they
have; and anything shaped like a credential (an `sk-...` key, a bearer token, `user:password@` in a
URL, ...), held or not. An OpenAI-compatible endpoint whose 401 body echoes the Authorization header
is the case this exists for: its error text would otherwise carry the key into hash-chained decisions
that can never be deleted.

The held values are process state on purpose: a secret the process holds is a fact about the process,
and a log record or a job's failure text has no other way to know it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

MARK = "[redacted]"
# Shorter values are not secrets anyone would use, and redacting them would blank ordinary words.
MIN_HELD = 8

# Shapes of credentials, each with what it is called (agent/config.py refuses any of them in lab.toml).
# Group 1, where there is one, is kept: the part that says what the secret was ("Bearer ", "https://").
SHAPES: list[tuple[re.Pattern[str], str]] = [
    # Real keys are long random strings: a digit is required so that names like "sk-learn-tests" pass.
    (re.compile(r"\bsk-(?=[A-Za-z_-]*[0-9])[A-Za-z0-9_-]{16,}"), "an API key (sk-...)"),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{16,}|github_pat_[A-Za-z0-9_]{16,})"), "a GitHub token"),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{8,}"), "a Slack token"),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), "an AWS access key"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "a Hugging Face token"),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"), "a Google API key"),
    (re.compile(r"(\bbearer\s+)[^\s\"',;]{8,}", re.IGNORECASE), "a bearer token"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@:]*:[^/\s@]*(?=@)"), "credentials inside a URL (user:password@)"),
]

_held: set[str] = set()


def hold(value: str | None) -> None:
    """Note a secret this process holds (an API key just read): it is redacted from now on."""
    if value and len(value) >= MIN_HELD:
        _held.add(value)


def hold_env(env: Mapping[str, str], names: Iterable[str]) -> None:
    """Hold the values of the environment variables `names` (those lab.toml names as key variables)."""
    for name in names:
        hold(env.get(name))


def secret_kind(text: str) -> str | None:
    """What kind of credential `text` looks like, or None."""
    return next((kind for pattern, kind in SHAPES if pattern.search(text)), None)


def redact(text: str) -> str:
    """`text` with every held secret and every credential-shaped string replaced by MARK."""
    # Longest first: a held value that contains another is removed whole.
    for value in sorted(_held, key=len, reverse=True):
        if value in text:
            text = text.replace(value, MARK)
    for pattern, _ in SHAPES:
        text = pattern.sub(lambda m: (m.group(1) or "") + MARK if m.re.groups else MARK, text)
    return text


def redact_data(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, tuples, strings, numbers) with `redact` applied to every string in
    it, keys included; structure and other values unchanged."""
    # Exact types only: a subclass (a named tuple, a library's own mapping) is passed through as it is.
    if isinstance(value, str):
        return redact(value)
    if type(value) is dict:
        return {redact_data(k): redact_data(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(redact_data(v) for v in value)
    return value


def install_log_redaction() -> None:
    """Redact every log record of this process, whichever logger and handler it goes through: the
    record factory is the one place all of them pass (a filter on one handler misses the others). The
    traceback of a logged exception is formatted and redacted here too, before any handler formats it."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "redacts", False):
        return

    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        try:
            record.msg, record.args = redact(record.getMessage()), None
        except (TypeError, ValueError):  # arguments that do not fit the format: logged as they are, redacted
            record.msg, record.args = redact(f"{record.msg} (arguments that do not fit it: {record.args!r})"), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return record

    make.redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(make)
