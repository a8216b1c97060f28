"""Where a lab is: the one rule that keeps the notebook's paths lab-relative, so a lab can be copied or moved.

Every path the agent produces is absolute (the runner resolves the lab once), but the notebook stores a path
inside the lab as `<lab>/runs/s1/sft-...`, and gives it back resolved against the lab's location at the time it
is read. A copied lab then reads its own files, never the original's; a moved one finds them where they now are.
A path outside the lab (a base model the team keeps elsewhere, named in lab.toml) is stored as it was written.

    place = Place.of(Path("/data/lab"), recorded=["/old/lab"])
    place.stored("/data/lab/runs/x")      # '<lab>/runs/x'
    place.resolved("<lab>/runs/x")        # '/data/lab/runs/x'
    place.resolved("/old/lab/runs/x")     # '/data/lab/runs/x': a notebook written before paths were stored relative

Old notebooks hold absolute paths into the location they were written in (their sessions' recorded `lab`). Such a
path is read onto the lab's current location, whether or not the old location still exists: a copy whose
original is still there must read its own files (reading the original's would replay a different lab, and
silently so), and a moved lab has no other place to read them from. Stored records are never rewritten, so the
hash chain (which covers records as stored) holds for old and new notebooks alike.

The rule also applies inside text the project writes (a decision's rationale, a tool's one-line summary: "its
bundle passed check-bundle (<lab>/bundles/...)"): a root followed by a path character is not this lab's
('/data/lab2' is another lab), and a root preceded by one is part of a longer path.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAB_MARK = "<lab>"
_NAME = r"[\w.~-]"  # characters that continue a path component: a root followed by one is another directory


@functools.lru_cache(maxsize=64)
def root_pattern(roots: tuple[str, ...]) -> re.Pattern[str] | None:
    """What finds a root in text: an absolute root (or the mark) anywhere a path can start, a relative spelling
    ('lab', as a user typed it) only as a whole string's start (elsewhere it is a word, not a path)."""
    usable = sorted({r.rstrip("/") for r in roots if r.rstrip("/")}, key=len, reverse=True)  # longest first
    if not usable:
        return None
    anywhere = "|".join(re.escape(r) for r in usable if r.startswith(("/", LAB_MARK)))
    leading = "|".join(re.escape(r) for r in usable if not r.startswith(("/", LAB_MARK)))
    alternatives = [f"(?<![\\w.~/-])(?:{anywhere})(?!{_NAME})"] if anywhere else []
    alternatives += [f"^(?:{leading})(?=/|$)"] if leading else []
    return re.compile("|".join(alternatives))


def rewrite(value: Any, pattern: re.Pattern[str] | None, by: str, needles: tuple[str, ...] = ()) -> Any:
    """`value` (JSON: dicts, lists, strings) with every match of `pattern` in its strings replaced by `by`.
    `needles`: strings one of which any match contains (the roots): a string holding none is passed over without
    running the pattern (a notebook's reads go through here)."""
    if pattern is None:
        return value
    if isinstance(value, str):
        for needle in needles or (value,):
            if needle in value:
                return pattern.sub(lambda _: by, value)
        return value
    if isinstance(value, dict):
        return {k: rewrite(v, pattern, by, needles) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rewrite(v, pattern, by, needles) for v in value]
    return value


@dataclass(frozen=True)
class Place:
    """The lab's current root and the spellings its records may use for it (see the module docstring)."""

    root: str
    spellings: tuple[str, ...]

    @classmethod
    def of(cls, root: Path, recorded: Iterable[str] = ()) -> Place:
        """The lab at `root` (its absolute spelling is what reads resolve to), whose sessions recorded `recorded`."""
        here = root.absolute()
        names = {str(here), str(root.resolve()), *(str(r) for r in recorded)}
        return cls(root=str(here), spellings=tuple(sorted(n for n in names if n.rstrip("/"))))

    def with_recorded(self, *recorded: str) -> Place:
        return Place(root=self.root, spellings=tuple(sorted({*self.spellings, *(r for r in recorded if r.rstrip("/"))})))

    @functools.cached_property
    def _to_mark(self) -> re.Pattern[str] | None:
        return root_pattern(self.spellings)

    @functools.cached_property
    def _to_root(self) -> re.Pattern[str] | None:
        return root_pattern((LAB_MARK, *self.spellings))

    def stored(self, value: Any) -> Any:
        """What the notebook stores: every path into the lab, under any of its spellings, as `<lab>/...`."""
        return rewrite(value, self._to_mark, LAB_MARK, self.spellings)

    def resolved(self, value: Any) -> Any:
        """What a reader gets: `<lab>/...` and paths into a recorded location of the lab, at the lab's current root."""
        return rewrite(value, self._to_root, self.root, (LAB_MARK, *self.spellings))
