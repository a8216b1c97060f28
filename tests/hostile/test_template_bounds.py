"""The lab's own chat template is someone else's program (issue 44, item 7): at load, before a session opens and
before the agent process renders it, it renders in a bounded child (core/template_bounds.py, on core/bounded.py's
machinery, check-bundle's too), twice, and must render identically. A template that asks for a terabyte (a
MemoryError traceback before), loops without end (a hang at 100% CPU with the lab's lock left behind), renders
differently between calls (passed once, failed a job later) or raises what is not a template error is refused:
exit 2, one message, nothing written. A real template passes in under a second of the child's CPU, once per
process."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from core.chat import CHATML_TEMPLATE
from core.template_bounds import TEMPLATE_OUTPUT_LIMIT, template_problem
from core.templates import FAMILY

sys.path.insert(0, str(Path(__file__).parent))
from hostile_kit import assert_refused, files, make_lab, run_cli  # noqa: E402

TURNS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
HANG = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}" + TURNS
TERABYTE = "{{ 'x' * 10**12 }}" + TURNS
HOSTILE = {
    "a terabyte in one expression": (TERABYTE, f"renders more than {TEMPLATE_OUTPUT_LIMIT} characters, or more memory"),
    "a loop that prints without end": ("{% for a in range(100000) %}{{ 'y' * 1000 }}{% endfor %}" + TURNS,
                                       f"renders more than {TEMPLATE_OUTPUT_LIMIT} characters"),
    "random text (lipsum)": (TURNS + "{{ lipsum(1) }}", "differently on a second call"),
    "the time to the microsecond": (TURNS + "{{ strftime_now('%S.%f') }}", "differently on a second call"),
    "an object's address": (TURNS + "{{ namespace() ~ joiner() }}", "differently on a second call"),
    "an error that is no template error": ("{% for i in range(10**9) %}{% endfor %}" + TURNS,
                                           "it raises OverflowError for a conversation of 1 short turns"),
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_template_is_refused_by_the_bounded_child(case):
    template, expected = HOSTILE[case]
    problem = template_problem(template, {"eos_token": "<|im_end|>"})
    assert problem is not None and expected in problem, problem
    assert "expected a template that renders each short conversation in under 5 s of CPU" in problem


def test_real_templates_pass_in_under_a_second_of_the_childs_cpu_once_per_process():
    specials = {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>"}
    for name in ("llama3", "nemotron"):
        family = FAMILY[name]
        before = _children_cpu()
        assert template_problem(family.template, specials) is None, name
        assert _children_cpu() - before < 1.5, (name, "the child imports no torch")  # ~0.8 s, slack for a loaded host
    assert template_problem(CHATML_TEMPLATE, specials) is None
    before = _children_cpu()
    assert template_problem(CHATML_TEMPLATE, specials) is None
    assert _children_cpu() == before  # the second call is the first's, cached: no child ran (a wall bound failed in a loaded full run)


def _tokenizer(directory: Path, template: str) -> Path:
    """A word-level tokenizer (built in milliseconds) whose chat template is `template`."""
    directory.mkdir(parents=True)
    words = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "pad_token": "<pad>",
        "eos_token": "<|im_end|>", "chat_template": template}))
    return directory


def test_the_cli_refuses_a_hanging_template_with_exit_2_and_leaves_nothing(tmp_path):
    """Before: the nested loops hung `run` at 100% CPU holding the lab's lock (the terabyte, a MemoryError traceback,
    takes the same path: the case above). Now it is refused before the lock is taken, the lab as it was."""
    lab = make_lab(tmp_path / "lab")
    _tokenizer(lab / "tok", HANG)
    toml = lab / "lab.toml"
    toml.write_text(toml.read_text().replace('parent = "models/parent"', 'parent = "models/parent"\ntokenizer = "tok"'))
    before = files(lab)
    (proc,) = run_cli([["--budget", "1gpuh", "--lab", str(lab), "--executor", "local", "--planner", "playbook"]])
    assert_refused(proc.returncode, proc.stderr, "no session was opened", "[model] tokenizer", "tok: chat template",
                   "stopped by its limits")
    assert files(lab) == before  # no lab.lock, no notebook
