"""The five seeds' recipes as named policies of the playbook (`--recipe NAME`, or `[playbook] recipe` in lab.toml).

Each recipe is the method one seed used, driven by the agent, with what that seed learned the hard way made
automatic (bars before scores, a noise floor, served decoding, sealed confirmation and a checked bundle come with
every policy, from `next_step`). The steps of each read top to bottom below:

    aspen   CE on the human-preferred answers with a forward-KL leash to the frozen parent on all positions, plus
            own-policy replay (the parent's own answers to the replay data's prompts, KL only), as a LoRA arm of
            rank 64 with an FP32 head (the seed's rank: it replaces [train.lora]'s r, alpha scaled to keep the
            lab's alpha / r, and the arm's rationale says so); trajectory selection over its saved steps.
    brook   DPO + NLL as LoRA, in rounds: battle pairs plus loop-fix pairs (on the lab's own train battles, the
            human-preferred answer chosen over the round's starting model's own looping or unstopped answer); each
            promoted round is merged back and the next trains from it; a soup of the rounds; the judged holdout
            is a blind judge on held-out battles.
    delta   Full fine-tuning: winner SFT rendered under the serving system prompt, judged by a reward model's
            proxy win rate (`[judge] kind = "reward_model"`); then a repetition-penalty sweep with the weights fixed.
    ember   SFT on every human-preferred answer (own wins and opponent wins), two arms, a soup of them; every
            candidate also probed on the battle-margin suite (log-prob margins of the recorded battles).
    islet   On-policy rejection-sampling fine-tuning on the lab's own verified pool (the eval scorer is the
            verifier), at three learning rates, under a four-part pre-registered bar set, then a dose line.

`problems(recipe, lab)` says what a recipe needs that the lab lacks, before a session opens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from agent.planners import ToolCall
from agent.planners.policy import PlaybookSettings, ServingAlternative
from agent.planners.stages import (
    evaluate_step,
    proposal,
    run_stage,
    skipped,
    train_args,
    trajectory_selection,
    weights_incumbent,
)
from agent.summary import Summary

RECIPES = ("aspen", "brook", "delta", "ember", "islet")
ASPEN_RANK = 64  # the seed's adapter rank; it replaces the lab's [train.lora] r (README: the recipes' table)


def settings(name: str, protocol: str, lab: dict[str, Any]) -> PlaybookSettings:
    """The recipe's policy at a protocol's sizes (`test`: few steps for the test suite); `lab` names the parts of
    the lab it reads (the verified pool, the battle-margin suite)."""
    test = protocol == "test"
    base: dict[str, Any] = {"name": name, "protocol": protocol, "steps": 4 if test else None,
                            "stage": "judge_every" if test else "best_of_stage", "trajectory_shares": (),
                            "serving": (), "dose_alphas": (), "sweep": (), "soup": False, "families": ()}
    match name:
        case "aspen":
            return PlaybookSettings(**base | {"families": ("klce",), "method": "lora", "replay_rows": 8 if test else 256,
                                              "stage": "best_of_stage",
                                              "trajectory_shares": (1 / 2,) if test else (1 / 3, 2 / 3)})
        case "brook":
            return PlaybookSettings(**base | {"families": ("dpo",), "method": "lora", "rounds": 2, "soup": True,
                                              "loop_fix_prompts": 8 if test else None})
        case "delta":
            return PlaybookSettings(**base | {"families": ("sft",), "method": "full", "serving": tuple(
                ServingAlternative(repetition_penalty=rp) for rp in ((1.1,) if test else (1.05, 1.1, 1.2)))})
        case "ember":
            return PlaybookSettings(**base | {"families": ("sft",), "sweep": (0.5,), "soup": True,
                                              "margin_suite": lab.get("margin_suite")})
        case "islet":
            return PlaybookSettings(**base | {"families": ("rft",), "sweep": (0.5, 2.0), "dose_alphas": (0.5,),
                                              "verified_pool": lab.get("verified_pool")})
    raise ValueError(f"unknown recipe {name!r}; the recipes are {', '.join(RECIPES)}")


def problems(name: str, lab: dict[str, Any]) -> list[str]:
    """What recipe `name` needs that the lab lacks (`lab`: judge kind, chat and verified data, suite scorers, the
    number of bars), each naming what to add; [] when it can run."""
    need = {
        "aspen": [(bool(lab.get("chat_data")), "aspen replays the parent's own answers to the replay data's "
                   "prompts: add a [[data]] source of kind \"chat\"")],
        "brook": [],
        "delta": [(lab.get("judge") == "reward_model", "delta judges by a reward model's proxy win rate: set "
                   "[judge] kind = \"reward_model\" with its path")],
        "ember": [(lab.get("margin_suite") is not None, "ember probes every candidate's battle margins: add an "
                   "[[evals]] suite with scorer = \"battle_margin\"")],
        "islet": [(lab.get("verified_pool") is not None, "islet samples on-policy answers to the lab's own verified "
                   "items: add a [[data]] pool with kind = \"verified\" and its verifier suite"),
                  (lab.get("bars", 0) >= 4, f"islet pre-registers a four-part bar set: the lab's bars file has "
                   f"{lab.get('bars', 0)} bar(s)")],
    }
    if name not in need:
        return [f"unknown recipe {name!r}; the recipes are {', '.join(RECIPES)}"]
    return [why for ok, why in need[name] if not ok]


def steps(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    """The recipe's steps still to take, in order (the playbook takes the first)."""
    yield from {"aspen": _aspen, "brook": _brook, "delta": _delta, "ember": _ember, "islet": _islet}[cfg.name](s, cfg)


