"""Instruction-following scorer: every constraint of an item checked in strict and loose modes.

Strict checks the answer as written. Loose (the relaxation used by IFEval, Zhou et al. 2023,
arXiv:2311.07911) passes a constraint if any of a few harmless edits of the answer passes it: markdown
emphasis removed, the first line dropped (a preamble like "Sure, here it is:"), the last line dropped
(a closing remark), or both. Per item: `strict`/`loose` are 1 if every constraint holds,
`strict_frac`/`loose_frac` the fraction of its constraints that hold.
"""

from __future__ import annotations

from evals.types import Completion, Item, Outcome, check_aligned


def loose_variants(text: str) -> list[str]:
    """The answer and its harmless edits; loose mode passes if any of them passes."""
    lines = text.split("\n")
    first_dropped = "\n".join(lines[1:]).strip()
    last_dropped = "\n".join(lines[:-1]).strip()
    both_dropped = "\n".join(lines[1:-1]).strip()
    variants = [text, first_dropped, last_dropped, both_dropped]
    variants += [v.replace("*", "") for v in variants]
    return [v for v in variants if v.strip()]


def score_item(item: Item, completion: Completion) -> Outcome:
    if not item.constraints:
        raise ValueError(f"item {item.id} has no constraints; it does not belong in a constraints suite")
    variants = loose_variants(completion.text)
    strict = [rule.check(completion.text) for rule in item.constraints]
    loose = [any(rule.check(v) for v in variants) for rule in item.constraints]
    failed = tuple(f"strict fails {rule.kind}" for rule, ok in zip(item.constraints, strict, strict=True) if not ok)
    values = {
        "strict": float(all(strict)),
        "loose": float(all(loose)),
        "strict_frac": sum(strict) / len(strict),
        "loose_frac": sum(loose) / len(loose),
    }
    label = "pass" if all(strict) else ("loose_pass" if all(loose) else "fail")
    return Outcome(item_id=item.id, label=label, values=values, reasons=failed)


def score(items: list[Item], completions: list[Completion]) -> list[Outcome]:
    """Check each item's constraints against its completion, strict and loose."""
    check_aligned(items, completions)
    return [score_item(item, comp) for item, comp in zip(items, completions, strict=True)]
