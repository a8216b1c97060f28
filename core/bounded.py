"""Running someone else's program (a chat template) in a child process under bounds: CPU time, wall time, address
space, and what it may print. The agent process never renders a template it has not seen end in bounds here first.

    out = run_bounded("core.template_bounds", [], seconds=5, memory=512 * 1024**2, stdin=json.dumps(job))
    if isinstance(out, str): ...   # why there is no result: stopped by a limit, or the child failed
    # in the child, after importing what it needs:  limit_memory(memory); ...; print(json.dumps(result))

The child is `python -m MODULE ARGS...`: it reads its input from stdin, imports its libraries, then calls
limit_memory (what the libraries map differs by host: a CUDA build of torch maps several GiB of address space on
import), does its work and prints one JSON line last. CPU time is bounded before exec (RLIMIT_CPU), wall time by a
timeout (a loaded machine), memory by the child itself. The lab's chat template at load (core/template_bounds.py)
runs this way.

A child may do its work in phases, each under its own bounds, so that what it imported once serves them all
(check-bundle's template checks, then its reload: tools/nomination/check_bundle.py):

    outs = run_phases("tools.nomination.check_bundle", args, [Phase(20, 60, 3 * 1024**3), Phase(600, 600)])
    # in the child:  enter_phase(PHASES, 0); ...; print_phase(0, result); enter_phase(PHASES, 1); ...

Its RLIMIT_CPU is soft at the first phase's seconds and hard at the phases' sum; `enter_phase` moves the soft limits
(CPU up to the phases so far, memory to the phase's bound or the hard limit) once the phase before printed its line.
The work a phase runs cannot raise a limit itself: it is a template rendered in Jinja's sandbox, not Python.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.util import address_space

REPO = Path(__file__).resolve().parents[1]
# How a child marks the line that carries a phase's result (anything else it prints is passed over).
PHASE_KEY = "__phase__"
# The most bytes of stdout read from a child (its results are a few kB).
OUTPUT_LIMIT = 64 * 1024**2


@dataclass(frozen=True)
class Phase:
    """One phase's bounds: `seconds` of CPU, `wall_seconds` of wall time from the phase before's result (the first:
    from the start), and `memory` bytes of address space beyond the child's libraries (None: unbounded)."""

    seconds: int
    wall_seconds: int
    memory: int | None = None


def run_bounded(module: str, args: list[str], *, seconds: int, wall_seconds: int | None = None,
                memory: int | None = None, stdin: str | None = None) -> dict | str:
    """Runs `python -m MODULE ARGS` (from the repository root) under `seconds` of CPU and `wall_seconds` (default:
    `seconds`) of wall time; its last stdout line parsed as JSON, or why there is none. `memory` only names the
    bound in the reason: the child sets it itself (limit_memory) once its libraries are imported."""
    [out] = run_phases(module, args, [Phase(seconds, wall_seconds or seconds, memory)], stdin=stdin, marked=False)
    return out


def run_phases(module: str, args: list[str], phases: list[Phase], *, stdin: str | None = None,
               marked: bool = True, python: Sequence[str] | None = None) -> list[dict | str | None]:
    """Runs `python -m MODULE ARGS` through `phases`: per phase, the JSON object of its line (`print_phase`), why
    there is none (a limit stopped the child: every later phase then says the same), or None when the child ended
    cleanly before it (it had nothing more to do). `marked=False`: one phase, its result the last line printed.
    `python`: the command in place of this interpreter, one that keeps the limits set before exec (a caller's warm
    fork server, tools/jobs/zygote.py listening_prefix, whose child adopts them)."""
    hard = sum(p.seconds for p in phases)

    def limits() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (phases[0].seconds, hard))

    proc = subprocess.Popen([*(python or [sys.executable]), "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, preexec_fn=limits, cwd=REPO)
    try:
        try:
            proc.stdin.write((stdin or "").encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        return _read_phases(proc, phases, marked)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def _read_phases(proc: subprocess.Popen, phases: list[Phase], marked: bool) -> list[dict | str | None]:
    out: list[dict | str | None] = []
    lines: list[bytes] = []
    buffer, read, eof = b"", 0, False
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        for index, phase in enumerate(phases):
            deadline = time.monotonic() + phase.wall_seconds
            found: dict | None = None
            while marked and found is None and (lines or not eof):
                if lines:
                    found = _phase_line(lines.pop(0), index)
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return out + [f"stopped after {phase.wall_seconds} s"] * (len(phases) - index)
                chunk = os.read(proc.stdout.fileno(), 65536)
                read += len(chunk)
                if read > OUTPUT_LIMIT:
                    return out + [f"stopped after printing more than {OUTPUT_LIMIT // 1024**2} MiB"] * (
                        len(phases) - index)
                eof = not chunk
                *complete, buffer = (buffer + chunk).split(b"\n")
                lines += complete + ([buffer] if eof and buffer else [])
            while not marked and not eof:  # one phase: everything up to the end, its last line the result
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return [f"stopped after {phase.wall_seconds} s"]
                chunk = os.read(proc.stdout.fileno(), 65536)
                buffer, eof = buffer + chunk, not chunk
                if len(buffer) > OUTPUT_LIMIT:
                    return [f"stopped after printing more than {OUTPUT_LIMIT // 1024**2} MiB"]
            if found is None:  # the child closed its output: it ended, cleanly or stopped by a limit
                try:
                    returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return out + [f"stopped after {phase.wall_seconds} s"] * (len(phases) - index)
                if returncode != 0:
                    return out + [_stopped(phase)] * (len(phases) - index)
                if not marked:
                    return [_last_line(buffer.splitlines()) or _stopped(phase)]
                return out + [None] * (len(phases) - index)
            out.append(found)
    return out


def _phase_line(line: bytes, index: int) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) and value.pop(PHASE_KEY, None) == index else None


def _last_line(lines: list[bytes]) -> dict | None:
    texts = [line for line in lines if line.strip()]
    try:
        value = json.loads(texts[-1]) if texts else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _stopped(phase: Phase) -> str:
    limit = f"{phase.memory // 1024**2} MiB of memory beyond its libraries or " if phase.memory else ""
    return f"stopped by its limits ({limit}{phase.seconds} s of CPU)"


def enter_phase(phases: list[Phase], index: int) -> None:
    """In the child: the bounds of phase `index` (its libraries imported). CPU: soft at the phases so far; memory:
    the phase's bound beyond what is mapped now, or the hard limit."""
    cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (sum(p.seconds for p in phases[:index + 1]), cpu_hard))
    memory = phases[index].memory
    if memory:
        limit_memory(memory)
    else:
        resource.setrlimit(resource.RLIMIT_AS, (resource.getrlimit(resource.RLIMIT_AS)[1],) * 2)


def print_phase(index: int, result: dict) -> None:
    """In the child: phase `index`'s result, as the one line the parent reads for it."""
    print(json.dumps({PHASE_KEY: index, **result}), flush=True)


def limit_memory(memory: int) -> None:
    """In the child: at most `memory` bytes of address space beyond what it maps now (import its libraries first)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (address_space() + memory, hard))


def streamed(compiled, limit: int, **context) -> str | None:
    """A compiled Jinja template's rendering, streamed and stopped once past `limit` characters (None then, and
    None when one expression is too big to build, as `'x' * 10**12` is). The template's own errors propagate."""
    chunks, n = [], 0
    try:
        for chunk in compiled.generate(**context):
            chunks.append(chunk)
            n += len(chunk)
            if n > limit:
                return None
    except MemoryError:
        return None
    return "".join(chunks)
