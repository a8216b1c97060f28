"""Failure classes of jobs, how a failed run is classified, and what the launcher does about it.

A run that did not complete is classified from three observations, in this order of trust: the
executor's final state (Slurm `sacct` State, or the local process outcome), the exit code, and the
tail of the job's own error text (the exception trace submitit pickled, else the stderr tail).

    classify(state="FAILED", exit_code=1, text="...torch.OutOfMemoryError: CUDA out of memory...")
    # Failure(failure_class='oom', detail='torch.OutOfMemoryError: CUDA out of memory...')

Policy (DESIGN.md invariant 6): preempted, and lost (killed from outside without a result or an
exception of its own, as with the agent's process group) -> requeue from the last checkpoint; timeout -> requeue
from the last checkpoint up to a limit; oom -> one retry with half the micro-batch and twice the
gradient accumulation (same tokens per optimizer step); everything else is a recorded failure.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.display import shown
from core.placement import NO_GPU_PREFIX
from core.redact import redact

FailureClass = Literal[
    "oom", "preempted", "timeout", "nccl_timeout", "nan_loss", "node_failure", "cancelled", "no_gpu", "lost", "config",
    "error"
]
Action = Literal["requeue", "retry_smaller_batch", "record"]
C = TypeVar("C", bound=BaseModel)

# Message prefixes raised inside a job by the launcher's own wrapper (tools/jobs/launcher.py) when an
# in-place requeue is no longer allowed; the classifier reads them back from the trace.
TIMEOUT_PREFIX = "timeout:"
PREEMPTED_PREFIX = "preempted:"
# Trainers raise an exception whose message starts with this when the loss stops being finite.
NAN_PREFIX = "nan_loss:"
# Trainers raise this (trainers.common.ConfigError) for settings that cannot run, found before any compute (LoRA targets
# that match nothing, a chat template they cannot train with): class config, recorded, never retried; the train tool
# records it as a refusal of the arm (tools/train.py).
CONFIG_ERROR = "trainers.common.ConfigError"
# NO_GPU_PREFIX: a job given GPUs that finds none on its host (core/placement.py) says so; it is recorded, not
# retried (it would fail the same way again).

# The most characters of a job's own error message kept beside its class (issue 43, item 3): enough for the
# reason a person needs ("the tokenizer has no pad token ..."), short enough for one CLI line and a table cell.
MESSAGE_LIMIT = 300

# Ranks that hang or disagree, past their timeout (class nccl_timeout, whatever the backend):
# torch.distributed's watchdog and NCCL's own messages; gloo's collective timeout (CPU jobs); and the
# rendezvous store when a rank never joined the group.
_NCCL = re.compile(r"Watchdog caught collective operation timeout|NCCL.{0,80}(timed out|[Tt]imeout)"
                   r"|gloo.{0,120}Timed out waiting \d+ms for (recv|send) operation"
                   r"|DistStoreError: Timed out after .{0,40}waiting for clients")


class Failure(BaseModel):
    """Why a run did not complete."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    failure_class: FailureClass = Field(description="One of the classes the planner and the policy act on.")
    detail: str = Field(description="The evidence, in words the project minted: the executor's state, the exception's "
                        "type, the exit code, or the message of a project-raised prefix (nan_loss:, timeout:, ...); "
                        "never the text of an arbitrary exception message (`message` holds that).")
    message: str = Field("", description="The job's own error message, for a person: secrets redacted, control and "
                         "bidi characters escaped (one line), at most MESSAGE_LIMIT characters (`safe_message`). It "
                         "never decides the class and never reaches the planner; '' when the run left none.")

    def line(self) -> str:
        """The failure as one line for a person: the minted detail, then the job's own message."""
        return f"{self.detail}: {self.message}" if self.message else self.detail


