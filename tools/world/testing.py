"""Test support: the `--size test` world, built once per pytest run.

Any test suite can share it:

    from tools.world.testing import session_world

    @pytest.fixture(scope="session")
    def toy_world(tmp_path_factory):
        return session_world(tmp_path_factory)

The world lives under the run's base temp directory, so every later call finds the cache (the manifest check takes
well under a second) instead of building again. Under pytest-xdist the workers share it: it is built under the
folder above the workers' own base temp directories, under a file lock, by whichever worker asks first, while the
others wait for it (each build is about a CPU-minute, and the workers share the machine's cores). Treat it as
read-only: copy it (`shutil.copytree`) before a test writes into the lab.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from tools.world.build import WorldTemplate, build

TEST_SEED = 0


def session_world(tmp_path_factory, template: WorldTemplate = "chatml") -> Path:
    """The lab directory of the test world (seed 0, size test, on the `template` chat template) for this pytest
    run."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: basetemp is <run>/popen-gwN, <run> is the whole run's
        base = base.parent
    name = "toy-world-test" if template == "chatml" else f"toy-world-test-{template}"
    lab = base / name
    with open(base / f"{name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        build(lab, seed=TEST_SEED, size="test", template=template)
    return lab
