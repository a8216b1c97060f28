"""Replay: re-run a session's decision logic with every tool result served from the notebook.

    python run_agent.py replay SESSION [--lab DIR] [--bars FILE] [--planner playbook|openai]

The graph runs again, unchanged, against a scratch notebook in a temporary directory (the lab's
notebook is opened read-only; nothing is written to it, no graph checkpoint is written, no job is
launched). Its job submitter (`ReplaySubmitter`) applies the launcher's budget admission, then serves
each job the recorded session ran (same idempotency key: same tool, same arguments) by copying its
attempts, result and launch/fail decisions into the scratch notebook. A job the session never ran
is not launched: its tool reports "would launch: <kind> <key>" and the loop goes on without it.

The lab's latest feedback split from before the session is carried into the scratch notebook (a
re-ingestion keeps its assignments). Without `--bars` the session's own registered bars are registered again, each
registration at its step (`LabSpec.replayed_bars`: a default register_bars step registers the one the session made
at the same place), as the typed specs its session state holds (never written out as text and read back), not the
lab's bars file as read today: a session registered before `floor_unit` existed used the replicates' floor, which
its unchanged file now reads as `resolvable`. The recorded and replayed decision sequences are compared kind by
kind, payloads normalised (row ids that differ between notebooks are dropped, artifact ids become artifact names,
the bars' hash is left out since other bars are the point of `--bars`; a notebook from before the `incumbent`
kind recorded the change of incumbent as a `promote` decision, which compares as the `incumbent` it is). Identical: exit 0. Otherwise the first decision
that differs and everything after it are printed side by side, each replayed step that would have
needed a new job marked, and the exit status is 1.
"""

from __future__ import annotations

import tempfile
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from langgraph.checkpoint.memory import InMemorySaver
from pydantic import BaseModel

from agent.closing import require_verified
from agent.config import LabConfig, load_lab_config
from agent.errors import SessionError
from agent.graph import Runtime, drive
from agent.live import Silent
from agent.planners.playbook import Playbook, PlaybookSettings
from core.display import shown
from evals import bars as bars_file
from memory.notebook import Artifact, Decision, JobRecord, Notebook, NotebookError, Session, now
from memory.records import BarsSpec, FailPayload, IncumbentPayload, LaunchPayload, RefusePayload
from memory.state import fold
from tools.context import ToolContext, WouldLaunch
from tools.jobs.launcher import JobFailed, Launcher, Resources
from tools.paths import LabPaths
from tools.promote import start_incumbent

_ARTIFACT_KEYS = {"artifact_id", "candidate", "incumbent", "previous", "parent", "dataset", "artifact"}
_ARTIFACT_LISTS = {"models", "parents"}
_ROW_IDS = {"comparison_id", "bars_id", "eval_ids", "noise_floor_ids", "split_id", "plan_seq", "sha256",
            "config_sha256", "session_sha256"}
_COPIED = ("start_job", "update_job")
# The decisions a recorded job's attempts wrote (its launches, failures and refusals): copied with the job.
_JOB_PAYLOADS = tuple(t for t in (LaunchPayload, FailPayload, *typing.get_args(RefusePayload)) if "key" in t.model_fields)


class ScratchNotebook(Notebook):
    """The replay's notebook. An artifact a tool records again gets the id the session's own record of it has
    (same session, kind, name and sha256), so a config that names artifacts by row id (the bundle job's) is
    the recorded one even when other sessions' artifacts came first in the lab; anything new is numbered on."""

    original: Notebook | None = None

    def add_artifact(self, *, kind: str, name: str, path: str, sha256: str, parents: list[int] | None = None,
                     recipe: dict[str, Any] | None = None, job_key: str | None = None,
                     session: str | None = None) -> Artifact:
        recorded = [a.id for a in (self.original.artifacts(session=session, sha256=sha256) if self.original else [])
                    if (a.kind, a.name) == (kind, name)]
        free = [i for i in recorded if not self.db.execute("SELECT 1 FROM artifact WHERE id = ?", [i]).fetchone()]
        if session is None or not free:
            return super().add_artifact(kind=kind, name=name, path=path, sha256=sha256, parents=parents,
                                        recipe=recipe, job_key=job_key, session=session)
        with self.transaction():
            self._insert("artifact", {"id": free[0], "session": session, "kind": kind, "name": name, "path": path,
                                      "sha256": sha256, "parents": parents or [], "recipe": recipe or {},
                                      "job_key": job_key, "created_at": now()})
        return self.artifact(free[0])


