"""The versions we tested are the versions a user gets (issue 38): `make test`, `make demo` and CI install
requirements/dev.txt (or runtime.txt) with hashes and without resolving, so the interpreter running this suite holds
exactly the lock's versions, and the lock sits inside pyproject.toml's ranges (the ones a library user's pip
resolves), so `make upgrade` moves within them."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)", re.M)


def locked(name: str) -> dict[str, str]:
    text = (REPO / "requirements" / name).read_text()
    return {canonicalize_name(n): v for n, v in PIN.findall(text)}


def test_every_pin_carries_its_hashes():
    for name in ("runtime.txt", "dev.txt", "gpu.txt"):
        blocks = re.split(r"\n(?=[A-Za-z0-9_.\-]+==)", (REPO / "requirements" / name).read_text())
        pins = [b for b in blocks if PIN.match(b)]
        assert pins, name
        assert all("--hash=sha256:" in b for b in pins), [b.split()[0] for b in pins if "--hash" not in b]


def test_the_dev_lock_holds_the_runtime_lock_at_the_same_versions():
    runtime, dev = locked("runtime.txt"), locked("dev.txt")
    assert {n: dev.get(n) for n in runtime} == runtime


def test_this_interpreter_holds_exactly_the_locked_versions():
    """What `pip freeze` of .venv says, package by package (run the suite through `make test`, which installs the
    lock, not from another environment)."""
    differ = {}
    for name, version in locked("dev.txt").items():
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found = None
        if found != version:
            differ[name] = (version, found)
    assert not differ, f"installed versions differ from requirements/dev.txt (locked, installed): {differ}"


def test_the_lock_lies_within_the_ranges_of_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"],
              *project["optional-dependencies"]["gpu"]]
    pins = locked("dev.txt") | locked("gpu.txt")
    outside = []
    for spec in map(Requirement, wanted):
        version = pins.get(canonicalize_name(spec.name))
        assert version is not None, f"{spec.name} is in pyproject.toml but not locked"
        if not spec.specifier.contains(Version(version), prereleases=True):
            outside.append(f"{spec.name}=={version} not in {spec.specifier}")
    assert not outside, outside


@pytest.mark.parametrize("package", ["transformers", "kernels"])
def test_the_lock_is_on_transformers_with_hub_kernels(package):
    """transformers 5.25 requires `kernels` and turns Hub kernels on by default: the lock is the release the loader's
    `use_kernels=False` and the jobs' USE_HUB_KERNELS=0 were made for (tests/test_hub_kernels.py)."""
    pins = locked("runtime.txt")
    assert package in pins
    if package == "transformers":
        assert Version(pins[package]) >= Version("5.25")
