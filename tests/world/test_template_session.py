"""A whole `--protocol test` session on a toy world built on the Llama-3 chat template (`world build --template
llama3`): it trains, evaluates and ships in that template, and ends in a checked nomination whose bundle ships it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core import chat, loading
from core.templates import LLAMA3
from memory.notebook import Notebook
from tests.hubguard import guarded_env
from tools.nomination.check_bundle import check_bundle
from tools.world.testing import session_world

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama3_session(tmp_path_factory) -> Path:
    world = session_world(tmp_path_factory, template="llama3")
    lab = tmp_path_factory.mktemp("llama3-session") / "lab"
    shutil.copytree(world / "world", lab / "world")
    shutil.copy(world / "lab.toml", lab / "lab.toml")
    # The budget is not under test (the toy world charges measured seconds x a factor; tests/test_decision_quality.py).
    # The whole session, its jobs and check-bundle's child included, runs under the Hub guard (tests/hubguard).
    proc = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "--budget", "5000gpuh", "--lab", str(lab),
                           "--session", "s1", "--protocol", "test"], cwd=REPO, capture_output=True, text=True,
                          timeout=1800, env=guarded_env(lab.parent / "hub.log"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (lab.parent / "agent.log").write_text(proc.stdout + proc.stderr)
    return lab


def test_no_load_of_the_session_reached_for_the_hub(llama3_session):
    """Every model job trained, evaluated, bundled and reloaded with the Hub guard in place, and none of them
    called a kernels entry point or a Hub download (the guard logs even a call its caller swallowed)."""
    with Notebook.open(llama3_session / "notebook.db", readonly=True) as nb:
        kinds = {job.kind for job in nb.jobs(session="s1") if job.state == "completed"}
    assert {"reference", "sft", "eval", "bundle"} <= kinds, kinds
    assert not (llama3_session.parent / "hub.log").exists(), (llama3_session.parent / "hub.log").read_text()


def test_no_deprecation_warning_from_the_sessions_calls(llama3_session):
    """No FutureWarning or DeprecationWarning in the agent's output or any job's log: a call transformers deprecates
    (`past_key_values` for `cache`, 5.25) is moved before the release that removes it breaks a session."""
    logs = [llama3_session.parent / "agent.log", *sorted((llama3_session / "jobs").rglob("*_log.*"))]
    assert len(logs) > 10
    warned = [f"{log.name}: {line.strip()}" for log in logs for line in log.read_text(errors="replace").splitlines()
              if "FutureWarning" in line or "DeprecationWarning" in line]
    assert not warned, "\n".join(warned[:10])


def test_the_world_is_built_on_the_llama3_template(llama3_session):
    for model in ("base", "parent"):
        tok = loading.load_tokenizer(llama3_session / "world" / "models" / model)
        fmt = chat.chat_format(tok)
        assert (fmt.template, fmt.eot_token) == (LLAMA3, "<|eot_id|>")


def test_the_session_nominates_a_checked_bundle_that_ships_the_llama3_template(llama3_session):
    with Notebook.open(llama3_session / "notebook.db", readonly=True) as nb:
        [opened] = nb.decisions("s1", kind="open")
        assert opened.payload.chat_template.source == "model"
        assert opened.payload.chat_template.eot_token == "<|eot_id|>"
        assert nb.decisions("s1", kind="nominate")
        [bundle] = nb.artifacts(kind="bundle", session="s1")
        bundle_dir = Path(bundle.path)
    assert (bundle_dir / "training_chat_template.jinja").read_text() == LLAMA3
    shipped = (bundle_dir / "chat_template.jinja").read_text()
    assert shipped.endswith(LLAMA3) and "<|start_header_id|>" in shipped and "<|im_start|>" not in shipped
    tok = loading.load_tokenizer(bundle_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    report = check_bundle(bundle_dir, notebook_path=llama3_session / "notebook.db")
    assert report.ok, report.failures()
    card = (bundle_dir / "README.md").read_text()
    assert "its base's own chat template" in card and "end of turn `<|eot_id|>`" in card
