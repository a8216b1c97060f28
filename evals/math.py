r"""Math scorer: final-answer equivalence with math-verify, time-bounded by a process pool.

`verify(gold, pred)` is not symmetric (the gold side drives assignment and interval handling), so
the gold answer always goes first. math-verify's own timeouts use SIGALRM, which only works on the
main thread of the main interpreter and breaks inside job runners and threads; they are disabled
(`parsing_timeout=None`, `timeout_seconds=None`) and each item instead runs in a worker process
that is killed when it overruns `timeout_s` (sympy can hang on adversarial expressions).

`normalize` runs on both sides before math-verify, for the notations that fool it (each measured on
math-verify 0.9, tests/evals/corpus/math_variants.jsonl):
- LaTeX spacing inside a number (`1\,000`, `1\;000`, `1\ 000`, `1~000`, `1\!000`) and the
  braced comma `1{,}000` are thousands separators: math-verify reads `1\,000` as 1*0 and `1{,}000`
  outside math mode as 1. Elsewhere a spacing command is a space.
- Thousands separators: `1,234,567`, `12,345.6`, and thin or no-break spaces between digit groups
  join only when every group after the first has exactly three digits, so `1,2` and `10,0` stay what
  they are (not twelve, not a hundred).
- `\text{}`, `\textbf{}`, `\mathrm{}`, `\mbox{}` wrappers are dropped, keeping their content;
  `\$` (a currency sign) and the Unicode minus are rewritten to what math-verify reads.
- Percent: `25\%`, `25 %`, `25 percent`, `25\text{\%}` are one form, `25\%`. Math-verify lets a
  gold percentage match both 25 and 0.25 but a predicted one only 25; here a predicted percentage is
  also tried as its fraction, so "50%" answers a gold 0.5 as "0.5" answers a gold 50%.
- Trailing punctuation after the final answer needs nothing: math-verify already ignores it.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import time
from decimal import Decimal, InvalidOperation
from multiprocessing.pool import Pool

from evals.types import Completion, Item, Outcome, check_aligned


def _init_worker() -> None:
    """Import math-verify once per worker, so its import time is not charged to an item's timeout."""
    import logging

    import math_verify  # noqa: F401

    # math-verify warns once per process that timeouts are off; the pool is the timeout here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _ready(_: int) -> None:
    time.sleep(0.05)  # long enough that every worker takes one warm-up task


_SPACE_CMD = r"(?:\\[,;:! ]|\\thinspace|\\enspace|~|[\u2009\u202f\u00a0])"
_SEPARATOR = rf",|\{{,\}}|{_SPACE_CMD}"
# Digit groups joined by one kind of separator: a first group of 1-3 digits, then groups of exactly
# 3, and no further digit (or separator and digit) after the last group.
_GROUPED = re.compile(rf"(?<![\d.,])\d{{1,3}}({_SEPARATOR})\d{{3}}(?:\1\d{{3}})*(?!\d|\1\d)")
_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|textnormal)\s*\{([^{}]*)\}")
_PERCENT = re.compile(r"(?:\\?%|\s*\bper\s?cent\b)")
_NUMBER_PERCENT = re.compile(r"(?<![\d.])(-?\d+(?:\.\d+)?)\s*\\%")


def normalize(text: str) -> str:
    """Rewrite the notations that fool math-verify into ones it reads right (see the module docstring)."""
    text = text.replace("\u2212", "-").replace("\\$", "")
    for _ in range(2):  # nested wrappers: \textbf{\text{5}}
        text = _WRAPPER.sub(lambda m: m.group(1), text)
    text = _GROUPED.sub(lambda m: m.group().replace(m.group(1), ""), text)
    text = re.sub(_SPACE_CMD, " ", text)
    text = _PERCENT.sub(r"\\%", text)
    return re.sub(r"(\d)\s+\\%", r"\1\\%", text)


def _as_fraction(text: str) -> str:
    """Every `x\\%` of an answer as the decimal x/100 (a predicted percentage read as a fraction)."""
    def frac(m: re.Match[str]) -> str:
        try:
            return format(Decimal(m.group(1)) / 100, "f")
        except InvalidOperation:
            return m.group()

    return _NUMBER_PERCENT.sub(frac, text)


def verify_answer(gold: str, text: str) -> tuple[str, str]:
    """(label, extracted prediction) for one answer; runs inside a pool worker."""
    from math_verify import parse, verify

    gold = normalize(gold)
    gold_parsed = parse(gold if "$" in gold else f"${gold}$", parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} does not parse")
    text = normalize(text)
    pred = parse(text, parsing_timeout=None)
    if not pred:
        return "no_answer", ""
    ok = verify(gold_parsed, pred, timeout_seconds=None)
    if not ok and _NUMBER_PERCENT.search(text):
        fraction = parse(_as_fraction(text), parsing_timeout=None)
        ok = bool(fraction) and verify(gold_parsed, fraction, timeout_seconds=None)
    return ("correct" if ok else "wrong"), str(pred[-1])


def _outcome(item_id: str, label: str, pred: str) -> Outcome:
    values = {"correct": float(label == "correct"), "no_answer": float(label == "no_answer")}
    reasons = (f"extracted {pred!r}",) if pred else ()
    return Outcome(item_id=item_id, label=label, values=values, reasons=reasons)


def _run(pool: Pool, jobs: list[tuple[str, str, str]], timeout_s: float) -> tuple[dict[str, Outcome], list]:
    """Collect results in order; on the first overrun return the outcomes so far and the rest."""
    pending = [(item_id, pool.apply_async(verify_answer, (gold, text))) for item_id, gold, text in jobs]
    done: dict[str, Outcome] = {}
    for k, (item_id, result) in enumerate(pending):
        try:
            label, pred = result.get(timeout=timeout_s)
        except mp.TimeoutError:
            # Items before k are done, so k had a worker for at least timeout_s: it overran.
            done[item_id] = Outcome(item_id=item_id, label="timeout", values={"correct": 0.0, "no_answer": 0.0},
                                    reasons=(f"verification exceeded {timeout_s}s",))
            return done, jobs[k + 1:]
        done[item_id] = _outcome(item_id, label, pred)
    return done, []


def score(items: list[Item], completions: list[Completion], timeout_s: float = 10.0,
          workers: int = 2) -> list[Outcome]:
    """Per item: correct / wrong / no_answer / timeout, `correct` and `no_answer` as 0/1 values."""
    check_aligned(items, completions)
    missing = [item.id for item in items if item.gold is None]
    if missing:
        raise ValueError(f"math items without a gold answer: {missing[:5]}")
    jobs = [(item.id, item.gold, comp.text) for item, comp in zip(items, completions, strict=True)]
    done: dict[str, Outcome] = {}
    ctx = mp.get_context("spawn")  # no fork of a process that may hold torch threads
    while jobs:
        n = max(1, min(workers, len(jobs)))
        pool = ctx.Pool(processes=n, initializer=_init_worker)
        try:
            pool.map(_ready, range(n), chunksize=1)  # workers up and imported before any clock starts
            batch, jobs = _run(pool, jobs, timeout_s)
        finally:
            pool.terminate()  # kills a hung sympy worker; a fresh pool takes the remaining items
            pool.join()
        done.update(batch)
    return [done[item.id] for item in items]