def classify(state: str, exit_code: int | None, text: str, raised: tuple[str, Failure | None] | None = None) -> Failure:
    """Classify a run that did not complete; `state` is the executor's final state, upper case.

    An exception's message may carry input text (a battle id with a newline and an instruction to the
    planner, a forged trace, a file's content): it neither decides the class nor reaches the detail.
    `raised` is what the job wrapper recorded of the job's own exception where it was raised (its type,
    and its class when it has one beyond 'error': `raised_failure`); it is trusted over `text`. Without it
    the final exception of the trace in `text` is read: its type and the first line of its message."""
    state = state.upper()
    if state.startswith("CANCELLED"):
        return Failure(failure_class="cancelled", detail=state)
    if state in {"NODE_FAIL", "BOOT_FAIL"}:
        return Failure(failure_class="node_failure", detail=state)
    if state == "OUT_OF_MEMORY":
        return Failure(failure_class="oom", detail=state)
    code = "" if exit_code is None else f" (exit code {exit_code})"
    if raised is not None:
        kind, failure = raised
    else:
        kind, message = _final_exception(text)
        failure = _from_exception(kind, message) if kind else None
        # Hangs are reported in the ranks' logs, not always as the final exception: the whole text is read.
        if failure is None and _NCCL.search(text):
            failure = Failure(failure_class="nccl_timeout", detail="a collective operation timed out" + (f" ({kind})" if kind else ""))
        for prefix, klass in _PREFIXES:
            if failure is None and not kind and re.search(rf"^(\[rank\d+\]: ?)?([\w.]+: )?{re.escape(prefix)}", text, re.MULTILINE):
                failure = Failure(failure_class=klass, detail=f"{prefix} (from the job's error text)")
    # The job's own words come before the generic TIMEOUT/PREEMPTED states: a NaN or an OOM is what
    # needs fixing even when the job then ran out of time.
    if failure is not None:
        return failure
    if state == "TIMEOUT":
        return Failure(failure_class="timeout", detail=state)
    if state == "PREEMPTED":
        return Failure(failure_class="preempted", detail=state)
    if state == "FAILED" and not kind and exit_code is None:
        # Killed from outside without a word: no result, no exception of its own, no exit code. Typically it
        # died with the agent's process group (a closed terminal, a double Ctrl-C); it is run again.
        return Failure(failure_class="lost", detail=f"{state}: killed from outside (no result, no exception)")
    return Failure(failure_class="error", detail=(kind or f"{state}: no exception") + code)


def safe_message(text: str) -> str:
    """An error message as it may be stored and shown (the one rule for a job's own words): secrets redacted
    (core/redact.py) before it is cut, so a key is never kept half; every control, format and separator
    character escaped (core/display.py), so a newline cannot forge a line and an ESC cannot reach a terminal;
    at most MESSAGE_LIMIT characters, with a count of the rest."""
    return shown(redact(text.strip()), limit=MESSAGE_LIMIT)


def message_of(text: str) -> str:
    """The message of the final exception of the trace in `text` (its first line only, see _final_exception),
    made safe; '' without a trace. For runs whose wrapper recorded no exception (another rank failed)."""
    return safe_message(_final_exception(text)[1])


def exception_type(err: BaseException) -> str:
    """The exception's type as a trace names it (builtins unqualified)."""
    cls = type(err)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def raised_failure(err: BaseException) -> Failure | None:
    """The class of a job's own exception, decided where it was raised (the job wrapper records it beside
    the run): from its type and the first line of its message. None: no class beyond 'error'."""
    return _from_exception(exception_type(err), str(err).split("\n", 1)[0].strip())


def _from_exception(kind: str, message: str) -> Failure | None:
    """A class from an exception's type and the first line of its message, each read from its start only,
    so that text a message quotes (an input) cannot make an OOM retry or a requeue."""
    if kind.endswith(("OutOfMemoryError", "MemoryError")) or message.startswith(_OOM_MESSAGES):
        return Failure(failure_class="oom", detail=kind)
    if kind == CONFIG_ERROR:  # a trainer refusing its own settings before any compute: the arm cannot train so
        return Failure(failure_class="config", detail=f"{kind}: the job's settings cannot run")
    if (kind.endswith("DistStoreError") and message.startswith("Timed out")) or _NCCL.search(message[:300]):
        return Failure(failure_class="nccl_timeout", detail=f"a collective operation timed out ({kind})")
    for prefix, klass in _PREFIXES:
        if message.startswith(prefix):  # raised by the project (trainers, the job wrapper, core/placement.py)
            return Failure(failure_class=klass, detail=f"{kind}: {_printable(message)}"[:300])
    return None


