"""check-bundle's template child takes its memory bound after its libraries are mapped: on the H200 (a CUDA build of
torch maps several GiB) a library first imported under the bound stopped every template check of the GPU session
(transformers 5.25 reaches torch, accelerate and `kernels` when it loads a tokenizer). So nothing the template checks
import may be left to import after `_import_libraries`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from core import tiny

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from core.bounded import limit_memory
from tools.nomination import check_bundle
check_bundle._import_libraries()
limit_memory(8 * 1024**3)
before = set(sys.modules)
from core import chat, loading
tok = loading.load_tokenizer(sys.argv[1])
chat.render_text(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
print(json.dumps(sorted({m.split(".")[0] for m in set(sys.modules) - before})))
"""


def test_the_template_checks_import_no_library_after_the_memory_bound(tmp_path):
    tok = tiny.build_tokenizer(tmp_path / "tokenizer")
    done = subprocess.run([sys.executable, "-c", CHILD, str(tok)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    late = set(json.loads(done.stdout.strip().splitlines()[-1])) & {"torch", "kernels", "accelerate", "minijinja",
                                                                  "tokenizers", "safetensors"}
    assert not late, f"imported after the bound: {sorted(late)}"
