"""Fixtures of the toy-world tests: the `--size test` world, built once per test session."""

from pathlib import Path

import pytest

from tools.world.testing import session_world


@pytest.fixture(scope="session")
def toy_world(tmp_path_factory) -> Path:
    """The test world's lab directory (read-only: copy it before writing)."""
    return session_world(tmp_path_factory)
