"""Promotion bars: a TOML file of pre-registered rules a candidate must clear to be promoted.

Each bar names a suite, a metric and a rule `<statistic> <op> <number> [* noise_floor]`:

    p_family = 10                            # at most 10 p-values tested this session (needed by p bars)

    [[bar]]
    suite = "math"
    metric = "correct"
    rule = "delta >= -1.0 * noise_floor"     # not worse than one noise floor

    [[bar]]
    suite = "math"
    metric = "correct"
    rule = "p <= 0.05"                       # Holm-adjusted across the session's comparisons
    test = "mcnemar_exact"

Statistics (candidate minus incumbent, paired by item): `delta` (mean difference), `t` (paired t),
`p` (one-sided p-value of `test` for "the candidate is better",
Holm-adjusted), `ci_low` / `ci_high` (percentile bootstrap bounds at
`confidence`). `noise_floor` is the suite/metric's mean absolute delta between incumbent replicates.

`p_family` pre-registers how many p-values the session may test in all. Holm's procedure controls
the family-wise error only over a family fixed in advance; recomputed over the p-values seen so far,
the first comparison would be tested at the full alpha and every later one would add error. So each
comparison is Holm-adjusted over the session's p-values so far plus its own, with the not yet tested
rest of the family counted as p = 1 (the worst case: a smaller future p can only lower an adjusted
p), which makes every sequential rejection one that Holm over the whole family would also make.
Registering stores the canonical form, its sha256 and the time in the notebook (invariant 2).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from memory.notebook import BarsRecord, Notebook

Statistic = Literal["delta", "t", "p", "ci_low", "ci_high"]
Op = Literal[">=", "<=", ">", "<"]
_RULE = re.compile(r"^\s*(delta|t|p|ci_low|ci_high)\s*(>=|<=|>|<)\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
                   r"\s*(\*\s*noise_floor)?\s*$")


class Bar(BaseModel):
    """One pre-registered promotion rule."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    suite: str = Field(min_length=1, description="Suite the bar reads.")
    metric: str = Field(min_length=1, description="Per-item metric of that suite, e.g. correct, strict, looping.")
    rule: str = Field(description="'<delta|t|p|ci_low|ci_high> <op> <number> [* noise_floor]'.")
    test: Literal["mcnemar_exact", "paired_t", "wilcoxon"] | None = Field(
        None, description="Paired test giving the p-value; required for p bars, refused otherwise.")
    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="Bootstrap CI level for ci_low/ci_high bars.")

    @model_validator(mode="after")
    def _rule_parses(self) -> Bar:
        match = _RULE.match(self.rule)
        if match is None:
            raise ValueError(f"rule {self.rule!r}: expected '<delta|t|p|ci_low|ci_high> <op> <number> [* noise_floor]'")
        if (match.group(1) == "p") != (self.test is not None):
            raise ValueError("a p bar needs `test` (mcnemar_exact, paired_t or wilcoxon); other bars take none")
        if match.group(1) == "p" and match.group(4):
            raise ValueError("a p-value threshold cannot be written in noise-floor units")
        return self

    @property
    def statistic(self) -> Statistic:
        return _RULE.match(self.rule).group(1)

    @property
    def op(self) -> Op:
        return _RULE.match(self.rule).group(2)

    @property
    def value(self) -> float:
        return float(_RULE.match(self.rule).group(3))

    @property
    def in_noise_units(self) -> bool:
        return _RULE.match(self.rule).group(4) is not None

    def canonical(self) -> dict[str, Any]:
        """Parsed form: the same rule written differently hashes the same."""
        return {"suite": self.suite, "metric": self.metric, "statistic": self.statistic, "op": self.op,
                "value": self.value, "unit": "noise_floor" if self.in_noise_units else "absolute",
                "test": self.test, "confidence": self.confidence if self.statistic.startswith("ci") else None}


class Bars(BaseModel):
    """A bars file."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bar: tuple[Bar, ...] = Field(min_length=1, description="The bars; a candidate is promoted only if all hold.")
    p_family: int | None = Field(None, ge=1, description="Most p-values the session will test (Holm family size); "
                                                         "required when any bar is a p bar.")

    @model_validator(mode="after")
    def _family_for_p_bars(self) -> Bars:
        if any(b.statistic == "p" for b in self.bar) and self.p_family is None:
            raise ValueError("p bars need p_family: the most p-values this session will test, fixed in advance")
        return self

    def canonical(self) -> dict[str, Any]:
        return {"bars": [b.canonical() for b in self.bar], "p_family": self.p_family}

    @classmethod
    def from_canonical(cls, spec: dict[str, Any]) -> Bars:
        """Rebuild from the stored canonical spec (what compare reads back from the notebook)."""
        bars = []
        for c in spec["bars"]:
            unit = " * noise_floor" if c["unit"] == "noise_floor" else ""
            bars.append(Bar(suite=c["suite"], metric=c["metric"], rule=f"{c['statistic']} {c['op']} {c['value']!r}{unit}",
                            test=c["test"], confidence=c["confidence"] or 0.95))
        return cls(bar=tuple(bars), p_family=spec.get("p_family"))


def _where(loc: tuple) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")


def load(path: str | Path) -> Bars:
    """Parse and validate a bars file; errors name the file and the field (e.g. bar[1].rule)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from err
    try:
        return Bars.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        raise ValueError(f"{path}: {_where(first['loc'])}: {first['msg']}") from err


def register(nb: Notebook, session: str, bars: Bars) -> BarsRecord:
    """Store the bars' canonical form, sha256 and registration time (and a register_bars decision)."""
    return nb.register_bars(session, bars.canonical())
