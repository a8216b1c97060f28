"""The playbook planner: a deterministic research protocol distilled from the seeds' model cards.

The next step is a pure function of the notebook summary, so the same notebook always gets the same
step (what resume and replay rely on). The protocol, in order:

1. ingest and split the feedback; register the bars (bars before scores);
2. calibrate the incumbent: K >= 3 replicates on every open suite (noise before deltas; replicate 0
   is the baseline); again after every promotion, since compare reads the incumbent's own floor;
3. stop early when N arms in a row failed or missed the bars, or the budget above the reserve is
   too small for another step;
4. first arms, one per family at conservative settings, each from the session's parent: winner
   SFT on every human-preferred answer, DPO + NLL on battle pairs, KL-leashed CE (with replay when
   the lab has replay data), RFT on verified synthetic tasks. Each arm: build its data, train,
   evaluate at served decoding, compare against the incumbent under the bars, promote if it clears;
5. a learning-rate sweep along the family whose first arm scored best on the primary bar's metric;
6. a soup of the promoted siblings (two or more), and dose interpolation from the parent along the
   best promoted trained checkpoint (alpha < 1 backs off, alpha > 1 extrapolates); the bars pick
   the knee, since only a dose that clears them against the incumbent is promoted;
7. serving tuning with the weights fixed (decoding alternatives of the incumbent's weights);
8. stop; the graph then nominates the incumbent and opens the sealed confirmation once.

Trajectory selection over saved checkpoints of a run is not part of the protocol yet: the trainers
keep resume state, not intermediate models (see the report's limitations).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agent.planners import ToolCall
from agent.summary import Summary
from evals.synthetic import Family
from tools.train import Trainer


class ServingAlternative(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Served temperature.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Served nucleus mass.")
    repetition_penalty: float | None = Field(None, ge=1.0, le=2.0, description="Served repetition penalty.")
    system_prompt: str = Field("served", pattern="^(served|none)$", description="Keep the served system prompt or serve none.")


class PlaybookSettings(BaseModel):
    """Sizes of the protocol; `test()` is the few-arm setting the test suite and `--protocol test` use."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    families: tuple[Trainer, ...] = Field(("sft", "dpo", "klce", "rft"), description="First arms, in order.")
    steps: int = Field(30, ge=1, description="Optimizer steps per arm.")
    batch_size: int = Field(8, ge=1, description="Rows per optimizer step.")
    lr: dict[str, float] = Field({"sft": 1e-3, "dpo": 2e-4, "klce": 1e-3, "rft": 1e-3},
                                 description="Conservative learning rate per family.")
    sweep: tuple[float, ...] = Field((0.5, 2.0), description="Learning-rate multipliers swept along the best family.")
    soup: bool = Field(True, description="Soup the promoted siblings when there are two or more.")
    dose_alphas: tuple[float, ...] = Field((0.5, 1.5), description="Dose positions from the parent to the best promoted arm.")
    serving: tuple[ServingAlternative, ...] = Field(
        (ServingAlternative(temperature=0.0), ServingAlternative(repetition_penalty=1.1)),
        description="Serving alternatives tried with the weights fixed.")
    k: int = Field(3, ge=3, description="Replicates of each incumbent calibration.")
    max_failed_arms: int = Field(3, ge=1, description="Stop after this many arms in a row failed or missed the bars.")
    rft_counts: dict[Family, int] = Field({"digit_sum": 24, "arithmetic_chain": 24, "letter_count": 24},
                                          description="Verified tasks per family for RFT prompts.")
    min_step_gpuh: float = Field(0.0, ge=0, description="Stop when less than this is left above the reserve.")

    @classmethod
    def test(cls) -> PlaybookSettings:
        return cls(families=("sft",), steps=4, sweep=(), dose_alphas=(0.5,),
                   serving=(ServingAlternative(temperature=0.0),), rft_counts={"digit_sum": 8})


