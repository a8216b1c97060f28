"""Running someone else's program (a chat template) in a child process under bounds: CPU time, wall time, address
space, and what it may print. The agent process never renders a template it has not seen end in bounds here first.

    out = run_bounded("core.template_bounds", [], seconds=5, memory=512 * 1024**2, stdin=json.dumps(job))
    if isinstance(out, str): ...   # why there is no result: stopped by a limit, or the child failed
    # in the child, after importing what it needs:  limit_memory(memory); ...; print(json.dumps(result))

The child is `python -m MODULE ARGS...`: it reads its input from stdin, imports its libraries, then calls
limit_memory (what the libraries map differs by host: a CUDA build of torch maps several GiB of address space on
import), does its work and prints one JSON line last. CPU time is bounded before exec (RLIMIT_CPU), wall time by a
timeout (a loaded machine), memory by the child itself. check-bundle's template and reload checks
(tools/nomination/check_bundle.py) and the lab's chat template at load (core/template_bounds.py) run this way.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

from core.util import address_space

REPO = Path(__file__).resolve().parents[1]


def run_bounded(module: str, args: list[str], *, seconds: int, wall_seconds: int | None = None,
                memory: int | None = None, stdin: str | None = None) -> dict | str:
    """Runs `python -m MODULE ARGS` (from the repository root) under `seconds` of CPU and `wall_seconds` (default:
    `seconds`) of wall time; its last stdout line parsed as JSON, or why there is none. `memory` only names the
    bound in the reason: the child sets it itself (limit_memory) once its libraries are imported."""
    def limits() -> None:  # in the child, before exec
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))

    try:
        done = subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, text=True,
                              timeout=wall_seconds or seconds, preexec_fn=limits, cwd=REPO)
    except subprocess.TimeoutExpired:
        return f"stopped after {wall_seconds or seconds} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        limit = f"{memory // 1024**2} MiB of memory beyond its libraries or " if memory else ""
        return f"stopped by its limits ({limit}{seconds} s of CPU)"
    return json.loads(lines[-1])


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