class ServedJob:
    """A recorded job's handle in replay: its result is the one the notebook holds."""

    def __init__(self, key: str, record: JobRecord, result_type: type[BaseModel]):
        self.key, self.record, self.result_type = key, record, result_type

    def result(self, timeout_s: float | None = None) -> Any:
        if self.record.state != "completed":
            raise JobFailed(self.record)
        return self.result_type.model_validate(self.record.result)


class ReplaySubmitter:
    """Serves recorded jobs by key; launches nothing (see the module docstring)."""

    def __init__(self, original: Notebook, scratch: Notebook, session: str, launcher: Launcher):
        self.original, self.scratch, self.session, self.launcher = original, scratch, session, launcher

    def submit(self, kind: str, fn: Callable[[Any], Any], args: BaseModel, resources: Resources) -> ServedJob:
        key = self.launcher.key(kind, fn, args)
        self.launcher.check_memory(key, kind, args, resources)  # the launcher's memory admission, recorded in scratch
        self.launcher.admit(key, kind, resources)  # the launcher's budget admission and its refusal
        attempts = self.original.jobs(session=self.session, key=key)
        if not attempts:
            raise WouldLaunch(kind, key)
        self._copy(key, attempts)
        return ServedJob(key, attempts[-1], typing.get_type_hints(fn)["return"])

    def _copy(self, key: str, attempts: list[JobRecord]) -> None:
        if self.scratch.jobs(session=self.session, key=key):
            return  # served before (a re-attached step)
        with self.scratch.transaction():
            for a in attempts:
                self.scratch.start_job(key, session=self.session, kind=a.kind, executor=a.executor,
                                       resources=a.resources, forecast_gpuh=a.forecast_gpuh, attempt=a.attempt,
                                       folder=a.folder, fn=a.fn, result_type=a.result_type)
                self.scratch.update_job(key, a.attempt, state=a.state, external_id=a.external_id,
                                        started_at=a.started_at, ended_at=a.ended_at, gpu_hours=a.gpu_hours,
                                        failure_class=a.failure_class, failure_detail=a.failure_detail,
                                        log_path=a.log_path, result=a.result, device_seconds=a.device_seconds,
                                        charge=a.charge)
            for d in self.original.decisions(self.session):
                if isinstance(d.payload, _JOB_PAYLOADS) and d.payload.key == key:
                    self.scratch.record_decision(self.session, d.kind, d.rationale, d.payload)


# ---- comparing decision sequences ---------------------------------------------------------------


def _normalise(value: Any, names: dict[int, str], key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: _normalise(v, names, k) for k, v in sorted(value.items()) if k not in _ROW_IDS}
    if isinstance(value, list):
        if key in _ARTIFACT_LISTS:
            return [names.get(v, v) if isinstance(v, int) else v for v in value]
        return [_normalise(v, names) for v in value]
    if key in _ARTIFACT_KEYS and isinstance(value, int):
        return names.get(value, f"#{value}")
    return value


def signature(d: Decision, names: dict[int, str]) -> tuple[str, Any]:
    """What must match between the recorded and the replayed decision."""
    kind = "incumbent" if isinstance(d.payload, IncumbentPayload) else d.kind  # a `promote` of before the kind
    return kind, _normalise(d.payload.model_dump(mode="json"), names)


def _names(nb: Notebook, session: str) -> dict[int, str]:
    return {a.id: a.name for a in nb.artifacts(session=session)}


