"""What a resume accepts of an edited lab.toml (issue 43, item 7): a session stuck on a partition that cannot hold
its jobs is resumed after [executor] is fixed, the change recorded as a `reconfigure` decision (once); any other
change is refused as before, naming the sections that changed."""

from __future__ import annotations

from pathlib import Path

import pytest
from labkit import make_lab

from agent.config import load_lab_config
from agent.errors import SessionError
from agent.planners.playbook import PlaybookSettings
from agent.runner import accept_lab_changes, snapshot
from memory.notebook import Notebook
from tools.paths import LabPaths


def _edit(lab: Path, old: str, new: str) -> None:
    text = (lab / "lab.toml").read_text()
    assert old in text
    (lab / "lab.toml").write_text(text.replace(old, new))


def test_executor_changes_are_accepted_and_recorded_once_others_refused(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab").resolve()
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config=snapshot(load_lab_config(lab), "test", PlaybookSettings.named("test")))
        paths = LabPaths(root=lab)
        accept_lab_changes(nb, "s1", load_lab_config(lab), paths)  # unchanged: nothing recorded
        assert nb.decisions("s1", kind="reconfigure") == []
        _edit(lab, "time_limit_min = 10", "time_limit_min = 20")
        accept_lab_changes(nb, "s1", load_lab_config(lab), paths)
        accept_lab_changes(nb, "s1", load_lab_config(lab), paths)  # a second resume on the same settings: no repeat
        (decision,) = nb.decisions("s1", kind="reconfigure")
        assert decision.payload.section == "executor" and decision.rationale.endswith("[executor] settings: time_limit_min")
        assert (decision.payload.before["time_limit_min"], decision.payload.after["time_limit_min"]) == (10, 20)
        _edit(lab, "time_limit_min = 20", "time_limit_min = 30")
        accept_lab_changes(nb, "s1", load_lab_config(lab), paths)
        assert [d.payload.before["time_limit_min"] for d in nb.decisions("s1", kind="reconfigure")] == [10, 20]
        _edit(lab, "steps = 30", "steps = 31")
        with pytest.raises(SessionError, match=r"changed since session s1 started \(\[executor\], \[train\]\); resume accepts "
                                               r"changes to \[executor\] only"):
            accept_lab_changes(nb, "s1", load_lab_config(lab), paths)
        assert len(nb.decisions("s1", kind="reconfigure")) == 2 and nb.verify().ok


def test_a_chat_template_changed_since_the_session_opened_is_refused_at_resume(tmp_path: Path) -> None:
    """The session's rows, evals and bundle are rendered with the template it opened with (recorded in its open
    decision): a resume after the tokenizer's template was edited is refused, naming the tokenizer, nothing recorded
    (issue 44, item 7)."""
    from agent.runner import chat_template_ref

    lab = make_lab(tmp_path / "lab").resolve()
    config = load_lab_config(lab)
    tokenizer = config.model.tokenizer or config.model.parent or config.model.base
    with Notebook.open(lab / "notebook.db") as nb:
        nb.open_session("s1", lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.1, planner="playbook", executor="local",
                        config=snapshot(config, "test", PlaybookSettings.named("test")),
                        chat_template=chat_template_ref(tokenizer))
        assert accept_lab_changes(nb, "s1", config, LabPaths(root=lab)) is not None  # the same template: accepted
        _edit(lab, "time_limit_min = 10", "time_limit_min = 20")
        (tokenizer / "chat_template.jinja").write_text(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
        with pytest.raises(SessionError, match=r"the chat template changed since session s1 started \(sha256 "):
            accept_lab_changes(nb, "s1", load_lab_config(lab), LabPaths(root=lab))
        assert nb.decisions("s1", kind="reconfigure") == [] and nb.verify().ok
