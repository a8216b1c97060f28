"""A lab's chat template before its session opens: one that cannot be masked is refused with the reason (exit 2,
no notebook); a tokenizer with none gets ChatML, and the session's `open` decision and the model card say so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from labkit import make_lab

from agent.runner import chat_template_ref
from core import chat
from core.util import sha256_text
from memory.notebook import Notebook
from tools.nomination import card

REPO = Path(__file__).resolve().parents[2]
# Numbers each turn from the end of the conversation: a conversation's first turns render differently once more
# turns follow, and there are no {% generation %} markers.
UNMASKABLE = ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + ' '"
              " + (messages | length - loop.index0) | string + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
              "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def _set_template(tokenizer_dir: Path, template: str | None) -> None:
    """The template as a user's tokenizer directory holds it (tokenizer_config.json and chat_template.jinja)."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    (tokenizer_dir / "chat_template.jinja").unlink(missing_ok=True)
    if template is not None:
        (tokenizer_dir / "chat_template.jinja").write_text(template)
    config_path.write_text(json.dumps(config))


def test_a_template_that_cannot_be_masked_is_refused_before_the_session_opens(tmp_path):
    lab = make_lab(tmp_path / "lab")
    _set_template(lab / "tokenizer", UNMASKABLE)
    proc = subprocess.run([sys.executable, str(REPO / "run_agent.py"), "--budget", "1gpuh", "--lab", str(lab),
                           "--session", "s1", "--protocol", "test", "--quiet"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{lab / 'tokenizer'}: chat template: " in proc.stderr
    assert "no {% generation %} markers: assistant tokens cannot be masked; no session was opened" in proc.stderr
    assert not (lab / "notebook.db").exists()


def test_a_tokenizer_without_a_template_gets_chatml_and_the_open_decision_and_card_say_so(tmp_path):
    lab = make_lab(tmp_path / "lab")
    _set_template(lab / "tokenizer", None)
    ref = chat_template_ref(lab / "tokenizer")
    assert ref.source == "chatml-default" and ref.sha256 == sha256_text(chat.CHATML_TEMPLATE)
    assert ref.eot_token == "<|im_end|>" and ref.masking == "prefix" and ref.system_turns == "native"
    with Notebook.open(tmp_path / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config={}, chat_template=ref)
        [opened] = nb.decisions("s1", kind="open")
        assert opened.rationale == "session opened; the tokenizer has no chat template of its own, so ChatML is used"
        assert opened.payload.chat_template == ref
        assert nb.verify().ok
    line = card._chat_template_line(ref)
    assert "ChatML, because its base tokenizer has no chat template of its own" in line and ref.sha256 in line


def test_a_tokenizer_with_its_own_template_is_recorded_as_such(tmp_path):
    lab = make_lab(tmp_path / "lab")
    ref = chat_template_ref(lab / "tokenizer")
    assert ref.source == "model" and ref.stop_token_ids == [3]
    line = card._chat_template_line(ref)
    assert "its base's own chat template" in line and "`<|im_end|>`, token id 3" in line
