"""Feedback splits: train, dev holdout (selection), sealed confirmation (DESIGN.md invariant 1) and, where the lab
asks for one (`reserve_fraction` > 0), a reserve: more holdout prompts, never trained on and never read until a policy
buys evidence with them for a comparison its dev holdout left unresolved (agent/planners/stages.py, evals/compare.py).

The split is a pure function of the battles' content, never of file order:

1. Battles whose prompts are the same after normalization, share a word 13-gram, or where one
   prompt of 8..12 words appears whole inside another (the leak audit's three checks) are joined
   into one *unit* (union-find), so a repeated prompt can never sit on both sides of the split and
   make every later build fail its leak audit. A group larger than MAX_UNIT battles (or 1% of the file)
   is split back into single battles: one battle sharing a 13-word run with many others must not carry
   them all out of train (the leak audit drops any training row that overlaps a holdout instead).
   `split_problems` refuses a split that is empty or off its target share by more than SKEW of it.
2. Each unit belongs to the stratum of its representative (the battle with the smallest id):
   the vote, and the value of the `stratify_by` meta tag when one is given (missing -> "").
3. Each split's count is exact: round(N * sealed_fraction) battles of the N go to sealed,
   round(N * dev_fraction) to dev and round(N * reserve_fraction) to the reserve, apportioned
   over the strata by largest remainder (each stratum
   gets the floor or the ceiling of its share; remainders tie-break by a hash of the stratum), so
   many small strata cannot round every holdout share down to nothing (64 battles over 8 families
   and 4 votes, each stratum rounding 10% of its 1-4 battles, once made a sealed set of 1 battle).
   Within a stratum, units are ordered by sha256 of the representative id; the first go to sealed up
   to its count, the next to dev, the next to the reserve, the rest to train. A unit larger than one battle can
   overshoot by its size minus one. Without a reserve (the default) nothing of this differs from the split before
   the key: the same assignment, counts and sha256, and no `reserve` key anywhere.
4. Battles the lab's previous split already assigned are pinned to that split (a unit with pinned
   members takes the most guarded of their splits: sealed, then dev, then train), and the new
   battles fill each stratum's remaining targets in the same hash order. Without pins, cut points
   move when a grown feedback file is re-ingested: appending 10% more battles to 1000 moved 4 dev
   battles into train and 2 train battles into dev (a holdout leaking into training, or a trained-on
   battle judging selection, across feedback rounds). So a reserve asked for later fills from new battles only: a
   battle a parent may have trained on never becomes a reserve prompt (an empty reserve is refused, rule 1).

Re-splitting the same battles, in any order, gives the same assignment and the same sha256.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from core.util import canonical_json
from memory.notebook import FeedbackSplit, Notebook
from tools.data.feedback import Battle, load_feedback
from tools.data.leak import DEFAULT_NGRAM, ngrams, normalized_hash, short_sequence

SplitName = Literal["train", "dev", "sealed", "reserve"]
SPLITS: tuple[SplitName, ...] = ("train", "dev", "sealed")  # every split has these; "reserve" only when asked for
# The most guarded first: a unit whose battles were pinned to several splits takes the first of them (rule 4).
GUARDED: tuple[SplitName, ...] = ("sealed", "dev", "reserve", "train")
# A group of colliding prompts holds at most this many battles (or MAX_UNIT_SHARE of the file, when more):
# one battle sharing a 13-word run with many others must not carry them all out of train, nor one
# template phrase put every battle into one unit (all sealed). The battles of a larger group are split
# one by one; the leak audit of every dataset then drops a training row that overlaps a holdout.
MAX_UNIT = 20
MAX_UNIT_SHARE = 0.01
# A split whose share of the battles is off its target by more than this share of the target, and by more than
# SKEW_SD binomial standard deviations of its count, is refused. The second bound keeps small honest files usable: a
# hash split of n battles (stratified, so if anything steadier) varies by about sqrt(n p (1 - p)) battles, and 64
# battles with a 10% sealed target give 3 where 6.4 are expected often enough.
SKEW = 0.5
SKEW_SD = 2.0


class SplitConfig(BaseModel):
    """How feedback is split (lab.toml [feedback]: dev_fraction, sealed_fraction, reserve_fraction, stratify_by)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dev_fraction: float = Field(gt=0, lt=1, description="Share of battles in the dev holdout (selection).")
    sealed_fraction: float = Field(gt=0, lt=1, description="Share of battles in the sealed confirmation set.")
    stratify_by: str | None = Field(None, description="Meta tag to stratify by on top of the vote.")
    ngram: int = Field(DEFAULT_NGRAM, ge=1, description="Battles sharing a word n-gram of this length stay together.")
    reserve_fraction: float = Field(0.0, ge=0, lt=1, description="Share of battles held in reserve: holdout prompts "
                                    "read only when a comparison buys evidence with them; 0: no reserve.")

    @model_validator(mode="after")
    def _leaves_train(self) -> SplitConfig:
        if self.dev_fraction + self.sealed_fraction + self.reserve_fraction >= 1:
            names = "dev_fraction + sealed_fraction" + (" + reserve_fraction" if self.reserve_fraction else "")
            raise ValueError(f"{names} must be below 1 (some battles must train)")
        return self

    @model_serializer(mode="wrap")
    def _without_no_reserve(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Stored without `reserve_fraction` when there is none: the split file, the notebook's split config and the
        ingest job's key (its arguments) stay those of the splits made before the key."""
        data = handler(self)
        return {k: v for k, v in data.items() if k != "reserve_fraction" or v}

    @property
    def names(self) -> tuple[SplitName, ...]:
        """The splits this configuration makes: train, dev, sealed, and the reserve when it has one."""
        return SPLITS + (("reserve",) if self.reserve_fraction else ())

    def target(self, name: SplitName) -> float:
        """A split's target share of the battles."""
        shares = {"dev": self.dev_fraction, "sealed": self.sealed_fraction, "reserve": self.reserve_fraction}
        return shares[name] if name in shares else 1 - sum(shares.values())


class Split(BaseModel):
    """A split of one feedback file: battle id -> split, with counts and its sha256."""

    model_config = ConfigDict(extra="forbid")

    source_sha256: str = Field(description="sha256 of the feedback file's bytes.")
    config: SplitConfig = Field(description="The configuration that produced this split.")
    assignment: dict[str, SplitName] = Field(description="Battle id -> train / dev / sealed (/ reserve), sorted by id.")
    counts: dict[str, dict[str, int]] = Field(description="Per split, battles per vote (a `reserve` key only when the "
                                             "configuration asks for one).")

    @property
    def sha256(self) -> str:
        """sha256 of the canonical assignment (the notebook's feedback_split.sha256 is the same value)."""
        return hashlib.sha256(canonical_json(self.assignment).encode()).hexdigest()

    def ids(self, split: SplitName) -> set[str]:
        return {i for i, s in self.assignment.items() if s == split}


def _id_hash(battle_id: str) -> str:
    return hashlib.sha256(battle_id.encode()).hexdigest()


def _units(battles: list[Battle], n: int) -> list[list[Battle]]:
    """The split's units: the groups of colliding prompts, each within the bound; a larger group is split
    back into single battles (see MAX_UNIT)."""
    bound = max_unit(len(battles))
    units = []
    for g in _joined(battles, n):
        units += [g] if len(g) <= bound else [[b] for b in g]
    return units


def _joined(battles: list[Battle], n: int) -> list[list[Battle]]:
    """Battles joined when their prompts collide (normalized hash or a shared n-gram); order-free."""
    parent = list(range(len(battles)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, b in enumerate(battles):
        text = b.prompt()
        for key in {"#" + normalized_hash(text)} | ngrams(text, n):
            j = first.setdefault(key, i)
            parent[find(i)] = find(j)
    # A short prompt has no n-gram: join it with every prompt that contains it whole.
    shorts: dict[str, int] = {}
    for i, b in enumerate(battles):
        seq = short_sequence(b.prompt(), n)
        if seq is not None:
            shorts.setdefault(seq, i)
    for i, b in enumerate(battles):
        for length in sorted({len(seq.split()) for seq in shorts}):
            for g in ngrams(b.prompt(), length) & shorts.keys():
                parent[find(i)] = find(shorts[g])
    groups: dict[int, list[Battle]] = defaultdict(list)
    for i, b in enumerate(battles):
        groups[find(i)].append(b)
    return [sorted(g, key=lambda b: b.id) for g in groups.values()]


def max_unit(n: int) -> int:
    """The most battles one unit may hold: MAX_UNIT, or MAX_UNIT_SHARE of the file when that is more."""
    return max(MAX_UNIT, math.floor(MAX_UNIT_SHARE * n))


def oversized_groups(battles: list[Battle], n: int = DEFAULT_NGRAM) -> list[tuple[str, int]]:
    """(smallest id, size) of each group of colliding prompts larger than the bound, largest first."""
    bound = max_unit(len(battles))
    grouped = _joined(battles, n)
    return sorted(((min(b.id for b in g), len(g)) for g in grouped if len(g) > bound), key=lambda t: -t[1])


def split_problems(split: Split) -> list[str]:
    """Why a split cannot be used: an empty split, or one whose share of the battles is off its target by
    more than SKEW of that target and more than SKEW_SD binomial standard deviations (a group of colliding prompts the bound let through, or a stratum too
    small to split). Each names the split, its share and its target."""
    total = sum(sum(c.values()) for c in split.counts.values())
    targets = {name: split.config.target(name) for name in split.config.names}
    problems = []
    for name in split.config.names:
        got = sum(split.counts[name].values())
        share = got / total if total else 0.0
        if got == 0:
            problems.append(f"split {name!r} would be empty ({total} battle(s); target share {targets[name]:.0%}): "
                            "add battles or raise its fraction")
        elif abs(got - targets[name] * total) > max(SKEW * targets[name] * total,
                                                    SKEW_SD * math.sqrt(total * targets[name] * (1 - targets[name]))):
            problems.append(f"split {name!r} would hold {got} of {total} battles ({share:.0%}), off its target share "
                            f"{targets[name]:.0%} by more than {SKEW:.0%} of it: prompts that collide (copies, shared "
                            f"{split.config.ngram}-word runs) keep battles together; see the groups named above, or add battles")
    return problems


def _stratum(battle: Battle, stratify_by: str | None) -> tuple[str, str]:
    tag = "" if stratify_by is None else str((battle.meta or {}).get(stratify_by, ""))
    return battle.vote, tag


def _pinned_split(unit: list[Battle], pinned: dict[str, str]) -> SplitName | None:
    names = [pinned[b.id] for b in unit if b.id in pinned]
    return min(names, key=GUARDED.index) if names else None


def _apportion(sizes: dict[tuple[str, str], int], fraction: float,
               room: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    """round(N * fraction) battles apportioned over the strata (Hamilton's largest-remainder method): each stratum
    gets the floor of its share, and the battles left over go one each to the strata with the largest remainders
    (ties broken by a hash of the stratum, so the result depends on the battles only), never past a stratum's room."""
    total = math.floor(sum(sizes.values()) * fraction + 0.5)
    counts = {k: min(math.floor(n * fraction), room[k]) for k, n in sizes.items()}
    left = total - sum(counts.values())
    for k in sorted(sizes, key=lambda k: (-(sizes[k] * fraction - counts[k]), _id_hash(repr(k)))):
        if left <= 0:
            break
        if counts[k] < room[k]:
            counts[k] += 1
            left -= 1
    return counts


def _assign_stratum(units: list[list[Battle]], targets: list[tuple[SplitName, int]],
                    pinned: dict[str, str]) -> dict[str, SplitName]:
    """Pinned units keep their split; the others, in hash order, fill each held-out split of `targets` in turn (sealed,
    dev, reserve: up to the running sum of their counts), then train."""
    units = sorted(units, key=lambda u: _id_hash(u[0].id))
    placed = dict.fromkeys(GUARDED, 0)
    assignment: dict[str, SplitName] = {}
    fresh = []
    for unit in units:
        name = _pinned_split(unit, pinned)
        if name is None:
            fresh.append(unit)
            continue
        assignment.update((b.id, name) for b in unit)
        placed[name] += len(unit)
    for unit in fresh:
        name: SplitName = "train"
        held = bound = 0
        for split, n in targets:  # the first whose running total of battles is below the running total of the counts
            held, bound = held + placed[split], bound + n
            if held < bound:
                name = split
                break
        assignment.update((b.id, name) for b in unit)
        placed[name] += len(unit)
    return assignment


def split_battles(battles: list[Battle], source_sha256: str, config: SplitConfig,
                  pinned: dict[str, str] | None = None) -> Split:
    """Assign every battle to train, dev, sealed (or the reserve); `pinned` (id -> split) are kept. See the module
    docstring."""
    strata: dict[tuple[str, str], list[list[Battle]]] = defaultdict(list)
    for unit in _units(battles, config.ngram):
        strata[_stratum(unit[0], config.stratify_by)].append(unit)
    sizes = {k: sum(len(u) for u in units) for k, units in strata.items()}
    sealed = _apportion(sizes, config.sealed_fraction, sizes)
    dev = _apportion(sizes, config.dev_fraction, {k: n - sealed[k] for k, n in sizes.items()})
    reserve = _apportion(sizes, config.reserve_fraction, {k: n - sealed[k] - dev[k] for k, n in sizes.items()})
    assignment: dict[str, SplitName] = {}
    for k, units in strata.items():
        targets: list[tuple[SplitName, int]] = [("sealed", sealed[k]), ("dev", dev[k]), ("reserve", reserve[k])]
        assignment.update(_assign_stratum(units, targets, pinned or {}))
    votes = {b.id: b.vote for b in battles}
    # A reserve the lab no longer asks for keeps its pinned battles (held out, never trained on) and its count.
    names = config.names if "reserve" not in assignment.values() else (*SPLITS, "reserve")
    counts = {s: {v: 0 for v in ("own", "other", "tie", "both_bad")} for s in names}
    for battle_id, name in assignment.items():
        counts[name][votes[battle_id]] += 1
    return Split(source_sha256=source_sha256, config=config,
                 assignment=dict(sorted(assignment.items())), counts=counts)


def split_file(path: Path, config: SplitConfig, pinned: dict[str, str] | None = None) -> tuple[list[Battle], Split]:
    """Load a feedback file (all or nothing) and split it, keeping `pinned` battles where they were."""
    parsed = load_feedback(path)
    return parsed.battles, split_battles(parsed.battles, parsed.sha256, config, pinned)


def ingest_feedback(
    notebook: Notebook, path: Path, config: SplitConfig, split_dir: Path, session: str | None = None
) -> tuple[Path, FeedbackSplit]:
    """Validate, split and record a feedback file; all or nothing (a bad file raises FeedbackError and
    writes nothing). Writes the split to `split_dir/split-<sha256[:16]>.json` (what builders read) and
    records it in the notebook; re-ingesting the same file with the same config returns the existing record.
    Battles of the lab's previous split keep their assignment (module docstring, rule 4).
    """
    previous = notebook.latest_split()
    _, split = split_file(path, config, pinned=None if previous is None else previous.assignment)
    out = Path(split_dir) / f"split-{split.sha256[:16]}.json"
    known = notebook.latest_split(split.source_sha256)
    if known is not None and known.sha256 == split.sha256 and known.config == config.model_dump(mode="json") and out.is_file():
        return out, known
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(split.model_dump_json(indent=1) + "\n", encoding="utf-8")
    tmp.replace(out)
    record = notebook.record_split(
        source_path=str(path), source_sha256=split.source_sha256, config=config.model_dump(mode="json"),
        counts=split.counts, assignment=dict(split.assignment), session=session,
    )
    if record.sha256 != split.sha256:  # the notebook and this module must hash the same canonical JSON
        raise RuntimeError(f"split sha256 mismatch: notebook {record.sha256}, splits {split.sha256}")
    return out, record
