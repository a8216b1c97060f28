"""A session's inputs, checked before it opens (DESIGN.md section 8): nothing is half-started.

`lab.toml` loading (agent/config.py) checks that every path is the right kind of thing; this reads
the files themselves, all of them, and collects every problem before `run` writes a notebook row:

- the feedback file passes `check-feedback` (every line valid, at least one battle);
- the bars file loads, and each bar names a suite of the lab and a metric its scorer writes;
- every eval suite file parses as eval items with unique ids and the fields its scorer reads
  (math/synthetic: gold; mcq: gold and choices; constraints: constraints; battle_margin and
  reward_proxy: the recorded battle), synthetic ids name their family and an MCQ gold is one of
  its option letters;
- every data source parses as chat rows (the replay-mix builder's own reader), or, a verified pool, as eval items
  its verifier suite's scorer can check.

    problems = check_inputs(load_lab_config(lab_dir))     # [] when the session may open
    require_inputs(cfg, lab_dir / "lab.toml")              # LabConfigError listing them all
    require_inputs(cfg, lab_file, os.environ, planner)     # and the API key variables and the pad token
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import ValidationError

from agent.config import LabConfig, LabConfigError
from agent.train_settings import train_problems
from core.jsonl import JSONLError, read_lines
from evals import bars, synthetic
from evals.types import Item
from tools.data.datasets import DatasetError, read_chat_rows
from tools.data.feedback import (
    MAX_LISTED,
    FeedbackError,
    control_pattern,
    control_warning,
    load_feedback,
    summarize,
    tokenizer_controls,
)
from tools.data.leak import DEFAULT_NGRAM, Reference, audit, prompt_text
from tools.data.splits import SplitConfig, max_unit, oversized_groups, split_file, split_problems
from tools.jobs.executor import host_memory_gb, local_gpus, local_problems

# Item fields each scorer reads besides the conversation (evals/<scorer>.py).
SCORER_NEEDS: dict[str, tuple[str, ...]] = {
    "math": ("gold",), "synthetic": ("gold",), "mcq": ("gold", "choices"), "constraints": ("constraints",),
    "battle_margin": ("battle",), "reward_proxy": ("battle",),
}


def check_inputs(cfg: LabConfig) -> list[str]:
    """Every problem of every input file, each naming its file (and line or bar); [] when all are sound."""
    problems = _feedback(cfg.feedback.file)
    if not problems:
        problems += feedback_split_problems(cfg)
    if cfg.bars is not None:  # a reward-model judge scores the judge suites as reward_proxy suites (agent/runner.py)
        judged_by = "reward_proxy" if cfg.judge.kind == "reward_model" else "judge"
        problems += _bars(cfg.bars, {s.name: judged_by if s.scorer == "judge" else s.scorer for s in cfg.evals})
    for suite in cfg.evals:
        if suite.file is not None:
            problems += suite_problems(suite.file, suite.scorer)
    if not problems:  # lengths only of files that parse
        problems += length_problems(cfg)
    scorers = {s.name: s.scorer for s in cfg.evals}
    for source in cfg.data:
        if source.kind == "verified":  # eval items its verifier's scorer can check, like a suite of that scorer
            problems += [f"data {source.name!r}: {p}" for p in suite_problems(source.path, scorers[source.verifier])]
            continue
        try:
            read_chat_rows(source.path)
        except (DatasetError, OSError) as e:
            problems.append(f"data {source.name!r}: {e}")
    return problems


def length_problems(cfg: LabConfig) -> list[str]:
    """Prompts that cannot be answered within the model's context: an eval item's, or a feedback battle's
    (the dev battles are prompts of the holdout scorers), whose tokens plus the served max_new_tokens exceed
    the context the model's config.json states (max_position_embeddings). Refused, never truncated: a
    truncated prompt asks another question. Training rows are cut by [train] max_len (trainers/), not here.

    Counted with the model's tokenizer.json over the messages' contents, plus TEMPLATE_TOKENS per message
    for the chat template's own tokens; work per text is bounded (CHARS_PER_TOKEN). No bound when the
    config states no context (a model directory without one is checked when it loads)."""
    found = _context(cfg)
    if found is None:
        return []
    context, source, tokenizer_file = found
    budget = context - cfg.serving.decoding.max_new_tokens
    count = _counter(tokenizer_file, context)
    rule = (f"exceeds the model's context of {context} tokens ({source}: max_position_embeddings) less the served "
            f"max_new_tokens {cfg.serving.decoding.max_new_tokens}")
    problems = []
    for suite in cfg.evals:
        if suite.file is None:
            continue
        for line in read_lines(suite.file):
            item = Item.model_validate(line.value)
            n = count([m.content for m in item.messages])
            if n > budget:
                problems.append(f"eval suite: {suite.file}:{line.number}: item {item.id!r}: prompt of "
                                f"{_tokens(n, context)} {rule}")
    for battle in load_feedback(cfg.feedback.file).battles:
        n = count([m.content for m in battle.messages])
        if n > budget:
            problems.append(f"feedback: {cfg.feedback.file}: battle {battle.id!r}: prompt of "
                            f"{_tokens(n, context)} {rule}")
    return problems[:MAX_LISTED] + ([f"... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else [])


# The chat template's own tokens per message (role markers, end of turn), counted on top of the contents.
TEMPLATE_TOKENS = 8
# Work bound: a text is tokenized up to CHARS_PER_TOKEN characters per token of context; one longer than
# that is over the context whatever its tokens (no tokenizer's tokens average that many characters).
CHARS_PER_TOKEN = 64


def _tokens(n: int, context: int) -> str:
    return f"more than {context} tokens" if n > context else f"{n} tokens"


def _context(cfg: LabConfig) -> tuple[int, Path, Path] | None:
    """(context tokens, the config.json stating it, the tokenizer.json) of the model the session starts from."""
    model = cfg.model.parent or cfg.model.base
    try:
        context = json.loads((model / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    tokenizer = next((d / "tokenizer.json" for d in (cfg.model.tokenizer, model, cfg.model.base)
                      if d is not None and (d / "tokenizer.json").is_file()), None)
    if not isinstance(context, int) or context <= 0 or tokenizer is None:
        return None
    return context, model / "config.json", tokenizer


def battle_tokens(cfg: LabConfig) -> list[tuple[int, int]]:
    """(prompt, answer) tokens of each feedback battle, counted as length_problems counts a prompt; the answer is the
    longer of own and other with its turn's template tokens (DPO trains both, SFT the preferred one). [] when the
    model states no context."""
    found = _context(cfg)
    if found is None:
        return []
    count = _counter(found[2], found[0])
    return [(count([m.content for m in b.messages]), max(count([b.own]), count([b.other])))
            for b in load_feedback(cfg.feedback.file).battles]


def _counter(tokenizer_file: Path, context: int) -> Callable[[list[str]], int]:
    """Tokens of a conversation's contents (plus the template's), or context + 1 as soon as it is over."""
    from tokenizers import Tokenizer  # here: only a lab whose model states a context needs it

    tok, limit = Tokenizer.from_file(str(tokenizer_file)), context * CHARS_PER_TOKEN

    def count(contents: list[str]) -> int:
        if sum(len(c) for c in contents) > limit:
            return context + 1
        return sum(len(e.ids) for e in tok.encode_batch(contents, add_special_tokens=False)) + TEMPLATE_TOKENS * len(contents)

    return count


def runtime_problems(cfg: LabConfig, env: Mapping[str, str], planner: str, executor: str = "local") -> list[str]:
    """What a session would otherwise find only at its first job (issue 43, items 4 and 7): an API key variable the
    lab names for an endpoint it uses that is unset or empty (the judge's; the planner's when `planner` is openai),
    a model directory without weights (a session on one failed at its first job with a traceback), a tokenizer
    without a pad token or with a chat template that does not render in bounds, and job resources no node can give: on Slurm (`executor`), those no node of the
    partition has, or a time limit past the partition's (such a job would pend forever); on the local executor, GPUs
    or memory this host lacks.

    A tokenizer without one is refused, not patched (Meta's Llama-3 tokenizers ship so): generation pads prompts on
    the left and the trainers pad batches, and the usual patch, the end-of-sequence token as pad, makes padding and
    the answer's end the same id, so anything that masks padding by id masks the stop the model must learn, and a
    bundle saved with it ships a pad the model was not trained with. The team chooses a token the model never
    emits (Llama-3.1 reserves `<|finetune_right_pad_id|>`) and names it as `pad_token` in tokenizer_config.json."""
    problems = []
    endpoints = [("judge", cfg.judge.api_key_env, cfg.judge.kind == "openai"),
                 ("planner", cfg.planner.api_key_env, planner == "openai")]
    for section, name, used in endpoints:
        if used and not env.get(name):
            problems.append(f"[{section}] api_key_env: the environment variable {name} is not set (or empty); "
                            f"the {section} endpoint's API key is read from it: export {name}=...")
    for key, model in (("base", cfg.model.base), ("parent", cfg.model.parent)):
        if model is not None and not any(model.glob("*.safetensors")):  # its config then describes no parameters
            problems.append(f"[model] {key} {model}: holds no safetensors weights; expected the model's weights "
                            "(model.safetensors, or shards and their index) beside its config.json")
    tokenizer_dir = cfg.model.tokenizer or cfg.model.parent or cfg.model.base
    problems += _tokenizer_problems(tokenizer_dir)
    if executor == "slurm" and cfg.executor.slurm is not None:
        from tools.jobs.launcher import slurm_problems  # here: `check-feedback` imports this module, fast

        problems += slurm_problems(cfg.executor.model_copy(update={"kind": "slurm"}))
    if executor == "local":
        problems += local_problems(cfg.executor, local_gpus(env), host_memory_gb())
    return problems + train_problems(cfg, env, executor, battle_tokens(cfg))  # [train] against the parent, the data


def _tokenizer_problems(tokenizer_dir: Path) -> list[str]:
    """A tokenizer with no pad token, and a chat template that does not render in bounds, the same twice, in a
    bounded child (core/template_bounds.py; before the agent process renders it: agent/runner.py chat_template_ref).
    A tokenizer that does not load is refused later, by chat_template_ref, with its own message."""
    from core import loading  # transformers: only `run` of a configured lab needs it
    from core.template_bounds import tokenizer_template_problem

    try:
        tokenizer = loading.load_tokenizer(tokenizer_dir)
    except (OSError, ValueError):
        return []
    problems = []
    if tokenizer.pad_token_id is None:
        problems.append(f"[model] tokenizer {tokenizer_dir}: the tokenizer has no pad token (generation and training "
                        "pad with it); set `pad_token` in its tokenizer_config.json to a token the model never emits "
                        "(Llama-3.1: <|finetune_right_pad_id|>), not the end-of-sequence token")
    template = tokenizer_template_problem(tokenizer)
    if template is not None:
        problems.append(f"[model] tokenizer {tokenizer_dir}: chat template: {template}")
    return problems


def require_inputs(cfg: LabConfig, lab_file: Path, env: Mapping[str, str] | None = None,
                   planner: str = "playbook", executor: str = "local") -> None:
    """LabConfigError (exit 2 at the CLI) listing every input problem; nothing has been written yet. With `env`
    (the process's environment), also what the session's first jobs need of it and of the tokenizer."""
    problems = check_inputs(cfg)
    if env is not None and not problems:  # the tokenizer is loaded only for a lab whose files check out
        problems = runtime_problems(cfg, env, planner, executor)
    if problems:
        body = "\n".join("  " + p.replace("\n", "\n  ") for p in problems)
        raise LabConfigError(f"{lab_file}: {len(problems)} input file(s) do not check out; no session was opened:\n{body}")


def feedback_notes(cfg: LabConfig) -> list[str]:
    """What the run says about the feedback before the session opens (notes, not refusals): groups of colliding
    prompts too large to keep together (split battle by battle), and battles that copy eval prompts."""
    battles = load_feedback(cfg.feedback.file).battles
    notes = [f"feedback: {size} battles share prompts or {DEFAULT_NGRAM}-word runs with battle {first!r} (more than the "
             f"bound of {max_unit(len(battles))}): they are split one by one, and the leak audit drops training rows "
             "that overlap a holdout" for first, size in oversized_groups(battles)[:MAX_LISTED]]
    overlap = feedback_overlap(cfg)
    return [*notes, overlap] if overlap else notes


def lab_controls(cfg: LabConfig) -> list[str]:
    """The special tokens of the lab's tokenizer (tools/data/feedback.py tokenizer_controls): check-feedback --lab and
    run report battles carrying them besides the fixed control patterns."""
    return tokenizer_controls(cfg.model.tokenizer or cfg.model.parent or cfg.model.base)


def feedback_control_warning(cfg: LabConfig) -> str | None:
    """check-feedback --lab's warning line about battles carrying control strings (counts and lines, never the text),
    for `run` to print before the session opens; None when none carries one."""
    parsed = load_feedback(cfg.feedback.file)
    return control_warning(parsed, summarize(parsed, control_pattern(lab_controls(cfg))))


def feedback_split_problems(cfg: LabConfig) -> list[str]:
    """The split the session's ingest would make of the feedback, refused when empty or skewed (tools/data/splits.py)."""
    return [f"feedback: {cfg.feedback.file}: {p}" for p in split_problems(split_file(cfg.feedback.file, _split_config(cfg))[1])]


def _split_config(cfg: LabConfig) -> SplitConfig:
    return SplitConfig(dev_fraction=cfg.feedback.dev_fraction, sealed_fraction=cfg.feedback.sealed_fraction,
                       stratify_by=cfg.feedback.stratify_by, reserve_fraction=cfg.feedback.reserve_fraction)


def feedback_overlap(cfg: LabConfig) -> str | None:
    """A note (not a refusal) naming the battles whose prompts overlap an eval suite's prompts, read before the
    session opens: every dataset built from them drops those rows (tools/data/datasets.py) and records them in
    its manifest. None when there are none. Ids are shown escaped (repr): they are the public's text."""
    refs = [Reference(source=f"eval:{suite.name}", key=item.id, text=prompt_text([m.model_dump() for m in item.messages]))
            for suite in cfg.evals if suite.file is not None
            for item in (Item.model_validate(line.value) for line in read_lines(suite.file))]
    battles = load_feedback(cfg.feedback.file).battles
    hits = audit([b.prompt() for b in battles], refs, ids=[b.id for b in battles]).hits
    if not hits:
        return None
    shown = ", ".join(repr(h.row_id) for h in hits[:MAX_LISTED]) + (f" and {len(hits) - MAX_LISTED} more" if len(hits) > MAX_LISTED else "")
    return (f"feedback: {len(hits)} battle(s) have prompts that overlap eval prompts ({shown}); every training set "
            "built from the feedback drops them and records them in its manifest")


def _feedback(path: Path) -> list[str]:
    try:
        load_feedback(path)
    except FeedbackError as e:
        return [f"feedback: {e}"]
    return []


def _bars(path: Path, suites: dict[str, str]) -> list[str]:
    try:
        bars.load(path, suites)
    except bars.BarsError as e:
        return [f"bars: {e}"]
    return []


def suite_problems(path: Path, scorer: str) -> list[str]:
    """Problems of one eval suite file for `scorer`: bad lines, repeated ids, missing fields; [] if sound."""
    try:
        lines = read_lines(path)
    except JSONLError as e:
        return [f"eval suite: {e}"]
    found, seen = [], {}
    for number, value, problem in lines:
        if problem is None:
            problem = _item_problem(value, scorer, number, seen)
        if problem is not None:
            found.append(f"line {number}: {problem}")
    if not lines:
        found.append("the file holds no items")
    if not found:
        return []
    more = [f"... and {len(found) - MAX_LISTED} more"] if len(found) > MAX_LISTED else []
    return [f"eval suite: {path}: {len(found)} problem(s):\n" + "\n".join(f"  {p}" for p in found[:MAX_LISTED] + more)]


def _item_problem(value: object, scorer: str, number: int, seen: dict[str, int]) -> str | None:
    try:
        item = Item.model_validate(value)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "-"
        return f"{where}: {err['msg'].removeprefix('Value error, ')} (expected an eval item)"
    if item.id in seen:
        return f"id: duplicate item id {item.id!r} (first on line {seen[item.id]})"
    seen[item.id] = number
    missing = [field for field in SCORER_NEEDS.get(scorer, ()) if not getattr(item, field)]
    if missing:
        return f"item {item.id!r} has no {', '.join(missing)} (scorer {scorer} needs it)"
    return _scorer_specific(item, scorer)


def _scorer_specific(item: Item, scorer: str) -> str | None:
    """What a scorer would otherwise only find mid-job: a synthetic id without its family, an MCQ gold
    that is no option letter."""
    if scorer == "synthetic":
        try:
            synthetic.family_of(item.id)
        except ValueError as e:
            return f"id: {e} (the synthetic scorer reads the family from the id)"
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(item.choices)]
    if scorer == "mcq" and item.gold.strip().upper() not in letters:
        return f"gold: {item.gold!r} is not one of the option letters {', '.join(letters)}"
    return None