_BUILDERS = {"sft": "winner_sft", "dpo": "battle_pairs", "klce": "winner_sft", "rft": "synthetic_verified"}


def _call(tool: str, args: dict[str, Any], why: str) -> ToolCall:
    return ToolCall(tool=tool, args=args, rationale=why)


class Playbook:
    """The default planner (deterministic, no network)."""

    name = "playbook"

    def __init__(self, settings: PlaybookSettings | None = None):
        self.settings = settings or PlaybookSettings()

    def propose(self, summary: Summary, feedback: list[str]) -> ToolCall:
        return next_step(summary, self.settings)


def next_step(s: Summary, cfg: PlaybookSettings) -> ToolCall:
    if s.split is None:
        return _call("ingest", {}, "ingest and split the feedback first: train, dev holdout, sealed confirmation")
    if s.bars is None:
        return _call("register_bars", {}, "bars before scores: register the lab's promotion bars before any eval")
    inc = s.incumbent
    if inc not in s.calibrated:
        calibration = s.call("calibrate", {"artifact": inc, "k": cfg.k})
        if calibration is not None and calibration.status != "open":
            name = s.checkpoint(inc).name if s.checkpoint(inc) else inc
            return _call("stop", {"reason": f"calibration of incumbent {name} failed: {calibration.summary}"},
                         "no noise floor, no comparison")
        return _call("calibrate", {"artifact": inc, "k": cfg.k},
                     f"noise before deltas: K={cfg.k} replicates of incumbent {inc} on every open suite (its baseline)")
    stop = _stop_reason(s, cfg)
    if stop:
        return _call("stop", {"reason": stop}, stop)
    for producer in _arms(s, cfg):
        step = _advance(s, producer)
        if step is not None:
            return step
    return _call("stop", {"reason": "protocol complete"}, "every arm of the protocol has run")


def _stop_reason(s: Summary, cfg: PlaybookSettings) -> str | None:
    if s.consecutive_failed_arms >= cfg.max_failed_arms:
        return f"{s.consecutive_failed_arms} arms in a row failed or missed the bars (limit {cfg.max_failed_arms})"
    left = s.budget.left_above_reserve_gpuh
    if left <= cfg.min_step_gpuh:
        return f"budget low: {left:.3f} GPU-h left above the reserve of {s.budget.reserve_gpuh:.3f}"
    return None


def _advance(s: Summary, producer: ToolCall) -> ToolCall | None:
    """The next step of one arm: produce the candidate, evaluate it, compare it, promote it; None when done."""
    made = s.call(producer.tool, producer.args)
    if made is None or made.status == "open":  # not run yet, or interrupted: (re)run it
        return producer
    if made.status != "done":
        return None
    cand = s.checkpoint(made.data["artifact_id"])
    if cand is None:
        return None
    if not cand.metrics:
        evaluated = s.call("evaluate", {"artifact": cand.id})
        if evaluated is not None and evaluated.status != "open":
            return None  # its evaluation failed
        return _call("evaluate", {"artifact": cand.id}, f"evaluate {cand.name} at its served decoding")
    compared = s.call("compare", {"candidate": cand.id})
    if compared is None or compared.status == "open":
        return _call("compare", {"candidate": cand.id},
                     f"compare {cand.name} ({_primary_line(s, cand)}) with incumbent {s.incumbent} under the bars")
    mine = [v for v in cand.verdicts if v.incumbent == s.incumbent]
    if mine and mine[-1].promoted and cand.id != s.incumbent and s.call("promote", {"candidate": cand.id}) is None:
        return _call("promote", {"candidate": cand.id}, f"{cand.name} cleared every bar: " + "; ".join(mine[-1].bars))
    return None


def _primary(s: Summary) -> tuple[str, str]:
    suite, metric = s.bars["rules"][0].split()[0].split("/", 1)
    return suite, metric


def _score(s: Summary, artifact_id: int) -> float | None:
    cp = s.checkpoint(artifact_id)
    suite, metric = _primary(s)
    return cp.metrics.get(suite, {}).get(metric) if cp else None


