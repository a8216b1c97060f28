"""Promotion bars: a TOML file of pre-registered rules a candidate must clear to be promoted.

Each bar names a suite, a metric and a rule `<statistic> <op> <number> [* noise_floor]`:

    p_family = 10                            # at most 10 p-values tested this session (needed by p bars)
    replicates = 3                           # bars without a p-value read the mean of 3 served draws a side

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

`replicates` (default 1: each side's first look alone) pre-registers how many served draws every bar other
than a p bar reads: each side's per-item values are averaged over its replicates 0 .. n-1 at its decoding (the
first eval of each replicate index; the incumbent's come from its calibration, the candidate's replicate k
samples with the same seed k). By a normal approximation (an estimate, not a measurement): when nothing
changed, a single draw against a single draw of the incumbent's differs with a spread of about 1.25 noise
floors (one floor is the mean |difference| of two draws), so a one-floor guard read on single looks rejects a
truly equal candidate about one time in five; on the mean of 3 draws a side, about one in twelve, and a real
loss of more than a floor is caught more often, not less. The
floor itself (the bar's unit) is unchanged: the guard still bounds the metric's true difference by one floor.
Under greedy decoding a look is exact and only replicate 0 is read. p bars always read replicate 0: their
test is over items, and mcnemar needs the 0/1 values of one draw.

`p_family` pre-registers how many p-values the session may test in all. Holm's procedure controls
the family-wise error only over a family fixed in advance; recomputed over the p-values seen so far,
the first comparison would be tested at the full alpha and every later one would add error. So each
comparison is Holm-adjusted over the session's p-values so far plus its own, with the not yet tested
rest of the family counted as p = 1 (the worst case: a smaller future p can only lower an adjusted
p), which makes every sequential rejection one that Holm over the whole family would also make.
Registering stores the canonical form, its sha256 and the time in the notebook (invariant 2).

The sequential rule (issue 41), registered with the bars before any score:

    looks = 3               # a p bar may be read at up to 3 looks: look j reads the candidate's served draws
                            # 0 .. j-1 of its suite (per-item means), each a fresh draw judged in both positions
    look_spending = 0.5     # look j gets the share f(j/L) - f((j-1)/L) of the alpha, f(t) = t**0.5
    continue_p = 0.5        # a look may continue only while its raw p <= 0.5 (the candidate leads)
    audit_margin = 3.0      # a guard whose suite the judge contradicted holds at 3x its margin until cleared

The comparison's p-value is p* = min_j p_j / w_j over the looks taken (w_j: the look's share), a weighted
Bonferroni bound over the registered looks: the alpha-spending boundary of Lan & DeMets (1983, Biometrika
70:659-663) with the power family of spending functions of Kim & DeMets (1987, Biometrika 74:149-154), each
look's boundary set by the union bound instead of the recursive normal integral. Why the union bound: the
looks re-judge the same prompts (a fresh draw of the candidate's answers), so their statistics do not have the
independent increments the exact group-sequential boundary assumes; P(p* <= u) <= sum_j P(p_j <= u w_j) <= u holds
under any dependence between looks and for any rule of when to stop, since a look not taken only leaves a term out
of the minimum. p* is one p-value of the session's Holm family whatever the number of looks, so the family-wise
error control across the session is unchanged; a look that leaves the comparison unresolved spends none.
`looks` needs p bars whose test reads means (paired_t or wilcoxon: mcnemar needs one draw's 0/1 values).

`load(path, suites)` refuses, listing every problem with the file and bar index: TOML that is not
UTF-8 or not TOML, wrong types (strict: "0.05" is no number, true is no integer), NaN/inf, a rule
that does not parse, a p threshold outside (0, 1] or a p bar bounding p from below, `p_family`
below the number of p bars, the same bar twice, a set no value can satisfy (bounds on the same
statistic that cross, or ci_low held above what ci_high is held below; a noise-floor unit is
taken as positive), and, given the lab's suites, a suite the lab does not evaluate or a metric
its scorer does not produce (SCORER_METRICS).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from core.display import bounded, shown
from core.jsonl import JSONLError, read_file_bytes
from memory.notebook import BarsRecord, Notebook
from memory.records import BarsSpec, Op, Rule, Statistic

# Per-item metrics each scorer writes into Outcome.values (tests/hostile/test_bars.py runs the
# scorers that need no model and checks their outcomes against this table).
SCORER_METRICS: dict[str, frozenset[str]] = {
    "math": frozenset({"correct", "no_answer"}),
    "mcq": frozenset({"correct", "unparsed", "ambiguous"}),
    "synthetic": frozenset({"correct", "unparsed"}),
    "constraints": frozenset({"strict", "loose", "strict_frac", "loose_frac", "scoring_mode_ifeval", "ifeval_strict",
                              "ifeval_loose", "ifeval_strict_followed", "ifeval_loose_followed", "ifeval_instructions"}),
    "loops": frozenset({"ngram_repeat_ratio", "tail_loop", "catastrophic", "looping"}),
    "length_stop": frozenset({"n_tokens", "stopped", "truncated", "empty", "replacement_char"}),
    "battle_margin": frozenset({"prefers_chosen", "margin"}),
    "reward_proxy": frozenset({"win", "margin"}),
    "judge": frozenset({"unparsed", "win_score", "both_bad", "same_position"}),
}
_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
_RULE = re.compile(r"^\s*(delta|t|p|ci_low|ci_high)\s*(>=|<=|>|<)\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
                   r"\s*(\*\s*noise_floor)?\s*$")


class Bar(BaseModel):
    """One pre-registered promotion rule."""

    model_config = _STRICT
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
        statistic, op, value = match.group(1), match.group(2), float(match.group(3))
        problems = []
        if not math.isfinite(value):
            problems.append(f"rule {self.rule!r}: the number must be finite")
        if (statistic == "p") != (self.test is not None):
            problems.append("a p bar needs `test` (mcnemar_exact, paired_t or wilcoxon); other bars take none")
        if statistic == "p" and match.group(4):
            problems.append("a p-value threshold cannot be written in noise-floor units")
        if statistic == "p" and not 0 < value <= 1:
            problems.append(f"rule {self.rule!r}: a p threshold must lie in (0, 1]")
        if statistic == "p" and op in (">", ">="):
            problems.append(f"rule {self.rule!r}: a p bar bounds p from above ('p <= alpha'); a lower bound promotes the insignificant")
        if problems:
            raise ValueError("; ".join(problems))
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

    def parsed(self) -> Rule:
        """Parsed form: the same rule written differently hashes the same."""
        return Rule(suite=self.suite, metric=self.metric, statistic=self.statistic, op=self.op, value=self.value,
                    unit="noise_floor" if self.in_noise_units else "absolute", test=self.test,
                    confidence=self.confidence if self.statistic.startswith("ci") else None)

    def canonical(self) -> dict[str, Any]:
        return self.parsed().model_dump(mode="json")


class Bars(BaseModel):
    """A bars file."""

    model_config = _STRICT
    bar: tuple[Bar, ...] = Field(min_length=1, strict=False, description="The bars; a candidate is promoted only if all hold.")
    p_family: int | None = Field(None, ge=1, le=1_000_000, validate_default=True,
                                 description="Most p-values the session will test (Holm family size); "
                                             "required when any bar is a p bar, and at least their number.")
    floor_unit: Literal["replicates", "resolvable"] = Field(
        "resolvable", description="What one noise floor is in bars written in its units. `resolvable` (the default): "
        "the replicates' mean absolute delta, but never finer than the suite can resolve: one item (1/n), or the "
        "standard error of the incumbent's mean at its observed rate, whichever is larger. `replicates`: the mean "
        "absolute delta alone, however fine (bars registered before this key read so, and replay so).")
    replicates: int = Field(1, ge=1, le=16, description="Served draws a side that every bar other than a p bar "
                            "averages per item (1: the first look alone); the incumbent needs a calibration of K >= "
                            "this many replicates.")
    looks: int = Field(1, ge=1, le=8, description="Most looks at a p bar (the sequential rule above): look j reads "
                       "the candidate's served draws 0 .. j-1 of the bar's suite; 1: one look, as before the key.")
    look_spending: float = Field(1.0, gt=0.0, le=4.0, description="rho of the spending function t**rho sharing a p "
                                 "bar's alpha over its looks (below 1 the first look gets more, above 1 the later).")
    continue_p: float = Field(0.5, gt=0.0, le=1.0, description="A look whose raw p is above this decides (the "
                              "candidate clearly fails): no more evidence is bought for it.")
    audit_margin: float | None = Field(None, ge=1.0, le=100.0, description="Suite audit: a guard (a noise-floor bar "
                                       "allowing a loss) whose delta is past its margin on a candidate whose p bar "
                                       "holds flags its suite; from then on it holds at this many times its margin, "
                                       "until a person clears the suite. None: no audit.")

    @model_validator(mode="after")
    def _looks_read_means(self) -> Bars:
        if self.looks > 1 and not any(b.statistic == "p" for b in self.bar):
            raise ValueError("looks > 1 is a rule for p bars, and no bar is one")
        if self.looks > 1 and any(b.test == "mcnemar_exact" for b in self.bar):
            raise ValueError("looks > 1 average draws per item: a p bar's test must be paired_t or wilcoxon "
                             "(mcnemar_exact needs one draw's 0/1 values)")
        return self

    @field_validator("p_family")
    @classmethod
    def _family_for_p_bars(cls, family: int | None, info: ValidationInfo) -> int | None:
        n_p = sum(b.statistic == "p" for b in info.data.get("bar", ()))
        if n_p and family is None:
            raise ValueError("p bars need p_family: the most p-values this session will test, fixed in advance")
        if family is not None and family < n_p:
            raise ValueError(f"p_family = {family} is smaller than the {n_p} p bars (every comparison tests each of them)")
        return family

    def spec(self) -> BarsSpec:
        """The typed canonical form: what is registered, hashed, and read back by everyone (memory/state.py)."""
        return BarsSpec(bars=tuple(b.parsed() for b in self.bar), p_family=self.p_family,
                        replicates=self.replicates, floor_unit=self.floor_unit, looks=self.looks,
                        look_spending=self.look_spending, continue_p=self.continue_p, audit_margin=self.audit_margin)

    def canonical(self) -> dict[str, Any]:
        """The stored form (BarsSpec.canonical: replicates = 1 and floor_unit = replicates left out, so that bars
        registered before those keys existed keep their sha256 and read back as what they were)."""
        return self.spec().canonical()


class BarsError(ValueError):
    """A bars file that cannot be registered; the message lists every problem with its bar index."""

    def __init__(self, path: Path, problems: list[str]):
        self.path, self.problems = path, problems
        # Bounded and escaped: a 10,000-bar file printed 10,002 lines, and a key may carry a newline or an ESC.
        listed = bounded([shown(p, limit=500) for p in problems])
        super().__init__(f"{shown(str(path))}: {len(problems)} problem(s):\n" + "\n".join(f"  {p}" for p in listed))


def _where(loc: tuple) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")


def _errors(err: ValidationError, prefix: tuple = ()) -> list[str]:
    out = []
    for e in err.errors():
        got = e.get("input")
        shown = f" (got {got!r})" if isinstance(got, str | int | float | bool) and e["type"] != "value_error" else ""
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            shown, msg = "", ("unknown key (a bar has suite, metric, rule, test, confidence)" if prefix else
                              "unknown key (a bars file holds p_family, replicates, floor_unit, looks, look_spending, continue_p, "
                              "audit_margin and [[bar]] tables)")
        out.append(f"{_where(prefix + tuple(e['loc'])) or '(top level)'}: {msg}{shown}")
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = read_file_bytes(path)
    except JSONLError as e:
        raise BarsError(path, [str(e).removeprefix(f"{path}: ")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise BarsError(path, [f"line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x})"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BarsError(path, [f"not valid TOML: {e}"]) from None
    except ValueError as e:  # tomllib's int() past Python's 4300-digit limit
        raise BarsError(path, [f"not valid TOML: {e.args[0].split(':')[0]} (TOML integers are 64-bit)"]) from None
    except RecursionError:
        raise BarsError(path, ["not valid TOML: nested too deeply"]) from None


def _bar_problems(raw: dict[str, Any]) -> tuple[list[tuple[int, Bar]], list[str]]:
    """Each [[bar]] validated on its own, so every bad bar is reported, not only the first."""
    tables = raw.get("bar")
    if not isinstance(tables, list) or not tables:
        return [], ["bar: at least one [[bar]] table is needed"]
    bars, problems = [], []
    for i, table in enumerate(tables):
        try:
            bars.append((i, Bar.model_validate(table)))
        except ValidationError as e:
            problems += _errors(e, ("bar", i))
    return bars, problems


def _lab_problems(tables: list[Any], suites: Mapping[str, str]) -> list[str]:
    """Suite and metric of every [[bar]] table against the lab, read from the raw tables so that a bar
    with another problem is checked here too."""
    problems = []
    for i, t in enumerate(tables):
        suite, metric = (t.get("suite"), t.get("metric")) if isinstance(t, dict) else (None, None)
        if not isinstance(suite, str):
            continue
        if suite not in suites:
            problems.append(f"bar[{i}].suite: unknown suite {suite!r} (the lab evaluates: {', '.join(sorted(suites)) or 'none'})")
        elif isinstance(metric, str) and metric not in SCORER_METRICS[suites[suite]]:
            known = ", ".join(sorted(SCORER_METRICS[suites[suite]]))
            problems.append(f"bar[{i}].metric: suite {suite!r} (scorer {suites[suite]}) has no metric {metric!r} (it has: {known})")
    return problems


def _set_problems(bars: list[tuple[int, Bar]]) -> list[str]:
    """Duplicates, and bounds on one statistic that no value can meet at once (bars keep their file index)."""
    problems, first, bounds = [], {}, {}
    for i, b in bars:
        key = _canonical_key(b)
        if key in first:
            problems.append(f"bar[{i}]: the same bar as bar[{first[key]}]")
            continue
        first[key] = i
        side = "low" if b.op in (">", ">=") else "high"
        group = (b.suite, b.metric, b.statistic, b.in_noise_units, b.confidence if b.statistic.startswith("ci") else None)
        bounds.setdefault(group, {"low": [], "high": []})[side].append((b.value, b.op in (">", "<"), i))
    for (suite, metric, stat, noise, conf), sides in bounds.items():
        problems += _crossing(sides["low"], sides["high"], f"{suite}/{metric} {stat}")
        if stat == "ci_low":  # ci_low <= ci_high always, so ci_low's floor must stay under ci_high's ceiling
            ceiling = bounds.get((suite, metric, "ci_high", noise, conf), {"high": []})["high"]
            problems += _crossing(sides["low"], ceiling, f"{suite}/{metric} ci_low and ci_high")
    return problems


def _crossing(lows: list, highs: list, what: str) -> list[str]:
    if not lows or not highs:
        return []
    low, high = max(lows), min(highs, key=lambda h: (h[0], not h[1]))
    if low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1])):
        return [f"bar[{low[2]}] and bar[{high[2]}]: no value of {what} can satisfy both (a bar set no candidate can pass)"]
    return []


def _bar_index(problem: str) -> int:
    """Sort key: file-level problems first, then by the first bar index the problem names."""
    match = re.match(r"bar\[(\d+)\]", problem)
    return int(match.group(1)) if match else -1


def _canonical_key(bar: Bar) -> str:
    return repr(sorted(bar.canonical().items()))


def load(path: str | Path, suites: Mapping[str, str] | None = None) -> Bars:
    """Parse and validate a bars file; BarsError lists every problem (e.g. bar[1].rule). With `suites`
    (the lab's suite name -> scorer), every bar must name one of them and a metric its scorer writes."""
    path = Path(path)
    raw = _read_toml(path)
    bars, problems = _bar_problems(raw)
    parsed = None
    try:  # the top-level keys (p_family, unknown keys) are checked even when no bar is valid
        parsed = Bars.model_validate({k: v for k, v in raw.items() if k != "bar"} | {"bar": tuple(b for _, b in bars)})
    except ValidationError as e:
        problems += [p for p in _errors(e) if bars or not p.startswith(("bar:", "bar["))]
    if suites is not None:
        problems += _lab_problems(raw["bar"] if isinstance(raw.get("bar"), list) else [], suites)
    problems += _set_problems(bars)
    if problems or parsed is None:
        raise BarsError(path, sorted(problems, key=_bar_index))
    return parsed


def register(nb: Notebook, session: str, spec: BarsSpec) -> BarsRecord:
    """Store the bars' canonical form, sha256 and registration time (and a register_bars decision). A bars file is
    registered as `load(path).spec()`; replay registers the typed spec its session recorded, never re-read as text."""
    return nb.register_bars(session, spec)
