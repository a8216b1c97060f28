"""Human side-by-side feedback: the battle format, its validation and the `check-feedback` summary.

A feedback file holds one battle per line (JSONL), or one per row (Parquet with the same columns):

    {"id": "b-0001",
     "messages": [{"role": "user", "content": "How many r's are in strawberry?"}],
     "own": "There are 3 r's in strawberry.",
     "other": "Strawberry has 2 r's.",
     "vote": "own",
     "meta": {"lang": "en", "category": "counting", "web": false}}

`messages` is the conversation up to the answered turn (roles system/user/assistant, the last one
from the user); `own` is our model's answer, `other` the opponent's; `vote` is own, other, tie or
both_bad; `meta` is optional and free-form. Blank lines are skipped. Lines are read by the one
JSON-lines reader (core/jsonl.py: split on "\n" only, duplicate keys, lone surrogates, deep nesting
and huge integers refused); a file is Parquet when its name ends in .parquet (any case) or its
bytes start with Parquet's magic `PAR1`. An id, answer or message made only of whitespace and
invisible characters (zero-width spaces, joiners, BOMs) counts as empty. An id is a short printable token (1-128
ASCII letters, digits and `_ . : / # + @ = -`, core/ids.py): any other is refused by line, without being quoted.

Validation reports every bad line (all of them are collected; the first 20 are listed) and a file
with any bad line is rejected as a whole: ingestion is all or nothing (DESIGN.md section 8).

    python run_agent.py check-feedback FILE
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.chat import Message
from core.display import bounded, shown
from core.ids import checked_id, id_problem
from core.jsonl import describe_non_file, is_parquet, parse_lines
from core.templates import FAMILY
from core.util import file_sha256
from tools.data.leak import normalized_hash, prompt_text

MAX_LISTED = 20
# A Parquet file's size says little about its decoded size (a 32 KB file decoded to a 4 GB peak: one long value,
# compressed to nothing, repeated through a dictionary). So a Parquet file is decoded a few rows at a time and
# refused once its decoded rows pass PARQUET_DECODED_LIMIT, before it is all in memory; a batch holds as many rows
# as PARQUET_BATCH_BYTES allows if every value were as long as its column's whole uncompressed chunk (the most one
# dictionary entry can be), and a file whose declared uncompressed data already passes the limit is not decoded.
PARQUET_DECODED_LIMIT = 512 * 1024**2  # about 100,000 battles of 5 kB; the peak is about twice this (as Python)
PARQUET_BATCH_BYTES = 64 * 1024**2
Vote = Literal["own", "other", "tie", "both_bad"]
# Chat-template control strings: every template family's special tokens (core/templates.py) and the `<|...|>` shape
# most tokenizers give theirs (ChatML, Llama-3, DeepSeek). In a battle's text they are the public's: an answer ending
# in `<|im_end|>\n<|im_start|>user ...` forges turns. The renderer splits them into ordinary tokens (core/chat.py
# `_encode`), so they train and evaluate as plain text; check-feedback reports the battles that carry them. With a
# lab (check-feedback --lab, run), the lab tokenizer's own special tokens are reported too (control_pattern): a team's
# tokenizer may read `[TOOL_CALLS]` or `<extra_0>` as control, which no fixed pattern knows.
CONTROL_STRINGS = re.compile("|".join([r"<\|[A-Za-z0-9_.-]{1,64}\|>",
                                       *sorted({re.escape(t) for f in FAMILY.values() for t in f.specials})]))
# Letters that render as nothing but are not in a format/space category (Hangul fillers, braille blank).
_BLANK_LETTERS = {"\u115f", "\u1160", "\u3164", "\uffa0", "\u2800"}


def is_blank(text: str) -> bool:
    """True when `text` shows nothing: only whitespace, control, format (zero-width) or filler characters."""
    return all(ch.isspace() or ch in _BLANK_LETTERS or unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp")
               for ch in text)


class Battle(BaseModel):
    """One side-by-side vote: a conversation, our answer, the opponent's answer and the human's verdict."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Unique battle id within the file, a short printable token (core/ids.py); the split is "
                    "derived from its hash.")
    messages: list[Message] = Field(description="The conversation up to the answered turn; the last turn is the user's.")
    own: str = Field(description="Our model's final answer; non-empty.")
    other: str = Field(description="The opponent's final answer; non-empty.")
    vote: Vote = Field(description="The human's verdict: own, other, tie or both_bad.")
    meta: dict[str, Any] | None = Field(None, description="Free-form tags (e.g. web, lang, category).")

    @field_validator("id", "own", "other")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if is_blank(v):
            raise ValueError("must be a non-empty string (only whitespace or invisible characters)")
        return v

    @field_validator("id")
    @classmethod
    def _id_is_a_token(cls, v: str) -> str:
        # A battle id is stored in the notebook, the split, the graph checkpoint and logs, and shown in problem
        # lists: a short printable token (core/ids.py), refused without being quoted back.
        return checked_id(v)

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, v: list[Message]) -> list[Message]:
        if not v:
            raise ValueError("must hold at least one message")
        for i, m in enumerate(v):
            if is_blank(m.content):
                raise ValueError(f"message {i}: content must be a non-empty string (only whitespace or invisible characters)")
        if v[-1].role != "user":
            raise ValueError(f"the last message must be from the user, got role '{v[-1].role}'")
        return v

    @property
    def preferred(self) -> str | None:
        """The human-preferred answer of a decisive battle; None for ties and both-bad."""
        return {"own": self.own, "other": self.other}.get(self.vote)

    @property
    def rejected(self) -> str | None:
        """The answer the human voted against in a decisive battle; None otherwise."""
        return {"own": self.other, "other": self.own}.get(self.vote)

    def prompt(self) -> str:
        """The battle's prompt text as the leak audit sees it (its user turns)."""
        return prompt_text([m.model_dump() for m in self.messages])


