"""Keys: what the notebook keeps of a job to submit it once and rebuild its handle, and the idempotency key.

    key = job_key(session, "sft", trainers.sft.train, SFTConfig(...), lab_roots)   # sha256 of kind, function,
                                                                                    # session and canonical args
    spec = spec_of_record(nb.get_job(key, 1))      # its function, result model, config and resources, from rows

A job's rows name its function and result model ("module:qualname"), so a resumed agent that kept only keys
rebuilds each job from the notebook alone.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from memory.notebook import JobRecord, tool_call_key
from tools.jobs.resources import Resources
from tools.paths import portable

# Modules that moved into tools/ subpackages keep their old names in job keys, and their old recorded paths still
# resolve, so a session recorded before the move replays and resumes to the same keys.
MOVED = {f"tools.{old}": f"tools.{package}.{old}" for package, olds in {
    "jobs": ("launcher", "zygote", "executor", "jobrun", "failures", "progress", "probe"),
    "nomination": ("bundle", "card", "check_bundle", "publish"),
    "data": ("feedback", "splits", "leak", "datasets")}.items() for old in olds}
_KEY_MODULE = {new: old for old, new in MOVED.items()}


def import_path(obj: Callable[..., Any] | type) -> str:
    """'module:qualname' of a module-level function or class."""
    return f"{obj.__module__}:{obj.__qualname__}"


def resolve(path: str) -> Any:
    """The object an `import_path` names."""
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(MOVED.get(module, module))
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to (re)submit and read back one keyed job; rebuilt from its rows by `attach`."""

    kind: str
    fn: Callable[[Any], Any]
    args: BaseModel
    resources: Resources
    result_type: type[BaseModel]


def spec_of_call(kind: str, fn: Callable[..., Any], args: BaseModel, resources: Resources) -> JobSpec:
    """Check that `fn` is a job `attach` can rebuild: importable, one pydantic config in, a pydantic model out."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    hints = typing.get_type_hints(fn)
    result_type = hints.get("return")
    if not (isinstance(result_type, type) and issubclass(result_type, BaseModel)):
        raise TypeError(f"{name} must be annotated to return a pydantic model")
    params = list(inspect.signature(fn).parameters)
    config_type = hints.get(params[0]) if len(params) == 1 else None
    if not (isinstance(config_type, type) and isinstance(args, config_type)):
        raise TypeError(f"{name} must take one argument annotated with the config's type {type(args).__name__}")
    try:
        importable = resolve(import_path(fn)) is fn
    except (ImportError, AttributeError):
        importable = False
    if not importable or fn.__module__ == "__main__":
        raise TypeError(f"{name} must be a module-level function of an importable module "
                        "(a resumed agent re-imports it as module:qualname)")
    return JobSpec(kind, fn, args, resources, result_type)


def spec_of_record(first: JobRecord, args: BaseModel | None = None, latest: JobRecord | None = None) -> JobSpec:
    """The spec stored with a job's first attempt: its function, result model and config (`args`: the config as
    its caller has it, used instead of validating the stored one again: a config's checks of the world held when it
    was made, and no longer do once the job ran, e.g. a merge's fresh output directory that the job, living on after
    its agent was killed, has since created), with the resources of its `latest` attempt (a requeue's time limit is
    shortened to what the budget has left, tools/jobs/retries.py shortened)."""
    if first.fn is None or first.result_type is None:
        raise LookupError(f"job {first.key[:12]} was recorded before jobs named their function; "
                          "submit it again with its function to re-attach")
    try:
        fn, result_type = resolve(first.fn), resolve(first.result_type)
    except (ImportError, AttributeError) as err:
        raise LookupError(f"job {first.key[:12]}: its function {first.fn} or result model {first.result_type} "
                          f"no longer imports ({err})") from err
    hints = typing.get_type_hints(fn)
    config_type = hints[next(iter(inspect.signature(fn).parameters))]
    recorded = first.resources["args"]
    stored = dict((latest or first).resources)
    stored.pop("args")
    args = args if args is not None else config_type.model_validate(recorded)
    stored.pop("memory", None)  # the memory estimate recorded with a training job, not a resource
    stored.pop("forecast", None)  # the attempt's forecast, recorded beside what it cost
    return JobSpec(first.kind, fn, args, Resources.model_validate(stored), result_type)


def job_key(session: str, kind: str, fn: Callable[..., Any], args: BaseModel, lab_roots: Sequence[str]) -> str:
    """Idempotency key: the tool (kind and function) and the canonical args, within a session; paths inside the lab
    (any of `lab_roots`' spellings) enter lab-relative, so a lab reached by another spelling, copied or moved keeps
    its keys."""
    module = _KEY_MODULE.get(fn.__module__, fn.__module__)
    return tool_call_key(f"{kind}:{module}.{fn.__qualname__}",
                         {"session": session, "args": portable(args.model_dump(mode="json"), lab_roots)})