# ---- the recipes ---------------------------------------------------------------------------------------


def _aspen(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    sft = yield from _built(s, {"builder": "winner_sft"}, "aspen: cross-entropy on the human-preferred answers")
    own = yield from _built(s, {"builder": "own_replay", "model": s.parent, "n": cfg.replay_rows},
                            "aspen: own-policy replay, the parent's own answers to the replay data's prompts")
    if sft is None or own is None:
        return
    mix = yield from _built(s, {"builder": "mix", "parts": [{"dataset": sft}, {"dataset": own, "kl_only": True}]},
                            "aspen: the preferred answers with CE and KL, the own-policy replay with KL only")
    if mix is None:
        return
    arm = proposal("train", _arm(s, cfg, "klce", mix) | {"lora_r": ASPEN_RANK, "fp32_head": True},
                   f"aspen: LoRA r{ASPEN_RANK} with an FP32 head, the seed's rank in place of the lab's [train.lora] r "
                   "(its alpha scaled to keep the lab's alpha / r), CE with a forward-KL leash to the frozen parent on "
                   "all positions; saves its model along the run for trajectory selection")
    runs = yield from run_stage(s, cfg, [arm])
    note = yield from trajectory_selection(s, cfg, runs)
    if note:
        yield proposal("stop", {"reason": "recipe complete"}, note)


def _brook(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    pairs = yield from _built(s, {"builder": "battle_pairs"}, "brook: DPO pairs from the decisive battles")
    if pairs is None:
        return
    start, rounds = s.parent, []
    for n in range(1, cfg.rounds + 1):
        fix = yield from _built(s, _fix_args(cfg, start, n),
                                f"brook round {n}: loop-fix pairs on the lab's train battles, the preferred answer "
                                f"over {_name(s, start)}'s own looping or unstopped one")
        data = pairs
        if fix is None and s.call("build_dataset", _fix_args(cfg, start, n)) is not None:  # built, and it failed
            yield from skipped(s, f"brook round {n}'s loop-fix pairs", "their build failed "
                               f"({s.call('build_dataset', _fix_args(cfg, start, n)).summary}): the round trains on "
                               "the battle pairs alone")
        if fix is not None:
            data = yield from _built(s, {"builder": "mix", "parts": [{"dataset": pairs}, {"dataset": fix}]},
                                     f"brook round {n}: battle pairs and loop-fix pairs")
            if data is None:
                return
        arm = proposal("train", _arm(s, cfg, "dpo", data) | {"parent": start},
                       f"brook round {n}: DPO + NLL as LoRA from {_name(s, start)}, merged back")
        ranked = yield from run_stage(s, cfg, [arm])
        made = _made(s, arm)
        rounds += [made] if made is not None else []
        if made is None or not ranked or not _promoted(s, made):
            break  # a round that was not promoted ends the rounds: the next would train from a rejected model
        start = made
    if cfg.soup and len(rounds) >= 2:
        yield from run_stage(s, cfg, [proposal("merge", {"method": "soup", "models": rounds},
                                               f"brook: a soup of the rounds {rounds}")])


def _delta(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    sft = yield from _built(s, {"builder": "winner_sft"}, "delta: winner SFT rendered under the serving system prompt")
    if sft is None:
        return
    yield from run_stage(s, cfg, [proposal("train", _arm(s, cfg, "sft", sft), "delta: full fine-tuning on the "
                                           "winner answers, judged by the reward model's proxy win rate")])
    base = weights_incumbent(s)
    for alt in cfg.serving:
        args = {"artifact": base, **alt.model_dump(exclude_none=True)}
        yield from run_stage(s, cfg, [proposal("tune_serving", args, f"delta: repetition penalty "
                                               f"{alt.repetition_penalty:g} with the weights fixed")])


def _ember(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    sft = yield from _built(s, {"builder": "winner_sft"}, "ember: SFT on every human-preferred answer, own wins and "
                            "opponent wins alike")
    if sft is None:
        return
    arms = [proposal("train", _arm(s, cfg, "sft", sft, scale), f"ember: SFT arm at lr x{scale:g} of [train]'s")
            for scale in (1.0, *cfg.sweep)]
    yield from run_stage(s, cfg, arms)
    made = [m for m in (_made(s, a) for a in arms) if m is not None]
    soup = [proposal("merge", {"method": "soup", "models": made}, f"ember: a soup of the SFT arms {made}")]
    if cfg.soup and len(made) >= 2:
        yield from run_stage(s, cfg, soup)
        made += [m for m in (_made(s, soup[0]),) if m is not None]
    for cand in (s.checkpoint(m) for m in made):
        if cand is not None and cfg.margin_suite is not None:
            yield from evaluate_step(s, cand, [cfg.margin_suite], f"ember: battle-margin probe of {cand.name}")


def _islet(s: Summary, cfg: PlaybookSettings) -> Iterator[ToolCall]:
    items = yield from _built(s, {"builder": "verified_pool", "source": cfg.verified_pool},
                              f"islet: RFT items from the lab's verified pool {cfg.verified_pool} (leak-audited)")
    if items is None:
        return
    arms = [proposal("train", _arm(s, cfg, "rft", items, scale), f"islet: on-policy RFT at lr x{scale:g} of "
                     "[train]'s (the verifier is the eval scorer)") for scale in (1.0, *cfg.sweep)]
    yield from run_stage(s, cfg, arms)
    promoted = [m for m in (_made(s, a) for a in arms) if m is not None and _promoted(s, m)]
    best = promoted[-1] if promoted else None  # the last promoted arm: each beat the one promoted before it
    if best is None:
        return
    doses = [proposal("merge", {"method": "dose", "models": [s.parent, best], "alpha": a},
                      f"islet: dose {a:g} from the parent along the promoted arm") for a in cfg.dose_alphas]
    for dose in doses:
        yield from run_stage(s, cfg, [dose])


# ---- helpers -------------------------------------------------------------------------------------------


def _built(s: Summary, args: dict[str, Any], why: str) -> Iterator[ToolCall]:
    """The dataset's id once built; the build step while it is not; None when it failed or a gate refused it."""
    if s.refused("build_dataset", args) is not None:
        return None
    call = s.call("build_dataset", args)
    if call is None or call.status == "open":
        yield proposal("build_dataset", args, why)
        return None
    return call.data.get("artifact_id") if call.status == "done" else None


def _fix_args(cfg: PlaybookSettings, start: int, round_: int) -> dict[str, Any]:
    return {"builder": "loop_fix_pairs", "model": start, "n": cfg.loop_fix_prompts, "seed": round_}


def _arm(s: Summary, cfg: PlaybookSettings, family: str, dataset: int, scale: float = 1.0) -> dict[str, Any]:
    return train_args(s, family, dataset, cfg, scale) | ({"method": cfg.method} if cfg.method else {})


def _made(s: Summary, producer: ToolCall) -> int | None:
    call = s.call(producer.tool, producer.args)
    return call.data.get("artifact_id") if call is not None and call.status == "done" else None


def _promoted(s: Summary, artifact: int) -> bool:
    done = s.call("promote", {"candidate": artifact})
    return done is not None and done.status == "done"


def _name(s: Summary, artifact: int | None) -> str:
    cp = s.checkpoint(artifact) if artifact is not None else None
    return cp.name if cp is not None else str(artifact)