def _primary_line(s: Summary, cand) -> str:
    suite, metric = _primary(s)
    value = cand.metrics.get(suite, {}).get(metric)
    return f"{suite}/{metric}={value:.3f}" if value is not None else "no primary metric"


def _dataset_step(s: Summary, family: str, cfg: PlaybookSettings) -> tuple[int | None, ToolCall | None]:
    """The family's dataset id, or the build step that makes it (None, None when the build failed)."""
    builder = _BUILDERS[family]
    args: dict[str, Any] = {"builder": builder}
    if builder == "synthetic_verified":
        args |= {"rows": "items", "counts": dict(cfg.rft_counts), "seed": 1000}
    call = s.call("build_dataset", args)
    if call is None or call.status == "open":
        return None, _call("build_dataset", args, f"{family} arm needs {builder} data (leak-audited)")
    if call.status != "done":
        return None, None
    return call.data["artifact_id"], None


def _train_args(s: Summary, family: str, dataset: int, cfg: PlaybookSettings, lr: float) -> dict[str, Any]:
    return {"trainer": family, "parent": s.parent, "dataset": dataset, "lr": lr, "steps": cfg.steps,
            "batch_size": cfg.batch_size}


def _first_arms(s: Summary, cfg: PlaybookSettings) -> Iterator[tuple[str, int, ToolCall]]:
    for family in cfg.families:
        dataset, build = _dataset_step(s, family, cfg)
        if build is not None:
            yield family, -1, build
            return
        if dataset is None:
            continue
        args = _train_args(s, family, dataset, cfg, cfg.lr[family])
        yield family, dataset, _call("train", args, f"first {family} arm at a conservative lr {cfg.lr[family]:g}, "
                                                    f"{cfg.steps} steps, from the parent")


def _arms(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    scored: list[tuple[float, str, int]] = []
    for family, dataset, producer in _first_arms(s, cfg):
        yield producer
        made = s.call(producer.tool, producer.args) if producer.tool == "train" else None
        score = _score(s, made.data["artifact_id"]) if made and made.status == "done" else None
        if score is not None:
            scored.append((score, family, dataset))
    if not scored:
        return
    best_score, family, dataset = max(scored, key=lambda t: (t[0], -cfg.families.index(t[1])))
    for factor in cfg.sweep:
        lr = cfg.lr[family] * factor
        yield _call("train", _train_args(s, family, dataset, cfg, lr),
                    f"lr sweep along the best family {family} (first arm {best_score:.3f}): lr {lr:g}")
    yield from _merges(s, cfg)
    base = _weights_incumbent(s)
    for alt in cfg.serving:
        args = {"artifact": base, **alt.model_dump(exclude_none=True)}
        yield _call("tune_serving", args, f"serving alternative for the incumbent's weights: {alt.model_dump(exclude_none=True)}")


def _promoted_trained(s: Summary) -> list[int]:
    return [c.id for c in s.checkpoints if c.origin.startswith("train:") and c.parent == s.parent
            and any(v.promoted for v in c.verdicts)]


def _merges(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    promoted = _promoted_trained(s)
    if cfg.soup and len(promoted) >= 2:
        yield _call("merge", {"method": "soup", "models": promoted}, f"soup of the promoted siblings {promoted}")
    if not promoted:
        return
    best = max(promoted, key=lambda i: (_score(s, i) or 0.0, -i))
    for alpha in cfg.dose_alphas:
        yield _call("merge", {"method": "dose", "models": [s.parent, best], "alpha": alpha},
                    f"dose {alpha:g} from the parent along the best promoted arm {best}: the bars pick the knee")


def _weights_incumbent(s: Summary) -> int:
    """The incumbent, or the artifact whose weights it serves when it is a serving alternative."""
    cp = s.checkpoint(s.incumbent)
    return cp.parent if cp is not None and cp.origin == "serving" and cp.parent is not None else s.incumbent
