"""No code from the Hub at load time (issue 38): transformers 5.25 turns Hub kernels on by default when the `kernels`
package is installed (the lock installs it, transformers requires it), downloading kernel code from the Hub and running
it inside the load. The loader turns them off (`use_kernels=False`, core/loading.py) and every job runs with
USE_HUB_KERNELS=0 (tools/jobs/jobrun.py).

These tests run child processes under the Hub guard (tests/hubguard/sitecustomize.py: every kernels entry point and Hub
download function raises and is logged). The guard is shown to catch a load that asks for Hub kernels, so its silence
over the project's loader, and over a whole session (the own lab's, tests/ownlab/test_own_lab.py), means something.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core import tiny
from tests.hubguard import REPO, guarded_env

LOAD = """
import sys
from core import loading
from transformers import AutoModelForCausalLM
path, how = sys.argv[1], sys.argv[2]
if how == "loader":
    model = loading.load_causal_lm(path)
else:  # what the loader did before issue 38: transformers' own default for use_kernels
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False, use_safetensors=True)
print(type(model).__name__)
"""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    return tiny.build_model("llama", tiny.build_tokenizer(root / "tokenizer"), root / "model", seed=0)


def _load(model: Path, how: str, log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD, str(model), how], cwd=REPO, env=guarded_env(log),
                          capture_output=True, text=True, timeout=300)


def test_the_guard_catches_a_load_that_asks_for_hub_kernels(tiny_llama, tmp_path):
    log = tmp_path / "hub.log"
    done = _load(tiny_llama, "transformers-default", log)
    assert done.returncode != 0 and "the Hub guard refused kernels.kernelize" in done.stderr, done.stderr[-2000:]
    assert log.read_text().split()[1] == "kernels.kernelize"


def test_the_loader_never_reaches_for_the_hub(tiny_llama, tmp_path):
    log = tmp_path / "hub.log"
    done = _load(tiny_llama, "loader", log)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "LlamaForCausalLM"
    assert not log.exists()
