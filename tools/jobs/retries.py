"""Retries: what follows a failed attempt (DESIGN.md invariant 6). Preemption, a time limit or a lost run requeues
from the last checkpoint up to `max_requeues` times; an OOM retries once with half the micro-batch and twice the
accumulation; anything else is recorded. Every requeue and retry is a new attempt, admitted against the budget
again (tools/jobs/reservations.py) with its time limit shortened to what the budget has left.

    action = next_action(attempts, failure, spec)   # "requeue", "retry_smaller_batch" or "record"
    args = attempt_args(attempts, spec)              # the next attempt's config
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel

from memory.records import JobRecord
from tools.jobs.failures import Action, Failure, decide, smaller_batch_config
from tools.jobs.keys import JobSpec

REQUEUED_CLASSES = {"preempted", "timeout", "lost"}  # failure classes that count against max_requeues


def next_action(attempts: list[JobRecord], failure: Failure, spec: JobSpec) -> Action:
    """What follows the last of `attempts`, which failed with `failure`."""
    earlier = attempts[:-1]
    return decide(
        failure.failure_class,
        oom_retries=sum(1 for a in earlier if a.failure_class == "oom"),
        requeues=sum(1 for a in earlier if a.failure_class in REQUEUED_CLASSES),
        max_requeues=spec.resources.max_requeues,
        can_halve_batch=smaller_batch_config(spec.args) is not None,
    )


def reason(action: Action, failure: Failure) -> str:
    """The launch decision's words for a retry or a requeue."""
    if action == "retry_smaller_batch":
        return "OOM: retry with half the micro-batch and twice the accumulation"
    return f"{failure.failure_class}: requeue from the last checkpoint"


def attempt_args(attempts: list[JobRecord], spec: JobSpec) -> BaseModel:
    """The config of the next attempt: the smaller-batch config once an earlier attempt ran out of memory."""
    if any(a.failure_class == "oom" for a in attempts):
        smaller = smaller_batch_config(spec.args)
        assert smaller is not None, "an OOM retry is only decided when the config can shrink"
        return smaller
    return spec.args


def shortened(spec: JobSpec, limit_min: float) -> JobSpec:
    """A later attempt's spec under a time limit of `limit_min` (what the budget has left, so that a job sized to
    the budget's last minutes can still fit after a lost run); its signal lead at most half of it."""
    r = spec.resources
    if limit_min >= r.time_limit_min:
        return spec
    lead = None if r.signal_delay_s is None else max(1, min(r.signal_delay_s, int(limit_min * 60 // 2)))
    return replace(spec, resources=r.model_copy(update={"time_limit_min": limit_min, "signal_delay_s": lead}))
