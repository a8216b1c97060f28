"""The lab's chat template, rendered in a bounded child before the agent process renders it (issue 44, item 7).

    problem = template_problem(chat.template_of(tokenizer), tokenizer.special_tokens_map)   # None: in bounds
    problem = tokenizer_template_problem(tokenizer)                                         # the same, ChatML exempt

A chat template is a program someone else wrote, and the agent process renders it (core/chat.py chat_format, the
training rows, the eval prompts): `{{ 'x' * 10**12 }}` raised a MemoryError traceback there, nested empty loops hung
it at 100% CPU with the lab's lock held, and a template that renders differently between calls (`lipsum()`, the
time, an object's address) passed the check once and failed a job later. So at load, before a session opens, the
template renders every conversation chat_format renders (core.chat.format_probes, each prefix of each, with and
without the generation prompt) and a few shapes of real conversations, in a child process under core.bounded's
limits: TEMPLATE_SECONDS of CPU, TEMPLATE_MEMORY beyond the child's libraries, TEMPLATE_OUTPUT_LIMIT characters a
rendering, streamed. Each is rendered twice and must render byte-identically (or raise the same error: a template's
own refusal is chat_format's to report). The child compiles as transformers compiles (its sandboxed environment,
`_compile_jinja_template`) and imports no torch: about 0.7 s, once per template and process (cached).
"""

from __future__ import annotations

import hashlib
import json
import sys

from core.bounded import limit_memory, run_bounded, streamed

TEMPLATE_SECONDS = 5  # of CPU: importing transformers' template module takes about 0.6, a real template's renders ms
TEMPLATE_WALL_SECONDS = 30  # the same on a loaded machine
TEMPLATE_MEMORY = 512 * 1024**2  # beyond the child's libraries; a real template's renderings take a few kB
TEMPLATE_OUTPUT_LIMIT = 1024**2  # characters of one rendering of a short conversation (real ones: a few hundred)
# Shapes of real conversations beside chat_format's probes: what training rows and eval prompts look like.
SHAPES: list[list[dict[str, str]]] = [
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Hi?"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And 3 + 3?"}],
    [{"role": "user", "content": "line one\nline two\n\n  indented\n"}, {"role": "assistant", "content": "\nok\n\n"}],
    [{"role": "user", "content": "Größe? 数字 — ½ 😀 naïve \u00e9\u0301"}],
    [{"role": "user", "content": "{{ messages }} {% if x %} <|im_end|> '\" \\"}],
]
_CHECKED: dict[str, str | None] = {}  # sha256 of (template, special tokens) -> its problem, this process


def template_problem(template: str, special_tokens: dict[str, str]) -> str | None:
    """Why the template cannot be rendered in the agent process (out of bounds, an error other than a template's
    own refusal, or not the same twice), or None. `special_tokens` are what apply_chat_template passes it (the
    tokenizer's special_tokens_map)."""
    job = json.dumps({"template": template, "special_tokens": special_tokens, "conversations": conversations()},
                     sort_keys=True)
    key = hashlib.sha256(job.encode()).hexdigest()
    if key not in _CHECKED:
        out = run_bounded("core.template_bounds", [], seconds=TEMPLATE_SECONDS, wall_seconds=TEMPLATE_WALL_SECONDS,
                          memory=TEMPLATE_MEMORY, stdin=job)
        _CHECKED[key] = (f"it did not render a short conversation in bounds: {out}" if isinstance(out, str)
                         else out["problem"])
    problem = _CHECKED[key]
    if problem is None:
        return None
    return (f"{problem}; expected a template that renders each short conversation in under {TEMPLATE_SECONDS} s of "
            f"CPU, {TEMPLATE_MEMORY // 1024**2} MiB and {TEMPLATE_OUTPUT_LIMIT} characters, the same every time")


def tokenizer_template_problem(tokenizer) -> str | None:
    """template_problem of the template chat_format would render for a loaded tokenizer (ChatML, the project's own
    default for a tokenizer without one, is not someone else's program)."""
    from core.chat import CHATML_TEMPLATE, template_of

    template = template_of(tokenizer)
    if template == CHATML_TEMPLATE:
        return None
    return template_problem(template, dict(tokenizer.special_tokens_map))


def conversations() -> list[list[dict[str, str]]]:
    """What the child renders: every prefix of chat_format's probes and of SHAPES."""
    from core.chat import format_probes

    whole = [*format_probes(), *SHAPES]
    return [c[:n] for c in whole for n in range(1, len(c) + 1)]


def render_problem(compiled, job: dict) -> str | None:
    """In the child: the first conversation the compiled template renders out of bounds, with an error that is not
    a template's own refusal (the agent process would raise it), or differently twice."""
    for messages in job["conversations"]:
        for generation in (False, True):
            first, second = (_outcome(compiled, messages, generation, job["special_tokens"]) for _ in range(2))
            turns = f"a conversation of {len(messages)} short turns (generation prompt {'on' if generation else 'off'})"
            if first is None or second is None:
                return f"it renders more than {TEMPLATE_OUTPUT_LIMIT} characters, or more memory, for {turns}"
            if first != second:
                return f"it renders {turns} differently on a second call (at character {_first_difference(first, second)})"
            if first[0] == "raises":
                return f"it raises {first[1]} for {turns}, not a template error (raise_exception)"
    return None


def _outcome(compiled, messages: list[dict], generation: bool, special_tokens: dict[str, str]) -> tuple[str, str] | None:
    """('text', the rendering), ('refuses' or 'raises', the exception's type), or None past the bounds."""
    import jinja2

    try:
        text = streamed(compiled, TEMPLATE_OUTPUT_LIMIT, **special_tokens, messages=messages, tools=None,
                        documents=None, add_generation_prompt=generation)
    except jinja2.TemplateError as err:  # the template's own refusal: chat_format names it; here it must repeat
        return ("refuses", type(err).__name__)
    except Exception as err:  # noqa: BLE001 - someone else's program: whatever it raises is its outcome, reported
        return ("raises", type(err).__name__)
    return None if text is None else ("text", text)


def _first_difference(first: tuple[str, str], second: tuple[str, str]) -> int:
    if first[0] != second[0]:
        return 0
    a, b = first[1], second[1]
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _child() -> dict:
    """The child's side: import, read the job, bound the memory, render."""
    import jinja2
    from transformers.utils.chat_template_utils import (
        _compile_jinja_template,  # transformers' sandbox, as it compiles
    )

    job = json.loads(sys.stdin.read())
    limit_memory(TEMPLATE_MEMORY)
    try:
        compiled = _compile_jinja_template(job["template"])
    except jinja2.TemplateError:
        return {"problem": None}  # does not compile: chat_format names the line
    return {"problem": render_problem(compiled, job)}


if __name__ == "__main__":  # the bounded child of template_problem: the job on stdin, one JSON line out
    print(json.dumps(_child()))