def _would_launch(scratch: Notebook, session: str) -> dict[int, str]:
    """plan decision seq -> 'would launch: ...' for replayed steps that needed a job never run."""
    out = {}
    for c in scratch.tool_calls(session):
        if c.outcome is not None and c.outcome.status == "unavailable" and c.decision_seq is not None:
            out[c.decision_seq] = c.outcome.summary
    return out


def _line(d: Decision | None, width: int) -> str:
    if d is None:
        return "-".ljust(width)
    text = f"{d.seq:>4} {d.kind:<13} {d.rationale}"
    return (text[: width - 1] + "…" if len(text) > width else text).ljust(width)


def side_by_side(recorded: list[Decision], replayed: list[Decision], start: int, launches: dict[int, str],
                 width: int = 70) -> list[str]:
    lines = [f"{'recorded'.ljust(width)} | replayed", f"{'-' * width}-+-{'-' * width}"]
    for i in range(start, max(len(recorded), len(replayed))):
        left = recorded[i] if i < len(recorded) else None
        right = replayed[i] if i < len(replayed) else None
        mark = f"   [{launches[right.seq]}]" if right is not None and right.seq in launches else ""
        lines.append(f"{_line(left, width)} | {_line(right, width).rstrip()}{mark}")
    return lines


class ReplayResult(BaseModel):
    """The outcome of one replay."""

    same: bool
    recorded: int
    replayed: int
    first_difference: int | None
    lines: list[str]
    would_launch: list[str]
    bars_spec: BarsSpec | None = None  # the bars the replay registered (typed spec), None when it registered none


def replay(lab_dir: Path, session: str, *, bars: Path | None = None, planner: str | None = None,
           protocol: str | None = None) -> ReplayResult:
    """Re-derive a session's decisions (see the module docstring); writes nothing in the lab."""
    from agent.runner import lab_spec, make_planner, minute_cost

    lab_dir = lab_dir.resolve()  # as the session recorded it (agent/runner.py)
    paths = LabPaths(root=lab_dir, session=session)
    if not paths.notebook.exists():
        raise SessionError(f"{paths.notebook}: no notebook here (pass --lab DIR)")
    config = load_lab_config(lab_dir)
    if bars is not None:
        _check_bars(bars, config)
    # One consistent copy of the notebook, taken at once: a resume or run writing the lab meanwhile commits
    # after the copy, never between two of replay's reads.
    with Notebook.open(paths.notebook, readonly=True, snapshot=True) as original, \
            tempfile.TemporaryDirectory() as tmp:
        try:
            s = original.session(session)
        except NotebookError as exc:
            raise SessionError(str(exc)) from None
        _refuse_a_session_being_written(paths, s)
        require_verified(original, "replay")
        settings = (PlaybookSettings.recorded(s.config["playbook"], session) if protocol is None
                    else PlaybookSettings.named(protocol, s.config["playbook"].get("verified_pool")))
        with ScratchNotebook.open(Path(tmp) / "notebook.db", lab=lab_dir) as scratch:
            scratch.original = original
            scratch.open_session(session, lab=s.lab, budget_gpuh=s.budget_gpuh, reserve_gpuh=s.reserve_gpuh,
                                 planner=planner or s.planner, executor=s.executor, config=s.config)
            # The chat format as the session read it at its opening (its stop ids are the served decoding's), not
            # the tokenizer's reading today, which would also load transformers for nothing.
            state = fold(original, session)
            lab = lab_spec(config, state.opened.chat_template if state.opened is not None else None)
            if bars is not None:
                lab = lab.model_copy(update={"bars": bars.resolve()})
            else:  # the bars the session registered, as it read them (its floor unit too), not the file's reading today
                recorded = tuple(r.spec for r in state.registrations)  # in registration order
                lab = lab.model_copy(update={"recorded_bars": recorded})
            section = config.executor.model_copy(update={"kind": s.executor})
            forecaster = Launcher.from_section(scratch, session, section, Path(tmp) / "jobs",
                                               lab_roots=paths.spellings(s.lab))
            ctx = ToolContext(nb=scratch, session=session, paths=paths, lab=lab,
                              jobs=ReplaySubmitter(original, scratch, session, forecaster),
                              minute_gpuh=minute_cost(forecaster))
            playbook = Playbook(settings)
            rt = Runtime(ctx=ctx, planner=make_planner(planner or s.planner, config, playbook), playbook=playbook,
                         forecaster=forecaster, reporter=Silent(), max_failed_arms=settings.max_failed_arms)
            _carry_lab_state(original, scratch, s.started_at)
            start_incumbent(ctx)
            drive(rt, InMemorySaver())
            return _compare(original, scratch, session)