class Problem(BaseModel):
    """One thing wrong with one line (JSONL) or row (Parquet) of a feedback file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    line: int = Field(description="1-based line (JSONL) or row (Parquet) number.")
    field: str = Field(description="The offending field ('-' when the whole line is unreadable).")
    message: str = Field(description="What is wrong and what was expected.")

    def render(self, unit: str) -> str:
        # The field may be a meta key and the message may quote a value: someone else's text, shown escaped.
        return f"{unit} {self.line}: {shown(self.field, limit=200)}: {shown(self.message, limit=500)}"


class FeedbackError(ValueError):
    """A feedback file with at least one bad line (or no file at all); nothing from it was ingested."""

    def __init__(self, path: Path, unit: str, problems: list[Problem], why: str | None = None):
        self.path, self.unit, self.problems = path, unit, problems
        where = shown(str(path))
        super().__init__(f"{where}: {why}, nothing ingested" if why else
                         f"{where}: {len(problems)} problem(s), nothing ingested:\n" + render_problems(problems, unit))


def render_problems(problems: list[Problem], unit: str) -> str:
    lines = [f"  {p.render(unit)}" for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        lines.append(f"  ... and {len(problems) - MAX_LISTED} more")
    return "\n".join(lines)


class Parsed(BaseModel):
    """The result of reading a feedback file: the valid battles and every problem found."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    path: Path = Field(description="The file read.")
    sha256: str = Field(description="sha256 of the file's bytes.")
    unit: Literal["line", "row"] = Field(description="'line' for JSONL, 'row' for Parquet: how problems are located.")
    battles: list[Battle] = Field(description="Battles that validated, in file order.")
    lines: list[int] = Field(default_factory=list, description="The line (or row) of each battle, in the same order.")
    problems: list[Problem] = Field(description="Every problem, in file order.")


def _validate(obj: Any, line: int) -> tuple[Battle | None, list[Problem]]:
    if not isinstance(obj, dict):
        return None, [Problem(line=line, field="-", message=f"expected a JSON object, got {type(obj).__name__}")]
    try:
        return Battle.model_validate(obj), []
    except ValidationError as e:
        return None, [
            Problem(line=line, field=".".join(str(p) for p in err["loc"]) or "-", message=_message(err))
            for err in e.errors()
        ]


