"""The Hub guard's environment: `guarded_env(log)` puts this folder's sitecustomize.py on PYTHONPATH, so a process
started with it (and every process that one starts: an agent, its jobs, their zygote) refuses, and logs to `log`, any
call that would fetch or run code from the Hub. See sitecustomize.py."""

from __future__ import annotations

import os
from pathlib import Path

GUARD = Path(__file__).resolve().parent
REPO = GUARD.parents[1]


def guarded_env(log: Path, **extra: str) -> dict[str, str]:
    """This process's environment under the Hub guard, logging to `log` (USE_HUB_KERNELS unset: the project's own
    code must turn Hub kernels off, not the test's environment)."""
    env = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(GUARD), str(REPO), env.get("PYTHONPATH", "")) if p)
    return {**env, "POSTLAB_HUB_GUARD_LOG": str(log), **extra}
