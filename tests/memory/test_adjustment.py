"""A comparison's adjustment is typed (memory.records.Adjustment) and reads the rows of every age as recorded: the
Holm record from before the family was pre-registered (no `tested`), the one of rules versions 1-5, and version 6's
with its sequential looks. Each reads back to the text it was stored as, so a row read and written again is the row
its decision chained."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.util import canonical_json
from memory.notebook import Notebook
from memory.records import Adjustment, BarsSpec, Rule

BAR = Rule(suite="d", metric="correct", statistic="p", op="<=", value=0.05, unit="absolute", test="paired_t",
           confidence=None)
BEFORE_FAMILY = {"method": "holm", "family_size": 2, "raw_p": [0.01], "adjusted_p": [0.02], "prior_comparisons": [1]}
VERSION_5 = {"method": "holm", "family_size": 4, "tested": 2, "raw_p": [0.01], "adjusted_p": [0.03],
             "prior_comparisons": [1]}
VERSION_6 = VERSION_5 | {"looks": {"0": [[40, 0.04, 0.577], [40, 0.02, 0.239]]}, "look": 2, "max_looks": 3}
NO_P_BAR = {"method": "holm", "family_size": None, "tested": 0, "raw_p": [], "adjusted_p": [], "prior_comparisons": []}


@pytest.fixture
def nb(tmp_path: Path):
    with Notebook.open(tmp_path / "notebook.db") as notebook:
        notebook.open_session("s1", lab="lab", budget_gpuh=10, reserve_gpuh=1, planner="playbook",
                              executor="local", config={})
        yield notebook


@pytest.mark.parametrize("stored", [BEFORE_FAMILY, VERSION_5, VERSION_6, NO_P_BAR])
def test_a_recorded_adjustment_reads_typed_and_back_to_its_stored_text(nb: Notebook, stored: dict):
    a = nb.add_artifact(kind="checkpoint", name="a", path="/a", sha256="a" * 64, session="s1")
    b = nb.add_artifact(kind="checkpoint", name="b", path="/b", sha256="b" * 64, session="s1")
    bars = nb.register_bars("s1", BarsSpec(bars=(BAR,), p_family=4))
    row, _ = nb.add_comparison(session="s1", candidate=b.id, incumbent=a.id, bars_id=bars.id, verdicts=[],
                               promoted=False, adjustment=Adjustment(), rationale="x")
    raw = sqlite3.connect(nb.path, isolation_level=None)  # the row as an older version of the code stored it
    raw.execute("UPDATE comparison SET adjustment = ? WHERE id = ?", (canonical_json(stored), row.id))
    raw.close()
    (read,) = nb.comparisons("s1")
    assert read.adjustment.raw_p == stored["raw_p"] and read.adjustment.family_size == stored["family_size"]
    assert read.adjustment.tested == stored.get("tested")
    assert canonical_json(read.adjustment.model_dump(mode="json")) == canonical_json(stored)


def test_version_6_looks_are_typed_per_p_bar():
    read = Adjustment.model_validate(json.loads(canonical_json(VERSION_6)))
    assert (read.look, read.max_looks) == (2, 3)
    assert read.looks == {0: [(40, 0.04, 0.577), (40, 0.02, 0.239)]}


def test_an_adjustment_with_a_key_no_version_wrote_is_refused():
    with pytest.raises(ValidationError, match="extra"):
        Adjustment.model_validate(VERSION_5 | {"alpha": 0.05})