def _message(err: dict) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return "missing required field"
    if err["type"] == "extra_forbidden":
        return "unknown field (expected id, messages, own, other, vote, meta)"
    if err["type"] == "literal_error":
        return f"unknown {err['loc'][-1]} {err['input']!r}; expected {err['ctx']['expected']}"
    return msg


def _jsonl_records(data: bytes) -> list[tuple[int, Any, Problem | None]]:
    return [(line.number, line.value, None if line.problem is None else Problem(line=line.number, field="-", message=line.problem))
            for line in parse_lines(data)]


def _parquet_records(path: Path) -> list[tuple[int, Any, Problem | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = _bounded_rows(pq.ParquetFile(path))
    except pa.ArrowException as e:
        return [(1, None, Problem(line=1, field="-", message=f"not a readable Parquet file: {shown(str(e), limit=300)}"))]
    if isinstance(rows, Problem):
        return [(rows.line, None, rows)]
    return [(i, _clean_parquet_row(r), None) for i, r in enumerate(rows, start=1)]


def _bounded_rows(f) -> list[dict] | Problem:
    """The rows of a pyarrow ParquetFile, decoded in bounded batches; a Problem once they pass the limit."""
    meta = f.metadata
    chunks = [meta.row_group(g).column(c).total_uncompressed_size
              for g in range(meta.num_row_groups) for c in range(meta.num_columns)]
    declared = sum(chunks)
    if declared > PARQUET_DECODED_LIMIT:
        return Problem(line=1, field="-", message=f"the file declares {declared} bytes of uncompressed data; expected "
                       f"at most {PARQUET_DECODED_LIMIT}")
    batch = max(1, min(4096, PARQUET_BATCH_BYTES // max(chunks, default=1)))
    rows: list[dict] = []
    decoded = 0
    for part in f.iter_batches(batch_size=batch):
        decoded_rows = part.to_pylist()  # a dictionary column stays small in Arrow: its text is counted here
        decoded += sum(_text_bytes(r) for r in decoded_rows)
        if decoded > PARQUET_DECODED_LIMIT:
            return Problem(line=len(rows) + 1, field="-", message=f"the rows up to here decode to more than "
                           f"{PARQUET_DECODED_LIMIT} bytes; expected a feedback file that decodes to at most that")
        rows += decoded_rows
    return rows


def _text_bytes(value: Any) -> int:
    """The characters of a decoded row's text, and a few bytes for each other value."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + _text_bytes(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(_text_bytes(v) for v in value) + 8
    return 8


def _clean_parquet_row(row: dict) -> dict:
    # Parquet has no optional keys: a missing column value reads as None, and a struct column gives
    # every row every key of the union; drop those Nones so the row reads like its JSONL twin.
    row = {k: v for k, v in row.items() if v is not None}
    meta = row.get("meta")
    if isinstance(meta, list):  # a Parquet map column reads as a list of (key, value) pairs
        row["meta"] = dict(meta)
    elif isinstance(meta, dict):
        row["meta"] = {k: v for k, v in meta.items() if v is not None}
    return row


def parse_feedback(path: Path) -> Parsed:
    """Read and validate a feedback file, collecting every problem instead of stopping at the first."""
    path = Path(path)
    why = describe_non_file(path)
    if why is not None:  # never open a FIFO (it would block) or read a directory
        raise FeedbackError(path, "line", [], why=f"{why} (expected a JSONL or Parquet feedback file)")
    parquet = is_parquet(path)
    records = _parquet_records(path) if parquet else _jsonl_records(path.read_bytes())
    unit: Literal["line", "row"] = "row" if parquet else "line"
    battles: list[Battle] = []
    lines: list[int] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for line, obj, problem in records:
        if problem is not None:
            problems.append(problem)
            continue
        battle, found = _validate(obj, line)
        problems += found
        # Duplicates are checked on every line that has an id, valid or not, so all of them get reported.
        battle_id = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(battle_id, str) and id_problem(battle_id) is None:  # a bad id is reported, never quoted
            if battle_id in seen:
                problems.append(Problem(line=line, field="id", message=f"duplicate id {battle_id!r} (first on {unit} {seen[battle_id]})"))
                continue
            seen[battle_id] = line
        if battle is not None:
            battles.append(battle)
            lines.append(line)
    return Parsed(path=path, sha256=file_sha256(path), unit=unit, battles=battles, lines=lines, problems=problems)


def load_feedback(path: Path) -> Parsed:
    """Read a feedback file for ingestion: every battle, or FeedbackError and nothing."""
    parsed = parse_feedback(path)
    if parsed.problems:
        raise FeedbackError(parsed.path, parsed.unit, parsed.problems)
    if not parsed.battles:
        raise FeedbackError(parsed.path, parsed.unit, [Problem(line=1, field="-", message="the file holds no battles")])
    return parsed


class Quartiles(BaseModel):
    """Five-number summary of a length distribution (characters)."""

    model_config = ConfigDict(extra="forbid")

    min: float = Field(description="Shortest.")
    q1: float = Field(description="First quartile.")
    median: float = Field(description="Median.")
    q3: float = Field(description="Third quartile.")
    max: float = Field(description="Longest.")

    @classmethod
    def of(cls, values: list[int]) -> Quartiles:
        if len(values) == 1:
            v = float(values[0])
            return cls(min=v, q1=v, median=v, q3=v, max=v)
        q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(min=min(values), q1=q1, median=med, q3=q3, max=max(values))


class FeedbackSummary(BaseModel):
    """What `check-feedback` reports about the valid battles of a file."""

    model_config = ConfigDict(extra="forbid")

    battles: int = Field(description="Number of valid battles.")
    by_vote: dict[str, int] = Field(description="Battles per vote.")
    by_meta: dict[str, dict[str, int]] = Field(description="Per meta key, battles per value (list values count each element).")
    multi_turn: int = Field(description="Battles whose conversation has more than one user turn.")
    multi_turn_share: float = Field(description="multi_turn / battles.")
    own_chars: Quartiles | None = Field(description="Length quartiles of our answers, in characters.")
    other_chars: Quartiles | None = Field(description="Length quartiles of the opponent's answers, in characters.")
    duplicate_ids: int = Field(description="Lines rejected because their id repeats an earlier line's.")
    duplicate_prompts: int = Field(description="Battles whose normalized prompt equals an earlier battle's (they share a split).")
    control_answers: int = Field(0, description="Battles whose answers (own or other) carry chat-template control strings.")
    control_prompts: int = Field(0, description="Battles whose messages carry chat-template control strings.")
    control_lines: list[int] = Field(default_factory=list, description="Lines (rows) of the battles carrying them.")


def _meta_counts(battles: list[Battle]) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter] = {}
    for b in battles:
        for key, value in (b.meta or {}).items():
            values = value if isinstance(value, list) else [value]
            counts.setdefault(key, Counter()).update(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in values)
    return {k: dict(sorted(c.items())) for k, c in sorted(counts.items())}


def control_pattern(specials: Iterable[str] = ()) -> re.Pattern[str]:
    """CONTROL_STRINGS and `specials` (a tokenizer's special tokens: tokenizer_controls) as one pattern."""
    extra = sorted({re.escape(s) for s in specials if s}, key=len, reverse=True)
    return re.compile("|".join([CONTROL_STRINGS.pattern, *extra])) if extra else CONTROL_STRINGS


def tokenizer_controls(tokenizer_dir: Path) -> list[str]:
    """The texts the lab's tokenizer reads as special tokens (core/chat.py control_strings: its bos, eos, pad and
    additional special tokens and every added token marked special); [] when it does not load (refused, with its
    reason, by the session's own checks)."""
    from core import loading  # transformers: only with a lab
    from core.chat import control_strings

    try:
        return control_strings(loading.load_tokenizer(tokenizer_dir))
    except (OSError, ValueError):
        return []


def summarize(parsed: Parsed, controls: re.Pattern[str] = CONTROL_STRINGS) -> FeedbackSummary:
    """The summary of the valid battles; `controls`: what counts as a control string (control_pattern)."""
    battles = parsed.battles
    n = len(battles)
    multi = sum(1 for b in battles if sum(m.role == "user" for m in b.messages) > 1)
    prompts = Counter(normalized_hash(b.prompt()) for b in battles)
    return FeedbackSummary(
        battles=n,
        by_vote={v: sum(b.vote == v for b in battles) for v in ("own", "other", "tie", "both_bad")},
        by_meta=_meta_counts(battles),
        multi_turn=multi,
        multi_turn_share=multi / n if n else 0.0,
        own_chars=Quartiles.of([len(b.own) for b in battles]) if n else None,
        other_chars=Quartiles.of([len(b.other) for b in battles]) if n else None,
        duplicate_ids=sum(p.message.startswith("duplicate id") for p in parsed.problems),
        duplicate_prompts=sum(c - 1 for c in prompts.values()),
        control_answers=sum(1 for b in battles if _controls(controls, b.own, b.other)),
        control_prompts=sum(1 for b in battles if _controls(controls, *(m.content for m in b.messages))),
        control_lines=[line for b, line in zip(battles, parsed.lines, strict=True)
                       if _controls(controls, b.own, b.other, *(m.content for m in b.messages))],
    )


def _controls(controls: re.Pattern[str], *texts: str) -> bool:
    return any(controls.search(t) for t in texts)


def control_warning(parsed: Parsed, summary: FeedbackSummary) -> str | None:
    """The warning line about battles carrying chat-template control strings (counts and lines, never the text)."""
    if not summary.control_lines:
        return None
    where = ", ".join(bounded([str(n) for n in summary.control_lines], MAX_LISTED))
    return (f"warning: {len(summary.control_lines)} battle(s) carry chat-template control strings (answers "
            f"{summary.control_answers}, prompts {summary.control_prompts}), {parsed.unit}s {where}: they are trained "
            "and evaluated as plain text, never as the template's control tokens")


def render_summary(parsed: Parsed, summary: FeedbackSummary) -> str:
    def q(x: Quartiles | None) -> str:
        return "-" if x is None else f"min {x.min:g} / q1 {x.q1:g} / median {x.median:g} / q3 {x.q3:g} / max {x.max:g}"

    lines = [
        f"{shown(str(parsed.path))} (sha256 {parsed.sha256[:16]}...): {summary.battles} valid battles",
        "votes: " + ", ".join(f"{k} {v}" for k, v in summary.by_vote.items()),
        f"multi-turn: {summary.multi_turn} ({summary.multi_turn_share:.1%})",
        f"own answer chars: {q(summary.own_chars)}",
        f"other answer chars: {q(summary.other_chars)}",
        f"duplicate ids: {summary.duplicate_ids}, duplicate prompts: {summary.duplicate_prompts}",
    ]
    # Meta keys and values are someone else's text (an ESC sequence, a newline forging a line), and there may be
    # thousands of them: escaped, and the first MAX_LISTED of each listed with a count of the rest.
    metas = [f"meta.{shown(key, limit=100)}: " + ", ".join(bounded([f"{shown(v, limit=100)} {c}" for v, c in values.items()],
                                                                    MAX_LISTED))
             for key, values in summary.by_meta.items()]
    return "\n".join(lines + bounded(metas, MAX_LISTED))


def check_feedback_command(path: Path, specials: Iterable[str] = ()) -> int:
    """`python run_agent.py check-feedback FILE`: print the summary and any problems; 0 iff the file is valid.
    `specials`: the lab tokenizer's special tokens (tokenizer_controls), reported as control strings too."""
    path = Path(path)
    try:
        parsed = parse_feedback(path)
    except FeedbackError as e:
        print(f"check-feedback: {e}", file=sys.stderr)
        return 2
    summary = summarize(parsed, control_pattern(specials))
    print(render_summary(parsed, summary))
    warning = control_warning(parsed, summary)
    if warning is not None:
        print(warning, file=sys.stderr)
    if parsed.problems:
        print(f"{shown(str(path))}: {len(parsed.problems)} problem(s); a lab would ingest nothing from this file:",
              file=sys.stderr)
        print(render_problems(parsed.problems, parsed.unit), file=sys.stderr)
        return 1
    if not parsed.battles:
        print(f"{shown(str(path))}: the file holds no battles", file=sys.stderr)
        return 1
    return 0