def _refuse_a_session_being_written(paths: LabPaths, s: Session) -> None:
    """A session still open while a process holds the lab is being written: its record ends where that writer
    is now, and a replay would only show its future as a difference. Another session (ended) replays from the
    snapshot while the writer goes on."""
    if s.status != "open":
        return
    writer = paths.writer_holding()
    if writer is not None:
        raise SessionError(f"{paths.lock}: session {s.name} is being written by {writer}; replay it once that "
                           "process ends (a finished or a killed session replays)")


def _check_bars(path: Path, config: LabConfig) -> None:
    """`--bars FILE` must be a bars file for this lab's suites: anything else is bad input, named, before
    any replay (a file the session's registration would fail on would only show as "decisions differ")."""
    try:
        bars_file.load(path, {e.name: e.scorer for e in config.evals})
    except (bars_file.BarsError, OSError) as exc:
        problem = str(exc) if isinstance(exc, bars_file.BarsError) else f"{path}: {exc.strerror or exc}"
        raise SessionError(f"--bars {problem}\n(expected a bars file: TOML with [[bar]] tables of suite, metric "
                           "and rule)") from None


def _carry_lab_state(original: Notebook, scratch: Notebook, started_at: str) -> None:
    """What the session found in the lab when it started: the latest earlier feedback split (whose
    assignments a re-ingestion keeps, so the session's split job depends on it)."""
    earlier = original.latest_split()
    if earlier is not None and earlier.created_at < started_at:
        scratch.record_split(source_path=earlier.source_path, source_sha256=earlier.source_sha256,
                             config=earlier.config, counts=earlier.counts, assignment=earlier.assignment,
                             session=earlier.session)


# Decisions about the session's circumstances, not its policy's: the opening, a job that waited in the queue past
# the lab's bound (timing), a resume on changed [executor] settings. Replay re-derives none of them.
NOT_REPLAYED = frozenset({"open", "wait", "reconfigure"})


def _compare(original: Notebook, scratch: Notebook, session: str) -> ReplayResult:
    recorded = [d for d in original.decisions(session) if d.kind not in NOT_REPLAYED]
    replayed = [d for d in scratch.decisions(session) if d.kind not in NOT_REPLAYED]
    a = [signature(d, _names(original, session)) for d in recorded]
    b = [signature(d, _names(scratch, session)) for d in replayed]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    launches = _would_launch(scratch, session)
    lines = [] if first is None else side_by_side(recorded, replayed, first, launches)
    registered = fold(scratch, session).registrations
    return ReplayResult(same=first is None, recorded=len(recorded), replayed=len(replayed), first_difference=first,
                        lines=lines, would_launch=sorted(launches.values()),
                        bars_spec=registered[0].spec if registered else None)


def replay_command(lab_dir: Path, session: str, *, bars: Path | None, planner: str | None, protocol: str | None) -> int:
    result = replay(lab_dir, session, bars=bars, planner=planner, protocol=protocol)
    if result.same:
        print(f"replay of session {session}: all {result.recorded} decisions reproduced exactly; no job launched, "
              "nothing written")
        return 0
    print(f"replay of session {session}: decisions differ from decision {result.first_difference + 1} of "
          f"{result.recorded} (recorded) / {result.replayed} (replayed); no job launched, nothing written")
    # Each line escaped: rationales and job summaries carry the lab's paths and names, a user's choice.
    print("\n".join(shown(line) for line in result.lines))
    if result.would_launch:
        print(f"{len(result.would_launch)} replayed step(s) would have needed a new job:")
        print("\n".join(f"  {shown(w)}" for w in result.would_launch))
    return 1
