"""Instruction-following scorer: every constraint of an item checked in strict and loose modes.

Two readings of a rule (`mode`):
- `plain` (default): the plain meaning of the instruction, `rule.check` in evals/constraint_rules.py,
  whose docstrings say rule by rule where that departs from the reference and why.
- `ifeval`: the IFEval reference semantics (evals/ifeval.py), so a lab can quote numbers
  comparable with everyone else's IFEval.

Strict checks the answer as written. Loose (the relaxation used by IFEval, Zhou et al. 2023,
arXiv:2311.07911) passes a constraint if any of a few harmless edits of the answer passes it: markdown
stars removed, the first line dropped (a preamble like "Sure, here it is:"), the last line dropped
(a closing remark), or both. In both modes a blank answer follows no instruction, strict or loose,
and loose never fails what strict passes.

Per-item values, named so that the mode that scored them can be read off every eval:
- plain: `strict`/`loose` are 1 if every constraint holds, `strict_frac`/`loose_frac` the fraction
  of its constraints that hold;
- ifeval: `ifeval_strict`/`ifeval_loose` (IFEval's prompt-level accuracy), `ifeval_strict_followed`
  / `ifeval_loose_followed` (instructions followed) and `ifeval_instructions` (instructions
  checked), so IFEval's instruction-level accuracy is the ratio of the two suite means;
- both: `scoring_mode_ifeval`, 1.0 under ifeval and 0.0 under plain, on every item.
"""

from __future__ import annotations

from typing import Literal

from evals import ifeval
from evals.constraint_rules import Constraint
from evals.types import Completion, Item, Outcome, check_aligned

Mode = Literal["plain", "ifeval"]


def loose_variants(text: str) -> list[str]:
    """The answer and its harmless edits (blank ones dropped, the answer itself never)."""
    return [text] + [v for v in ifeval.loose_variants(text)[1:] if v.strip()]


def _plain(rule: Constraint, text: str) -> tuple[bool, bool]:
    if not text.strip():
        return False, False
    strict = rule.check(text)
    return strict, strict or any(rule.check(v) for v in loose_variants(text)[1:])


def _values(mode: Mode, strict: list[bool], loose: list[bool]) -> dict[str, float]:
    n = len(strict)
    if mode == "ifeval":
        return {"ifeval_strict": float(all(strict)), "ifeval_loose": float(all(loose)),
                "ifeval_strict_followed": float(sum(strict)), "ifeval_loose_followed": float(sum(loose)),
                "ifeval_instructions": float(n), "scoring_mode_ifeval": 1.0}
    return {"strict": float(all(strict)), "loose": float(all(loose)), "strict_frac": sum(strict) / n,
            "loose_frac": sum(loose) / n, "scoring_mode_ifeval": 0.0}


def score_item(item: Item, completion: Completion, mode: Mode = "plain") -> Outcome:
    if not item.constraints:
        raise ValueError(f"item {item.id} has no constraints; it does not belong in a constraints suite")
    judge = ifeval.follows if mode == "ifeval" else _plain
    verdicts = [judge(rule, completion.text) for rule in item.constraints]
    strict = [s for s, _ in verdicts]
    loose = [lo for _, lo in verdicts]
    failed = tuple(f"strict fails {rule.kind}" for rule, ok in zip(item.constraints, strict, strict=True) if not ok)
    label = "pass" if all(strict) else ("loose_pass" if all(loose) else "fail")
    return Outcome(item_id=item.id, label=label, values=_values(mode, strict, loose), reasons=failed)


def score(items: list[Item], completions: list[Completion], mode: Mode = "plain") -> list[Outcome]:
    """Check each item's constraints against its completion, strict and loose, in `mode`."""
    check_aligned(items, completions)
    return [score_item(item, comp, mode) for item, comp in zip(items, completions, strict=True)]
