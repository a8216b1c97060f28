"""World variants: the toy world made hard in one named way each, to measure the agent's judgment where it counts.

    python run_agent.py world build --variant noisy-judge [--lab DIR] [--seed N] [--size demo|test]

A variant is a small typed value (its name, and the few settings of the build it changes); `default` changes
nothing, so its build is byte for byte the world as it was before variants. Every variant draws the same pools,
the same tokenizer and the same base model as the default world of its seed; what it changes, and why:

- `noisy-judge`: the people who voted the feedback are careless: 30% of the votes are the wrong side (a random
  side where the true verdict is a tie or both bad) and 10% are ties whatever the answers. The agent's training
  pairs and winners are then often the worse answer. Its lab splits the feedback by vote alone: votes this
  spread put a test-size file's 64 battles into vote x family strata of one or two, whose rounding left the
  sealed split empty or at 1 battle, and the agent refused to open a session on 6 of seeds 201-207 (all 6 split
  by vote alone pass).
- `small-holdout`: the dev holdout (what selection reads) has at most `max_dev_battles` battles: lab.toml's
  dev_fraction is cut to fit the feedback file (the test size's 64 battles already give 19). Its lab holds a reserve
  (`reserve_fraction`): more holdout prompts, read only when a comparison the small holdout leaves unresolved draws
  them for its last look (rules version 7), as a team short of holdout prompts would keep some back.
- `harmful-arms`: the lab's recipe ([train] in its lab.toml) holds settings that truly hurt: DPO and the
  KL-leashed CE at a learning rate of 0.1, 500x and 100x the lab's others (at the test size a DPO arm of 16
  steps at 0.1 won 33% against its parent, at 0.03 44%, at 0.01 49%), so half of the full playbook's first arms
  (dpo, klce of sft, dpo, klce, rft; dpo of the short protocol's sft, dpo) damage the model they train.
- `strong-parent`: the parent has been trained to the end of what this model can learn from such data (stage 1
  runs `stage1_steps_factor` times as long, on the worked references with no answer running on), so no arm can
  truly beat it by more than 2 points; the right call is to keep it.
- `misleading-screens`: the cheap verified suite was labelled by the parent itself (each item's expected answer
  is the parent's greedy answer, its mistakes included; the gold where it gave none the checker reads), so the
  screen rewards agreeing with the parent: an arm that learns to be right scores lower on it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tools.world.oracle import OracleNoise

VariantName = Literal["default", "noisy-judge", "small-holdout", "harmful-arms", "strong-parent", "misleading-screens"]
VARIANT_NAMES: tuple[VariantName, ...] = ("default", "noisy-judge", "small-holdout", "harmful-arms", "strong-parent",
                                          "misleading-screens")


class Variant(BaseModel):
    """What one world variant changes of the default build."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: VariantName = Field(description="The variant's name (`world build --variant`).")
    oracle_noise: OracleNoise = Field(OracleNoise(), description="The noise of the votes in the feedback file.")
    max_dev_battles: int | None = Field(None, ge=1, description="Most dev-holdout battles the split may hold "
                                                                "(lab.toml's dev_fraction is cut to fit); None: as is.")
    reserve_fraction: float = Field(0.0, ge=0.0, lt=0.5, description="lab.toml's [feedback] reserve_fraction (0: no "
                                                                      "reserve, the key left out).")
    train_lr: dict[str, float] = Field(default_factory=dict, description="lab.toml [train.<family>] lr values.")
    stage1_steps_factor: int = Field(1, ge=1, description="Stage-1 SFT runs this many times the preset's steps.")
    stage1_clean: bool = Field(False, description="Stage-1 answers are the worked references and none runs on.")
    stratify_by_family: bool = Field(True, description="lab.toml splits the feedback by vote and family (False: by "
                                                        "vote alone).")
    screen_labels: Literal["gold", "parent"] = Field(
        "gold", description="Expected answers of the verified suite: the gold, or the parent's own greedy answers.")


VARIANTS: dict[str, Variant] = {
    "default": Variant(name="default"),
    "noisy-judge": Variant(name="noisy-judge", oracle_noise=OracleNoise(tie_rate=0.10, both_bad_rate=0.0, wrong_rate=0.30),
                           stratify_by_family=False),
    "small-holdout": Variant(name="small-holdout", max_dev_battles=60, reserve_fraction=0.2),
    "harmful-arms": Variant(name="harmful-arms", train_lr={"dpo": 0.1, "klce": 0.1}),
    "strong-parent": Variant(name="strong-parent", stage1_steps_factor=6, stage1_clean=True),
    "misleading-screens": Variant(name="misleading-screens", screen_labels="parent"),
}


class UnknownVariant(ValueError):
    """A variant name that is not one of VARIANT_NAMES."""


def variant(name: str) -> Variant:
    """The variant called `name`, or UnknownVariant naming the known ones."""
    if name not in VARIANTS:
        raise UnknownVariant(f"unknown world variant {name!r}; expected one of {', '.join(VARIANT_NAMES)}")
    return VARIANTS[name]


def changes_parent(v: Variant) -> bool:
    """Whether the variant's parent differs from the default world's (its stage 1 differs)."""
    return v.stage1_steps_factor != 1 or v.stage1_clean


def dev_fraction(v: Variant, battles: int, stated: float) -> float:
    """lab.toml's dev_fraction for `battles` battles: the stated one, or (small-holdout) the largest two-decimal
    share whose holdout stays under the cap after the split's per-stratum rounding (a margin of 10 battles)."""
    if v.max_dev_battles is None or battles * stated <= v.max_dev_battles - 10:
        return stated
    return int(100 * (v.max_dev_battles - 10) / battles) / 100