_PREFIXES: tuple[tuple[str, FailureClass], ...] = (
    (NAN_PREFIX, "nan_loss"), (NO_GPU_PREFIX, "no_gpu"), (TIMEOUT_PREFIX, "timeout"), (PREEMPTED_PREFIX, "preempted"))
# How torch's CUDA out-of-memory errors begin when raised as a plain RuntimeError (older torch, cuBLAS).
_OOM_MESSAGES = ("CUDA out of memory", "CUDA error: out of memory", "CUDA error: CUBLAS_STATUS_ALLOC_FAILED")


_RANK = re.compile(r"^\[rank\d+\]: ?")
_EXCEPTION_TYPE = re.compile(r"[A-Za-z_][\w.]*")


def _final_exception(text: str) -> tuple[str, str]:
    """(type, first line of its message) of the last exception of the last Python trace in `text`;
    ("", "") without a trace. The header is the first unindented line after the trace's frames; the
    message's later lines (where a newline in an input would put a forged line) are never read."""
    lines = [_RANK.sub("", ln) for ln in text.splitlines()]
    starts = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last):")]
    if not starts:
        return "", ""
    for ln in lines[starts[-1] + 1:]:
        if not ln.strip() or ln.startswith((" ", "\t")):
            continue  # frames, their source lines and carets
        kind, _, message = ln.partition(":")
        if not _EXCEPTION_TYPE.fullmatch(kind):
            return "", ""
        return kind[:120], message.strip()
    return "", ""


def _printable(text: str) -> str:
    """A project-minted message as stored: printable ASCII only (a terminal or a prompt reads it)."""
    return "".join(ch if " " <= ch <= "~" else "?" for ch in text)


def smaller_batch_config(config: C) -> C | None:
    """The OOM retry's config, or None when the config cannot be made smaller.

    The protocol a job config follows to be retried after an OOM: an integer `micro_batch_size`
    (rows per forward pass), halved here. Accumulation doubles so the optimizer sees the same rows
    per step: a `grad_accum` field is doubled; with a `batch_size` field (rows per optimizer step,
    as in trainers.common.TrainConfig) accumulation is batch_size / micro_batch_size and doubles by
    itself. An `output_dir` moves to a sibling `<name>-mb<k>`, because a trainer refuses a run
    directory that holds a different config. The result is validated like any config.
    """
    fields = type(config).model_fields
    micro = getattr(config, "micro_batch_size", 0) if "micro_batch_size" in fields else 0
    if micro < 2:
        return None
    update: dict[str, object] = {"micro_batch_size": micro // 2}
    if "grad_accum" in fields:
        update["grad_accum"] = config.grad_accum * 2  # type: ignore[attr-defined]
    if "output_dir" in fields:
        out = Path(config.output_dir)  # type: ignore[attr-defined]
        update["output_dir"] = out.with_name(f"{out.name}-mb{micro // 2}")
    try:
        return type(config).model_validate({**config.model_dump(), **update})
    except ValidationError:
        return None


def decide(failure_class: FailureClass, *, oom_retries: int, requeues: int, max_requeues: int,
           can_halve_batch: bool) -> Action:
    """What to do after a run ended with `failure_class` (counts are over earlier attempts of the job)."""
    if failure_class in {"preempted", "timeout", "lost"} and requeues < max_requeues:
        return "requeue"
    if failure_class == "oom" and oom_retries == 0 and can_halve_batch:
        return "retry_smaller_batch"
    return "record"
