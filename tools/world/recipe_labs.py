"""A toy-world lab made ready for one of the seeds' recipes (agent/planners/recipes.py): the parts a recipe reads
that the world's default lab.toml leaves switched off.

    prepare(Path("lab-delta"), "delta")   # [judge] kind = "reward_model" (the world's reward model), bars on `win`
    prepare(Path("lab-ember"), "ember")   # a battle_margin suite

aspen, brook and islet run on the world's lab as built (its replay data, its verified pool, its four bars).
"""

from __future__ import annotations

from pathlib import Path

from core.util import write_atomic
from tools.world import parts

DELTA_BARS = "world/bars-reward.toml"


def prepare(lab: Path, recipe: str) -> None:
    text = (lab / "lab.toml").read_text(encoding="utf-8")
    if recipe == "delta":
        bars = (lab / "world" / "bars.toml").read_text(encoding="utf-8")
        # The reward model's proxy suite records `win` (and `margin`) where the oracle's judge suite has win_score.
        write_atomic(lab / DELTA_BARS, bars.replace('metric = "win_score"', 'metric = "win"').encode())
        text = text.replace('bars = "world/bars.toml"', f'bars = "{DELTA_BARS}"', 1)
        text = text.replace('kind = "oracle"\n', f'kind = "reward_model"\npath = "{parts.REWARD_MODEL}"\n', 1)
    if recipe == "ember":
        text += '\n[[evals]]\nname = "margin"\nscorer = "battle_margin"\n'
    write_atomic(lab / "lab.toml", text.encode())
