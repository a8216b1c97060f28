"""The world build: deterministic, cached, self-checking, and an ordinary lab."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from agent.config import load_lab_config
from evals import bars
from tools.world import build as world
from tools.world.build import COMMIT, MANIFEST, SIZES, Manifest, cached, draw_pools

REPO = Path(__file__).resolve().parents[2]


def _manifest(lab: Path) -> Manifest:
    return Manifest.model_validate_json((lab / "world" / MANIFEST).read_text())


def test_the_world_is_an_ordinary_lab(toy_world):
    config = load_lab_config(toy_world)
    assert config.judge.kind == "oracle"
    assert config.executor.simulated_gpuh_per_device_s == world.cost.GPUH_PER_DEVICE_S
    assert config.budget.reserve_fraction == world.cost.RESERVE_FRACTION
    suites = {s.name: s.scorer for s in config.evals}
    assert suites == {"synthetic": "synthetic", "loops": "loops", "stop": "length_stop", "holdout": "judge",
                      "confirm": "judge"}
    assert bars.load(config.bars, suites).bar
    info = world.load_spec(toy_world)
    assert info.params > 0 and sum(info.votes.values()) > 0.9 * SIZES["test"].battles


def test_the_generated_feedback_passes_check_feedback(toy_world):
    feedback = toy_world / world.FEEDBACK
    done = subprocess.run([sys.executable, "run_agent.py", "check-feedback", str(feedback)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "multi-turn: 0 " not in done.stdout  # multi-turn battles are part of the world
    rows = [json.loads(line) for line in feedback.read_text().splitlines()]
    assert {r["vote"] for r in rows} >= {"own", "other"}


def test_the_cached_world_is_found_and_damage_is_detected(toy_world, tmp_path):
    assert cached(toy_world, 0, "test") is not None
    assert cached(toy_world, 1, "test") is None  # another seed is another world
    truncated = tmp_path / "truncated"
    shutil.copytree(toy_world, truncated)
    model = truncated / world.PARENT / "model.safetensors"
    model.write_bytes(model.read_bytes()[:1000])
    assert cached(truncated, 0, "test") is None
    edited = tmp_path / "edited"
    shutil.copytree(toy_world, edited)
    path = edited / "world" / MANIFEST
    path.write_text(path.read_text().replace('"seed": 0', '"seed": 0 '))
    assert cached(edited, 0, "test") is None
    uncommitted = tmp_path / "uncommitted"
    shutil.copytree(toy_world, uncommitted)
    (uncommitted / "world" / COMMIT).unlink()  # a build killed before its commit file
    assert cached(uncommitted, 0, "test") is None


def test_a_damaged_cache_is_rebuilt_to_the_same_files(toy_world, tmp_path):
    # One rebuild checks both: damage is not used, and the same seed gives the same bytes.
    lab = tmp_path / "lab"
    shutil.copytree(toy_world, lab)
    (lab / world.FEEDBACK).write_text("truncated")
    manifest, rebuilt = world.build(lab, seed=0, size="test")
    assert rebuilt
    assert manifest.files == _manifest(toy_world).files
    assert cached(lab, 0, "test") is not None
    assert not list(lab.glob(".world-build-*"))  # the staging directory is gone


def test_another_seed_draws_another_world():
    spec = SIZES["test"]
    a, b = draw_pools(0, spec), draw_pools(1, spec)
    for pool in ("synthetic", "loops", "battles", "stage1", "pretrain"):
        ids_a, ids_b = {t.id for t in getattr(a, pool)}, {t.id for t in getattr(b, pool)}
        # Independent draws from small task spaces may share a few prompts (short digit sums, one-word edits).
        assert len(ids_a & ids_b) <= 0.05 * len(ids_a), pool


def test_a_real_labs_config_is_never_overwritten(tmp_path):
    (tmp_path / "lab.toml").write_text("# a real lab\n")
    done = subprocess.run([sys.executable, "run_agent.py", "world", "build", "--lab", str(tmp_path), "--size", "test"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "refusing to overwrite" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "lab.toml").read_text() == "# a real lab\n"
    assert not (tmp_path / "world").exists()


def test_the_cli_reports_a_cached_world(toy_world):
    done = subprocess.run([sys.executable, "run_agent.py", "world", "build", "--lab", str(toy_world), "--size", "test"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "cached" in done.stdout, done.stderr
