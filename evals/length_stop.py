"""Length and stopping scorer: how long answers are and how they end.

Per item: `n_tokens`, `stopped` (ended on a stop id), `truncated` (hit max_new_tokens), `empty`
and `replacement_char` (U+FFFD in the text, i.e. broken byte decoding). Suite means are the mean
length and the stop, truncation, empty and broken-text rates.
"""

from __future__ import annotations

from evals.types import Completion, Item, Outcome, check_aligned


def score_completion(comp: Completion) -> Outcome:
    values = {
        "n_tokens": float(comp.n_tokens),
        "stopped": float(comp.stopped),
        "truncated": float(comp.truncated),
        "empty": float(comp.empty),
        "replacement_char": float(comp.has_replacement_char),
    }
    flags = [name for name in ("truncated", "empty", "replacement_char") if values[name]]
    return Outcome(item_id=comp.item_id, label=flags[0] if flags else "clean", values=values,
                   reasons=tuple(flags))


def score(items: list[Item], completions: list[Completion]) -> list[Outcome]:
    """Record each completion's length and ending."""
    check_aligned(items, completions)
    return [score_completion(c) for c in completions]
