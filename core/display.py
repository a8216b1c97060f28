"""Showing someone else's text to a person: control characters escaped, bidi overrides neutralised, lists bounded.

    print(f"meta key {shown(key)}: ...")           # one line, whatever the key holds
    html.escape(shown(answer, keep_newlines=True))   # a multi-line answer in the report
    for line in bounded(problems): print(line)       # the first LIST_LIMIT problems and a count of the rest
    print(f"error: {shown(one_line(message))}")       # a refusal with its list of problems, one terminal line

Battle text, feedback meta values, file names and bundle contents come from the public. Printed raw, an
ESC sequence sets the terminal title or clears the screen, a newline forges an output line, and a
right-to-left override (U+202E) makes `evil\u202etxt.exe` read as `evilexe.txt`. Every such character is
shown as its escape (`\\x1b`, `\\n`, `\\u202e`), so the text stays visible and inert.
"""

from __future__ import annotations

import unicodedata

# The first problems a message lists; the rest are counted (a 10,000-bar file printed 10,002 lines).
LIST_LIMIT = 20
# Characters that reorder or hide text without being "control" in the Cc sense: the bidi embeddings,
# overrides and isolates, the marks, and the zero-width ones (Unicode category Cf covers all of them).
_ESCAPED_CATEGORIES = ("Cc", "Cf", "Zl", "Zp", "Co", "Cs")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _SHORT:
        return _SHORT[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def shown(text: str, keep_newlines: bool = False, limit: int | None = None) -> str:
    """`text` with every control, format (bidi, zero-width) and separator character escaped; newlines kept when
    `keep_newlines` (multi-line content in an HTML block, never a terminal line); cut to `limit` characters
    (with a note of how many more) when given."""
    out = []
    for ch in text if limit is None else text[:limit]:
        if keep_newlines and ch == "\n":
            out.append(ch)
        elif unicodedata.category(ch) in _ESCAPED_CATEGORIES:
            out.append(_escape(ch))
        else:
            out.append(ch)
    if limit is not None and len(text) > limit:
        out.append(f"... ({len(text) - limit} more characters)")
    return "".join(out)


def one_line(text: str) -> str:
    """A message of several lines (a heading ending in ':' and its indented list) as one line: its lines stripped
    and joined by '; ', after a heading by a space. Split on newline only: any other separator is left to `shown`,
    which escapes it."""
    out = ""
    for line in (part.strip() for part in text.split("\n")):
        if line:
            out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def bounded(lines: list[str], limit: int = LIST_LIMIT) -> list[str]:
    """The first `limit` lines, then one line counting the rest (none when nothing is left out)."""
    if len(lines) <= limit:
        return list(lines)
    return [*lines[:limit], f"... and {len(lines) - limit} more"]
