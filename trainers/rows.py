"""Training data formats: one JSON object per line (JSONL), parsed into these pydantic rows.

- SFT (`trainers/sft.py`), `SFTRow`:
      {"id": "r1", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
  Every assistant turn (content + its end-of-turn token, in the model's own chat template) is supervised;
  the serving system prompt is added by the renderer when the row has no system turn.
- DPO + NLL (`trainers/dpo.py`), `PreferenceRow`:
      {"id": "p1", "prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5"}
  `prompt` ends with a user turn; `chosen`/`rejected` are the two assistant answers.
- KL-leashed CE (`trainers/klce.py`), `KLCERow`:
      {"id": "k1", "messages": [...], "kl_only": false}
  Rows with `kl_only: true` are replay rows: their assistant tokens carry only the KL term to the
  frozen parent (no one-hot cross-entropy).
- Rejection-sampling FT (`trainers/rft.py`): prompt rows are eval items (`evals.types.Item`: id,
  messages ending with a user turn, gold answer), so the RFT verifier is the eval scorer itself.

A row id, when given, is a short printable token (core/ids.py). `read_rows(path, Row)` parses a whole file before anything else happens and names the file, line and
field of the first bad row.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.chat import Message
from core.ids import MAX_ID, checked_id
from core.jsonl import JSONLError, describe_non_file, read_lines

# A row id is a battle's or item's id, or one minted from it with a short suffix (`<battle>#<k>`, `<source>:<n>`):
# the id rule of core/ids.py with room for the suffix.
ROW_ID_MAX = MAX_ID + 32


def _row_id(value: str | None) -> str | None:
    return None if value is None else checked_id(value, ROW_ID_MAX)


class SFTRow(BaseModel):
    """A conversation whose assistant turns are the training targets."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, description="Optional stable row id (for audits and provenance).")
    messages: list[Message] = Field(min_length=1, description="The conversation; at least one assistant turn.")

    _id_is_a_token = field_validator("id")(_row_id)

    @model_validator(mode="after")
    def _has_assistant_turn(self) -> SFTRow:
        if not any(m.role == "assistant" for m in self.messages):
            raise ValueError("messages: no assistant turn to train on")
        return self


class PreferenceRow(BaseModel):
    """A prompt with a preferred and a dispreferred assistant answer."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, description="Optional stable row id (for audits and provenance).")
    prompt: list[Message] = Field(min_length=1, description="The conversation up to the answer; ends with a user turn.")
    chosen: str = Field(min_length=1, description="The preferred assistant answer.")
    rejected: str = Field(min_length=1, description="The dispreferred assistant answer.")

    _id_is_a_token = field_validator("id")(_row_id)

    @model_validator(mode="after")
    def _check(self) -> PreferenceRow:
        if self.prompt[-1].role != "user":
            raise ValueError(f"prompt: the last turn must be the user's, got {self.prompt[-1].role!r}")
        if self.chosen == self.rejected:
            raise ValueError("chosen and rejected are the same text")
        return self


class KLCERow(SFTRow):
    """An SFT conversation, or (kl_only) a replay conversation that only anchors to the parent."""

    kl_only: bool = Field(False, description="Replay row: KL to the parent on its assistant tokens, no cross-entropy.")


Row = TypeVar("Row", bound=BaseModel)


class RowsError(ValueError):
    """A data file that does not parse; the message names the file, line and field."""


def read_rows(path: str | Path, row_type: type[Row]) -> list[Row]:
    """Parses every line of a JSONL file into `row_type`; the first bad line raises RowsError.

    Lines come from the one JSON-lines reader (core/jsonl.py), which splits on "\\n" only."""
    path = Path(path)
    problem = describe_non_file(path)
    if problem is not None:
        raise RowsError(f"{path}: data file {problem}")
    rows = []
    try:
        lines = read_lines(path)
    except JSONLError as e:
        raise RowsError(str(e)) from None
    for lineno, value, problem in lines:
        if problem is not None:
            raise RowsError(f"{path}:{lineno}: not valid JSON ({problem})")
        try:
            rows.append(row_type.model_validate(value))
        except ValidationError as e:
            err = e.errors()[0]
            msg = err["msg"].removeprefix("Value error, ")
            where = ".".join(str(p) for p in err["loc"])
            detail = f"field {where}: {msg}" if where else msg
            raise RowsError(f"{path}:{lineno}: {detail} (expected a {row_type.__name__})") from e
    if not rows:
        raise RowsError(f"{path}: no rows")
    return rows


def write_rows(path: str | Path, rows: list[BaseModel]) -> Path:
    """Writes rows as JSONL (one `model_dump_json` per line)."""
    path = Path(path)
    path.write_text("".join(r.model_dump_json(exclude_none=True) + "\n" for r in rows), encoding="utf-8")
    return path
