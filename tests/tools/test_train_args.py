"""The train tool's arguments a policy writes without knowing the model: snapshots at shares of the run."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tools.train import Args, snapshot_steps


def test_snapshot_shares_settle_to_steps_of_the_run():
    args = Args(trainer="sft", parent=1, dataset=2, snapshot_fractions=(1 / 3, 2 / 3))
    assert snapshot_steps(args, 30) == (10, 20)
    assert snapshot_steps(args, 4) == (1, 3)
    assert snapshot_steps(args, 1) == ()  # a one-step run has no step inside it
    both = Args(trainer="sft", parent=1, dataset=2, snapshots=(5,), snapshot_fractions=(0.5,))
    assert snapshot_steps(both, 10) == (5,)  # the same step once


@pytest.mark.parametrize("shares", [(0.0,), (1.0,), (0.6, 0.3), (0.5, 0.5)])
def test_snapshot_shares_lie_inside_the_run_and_increase(shares):
    with pytest.raises(ValidationError, match="snapshot_fractions"):
        Args(trainer="sft", parent=1, dataset=2, snapshot_fractions=shares)
