"""Test support: the `--size test` world, built once per pytest session.

Any test suite can share it:

    from tools.world.testing import session_world

    @pytest.fixture(scope="session")
    def toy_world(tmp_path_factory):
        return session_world(tmp_path_factory)

The world lives under the session's base temp directory, so every later call in the session finds the
cache (the manifest check takes well under a second) instead of building again. Treat it as read-only:
copy it (`shutil.copytree`) before a test writes into the lab.
"""

from __future__ import annotations

from pathlib import Path

from tools.world.build import WorldTemplate, build

TEST_SEED = 0


def session_world(tmp_path_factory, template: WorldTemplate = "chatml") -> Path:
    """The lab directory of the test world (seed 0, size test, on the `template` chat template) for this pytest
    session."""
    lab = tmp_path_factory.getbasetemp() / ("toy-world-test" if template == "chatml" else f"toy-world-test-{template}")
    build(lab, seed=TEST_SEED, size="test", template=template)
    return lab
