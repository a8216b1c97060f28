"""Where a job's wall time went: start-up, work and write-out (issue 39, item 4).

A job function times its own stretches with `Laps` and returns `laps.wall()` in its result's `wall` field; the job
wrapper (tools/jobs/jobrun.py) then adds what only it sees: the process's start up to the function (interpreter,
imports, unpickling; a zygote fork counts from its client's start) joins start-up, and whatever the function did
after its last lap (returning, result files) joins write-out. A job that times nothing gets the wrapper's split:
start-up up to the function, the whole function as work.

    laps = Laps()
    torch.cuda.init(); laps.startup("cuda_init")
    model = load(path); laps.startup("load")
    generate(...); laps.work()
    write(...); laps.write()
    return Result(..., wall=laps.wall())
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Wall(BaseModel):
    """A job's wall seconds, split: start-up + work + write-out is the run from its process's start to its return."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    startup_s: float = Field(ge=0, description="From the process's start to its first unit of work: process and "
                             "imports, CUDA initialisation, model load, compilation or graph capture.")
    work_s: float = Field(ge=0, description="The job's work: training steps, generation and scoring, merging.")
    write_s: float = Field(ge=0, description="Writing its outputs after the work: checkpoints, records, results.")
    parts: dict[str, float] = Field(default_factory=dict, description="Start-up's parts where they were timed "
                                    "(process, cuda_init, load, compile), seconds each.")
    began_at: float | None = Field(None, description="Epoch seconds the job's own laps began (the wrapper counts the "
                                   "time before it as start-up); None once the wrapper has completed the record.")

    @property
    def total_s(self) -> float:
        return self.startup_s + self.work_s + self.write_s

    def to_startup(self, part: str, seconds: float) -> Wall:
        """The record with `seconds` of its work booked as start-up part `part` instead (compilation or graph capture
        that happened inside the first unit of work), at most the work there is."""
        moved = min(max(0.0, seconds), self.work_s)
        if not moved:
            return self
        return self.model_copy(update={"startup_s": self.startup_s + moved, "work_s": self.work_s - moved,
                                       "parts": {**self.parts, part: self.parts.get(part, 0.0) + moved}})


class Laps:
    """A job's stopwatch: each call closes the stretch since the previous one and books it as a start-up part,
    work or write-out."""

    def __init__(self) -> None:
        self.began_at = time.time()
        self._last = time.perf_counter()
        self._parts: dict[str, float] = {}
        self._work = self._write = 0.0

    def _lap(self) -> float:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds

    def startup(self, part: str) -> None:
        self._parts[part] = self._parts.get(part, 0.0) + self._lap()

    def work(self) -> None:
        self._work += self._lap()

    def write(self) -> None:
        self._write += self._lap()

    def wall(self) -> Wall:
        return Wall(startup_s=sum(self._parts.values()), work_s=self._work, write_s=self._write,
                    parts=dict(self._parts), began_at=self.began_at)


def completed(wall: Wall | None, process_started: float, entered: float, returned: float) -> Wall:
    """The job's own record completed by the wrapper: `process_started`, `entered` (the function called) and
    `returned` are epoch seconds. The process's start up to the job's first lap is start-up (its part "process"
    up to the function, "setup" from there to the first lap); the function's time after its last lap is write-out."""
    process_s = max(0.0, entered - process_started)
    if wall is None or (wall.began_at is not None and wall.began_at < entered):  # none, or an earlier run's (stored)
        return Wall(startup_s=process_s, work_s=max(0.0, returned - entered), write_s=0.0,
                    parts={"process": round(process_s, 3)})
    began = wall.began_at if wall.began_at is not None else entered
    setup_s = max(0.0, began - entered)
    after_s = max(0.0, (returned - began) - wall.total_s)
    parts = {"process": process_s, **({"setup": setup_s} if setup_s else {}), **wall.parts}
    return Wall(startup_s=process_s + setup_s + wall.startup_s, work_s=wall.work_s, write_s=wall.write_s + after_s,
                parts={k: round(v, 3) for k, v in parts.items()})


def wall_of(result: dict[str, Any] | None) -> Wall | None:
    """The wall record of a job's stored result (its `wall`, or its training run's: RFT's result nests one); None
    for a job whose result has none (data jobs, results from before jobs recorded it)."""
    found = (result or {}).get("wall") or ((result or {}).get("train") or {}).get("wall")
    return Wall.model_validate(found) if found else None
