"""check-bundle: a serving bundle is nominated only if it loads and serves the way it was measured.

    report = check_bundle(Path("lab/bundles/s1"), notebook_path=Path("lab/notebook.db"))
    report.ok, [r.messages for r in report.results if r.status == "failed"]

Command (exit 0 when every check passes, 1 when any fails, 2 when DIR is not a directory):

    python run_agent.py check-bundle DIR [--lab LAB]

A bundle is someone else's data, never code: before anything is read, `files` refuses a symbolic link, a FIFO, a
device, a socket or a hard link (a file with another name, which may lie outside the bundle), Python files, an
`auto_map`, pickled weights, oversized tokenizer files and malformed safetensors headers (core/loading.py), and
every name in serving_config.json and the shard index must be a plain file name of the bundle; every load pins
trust_remote_code=False and reads safetensors only. The text, JSON and hashed files check-bundle reads itself are
opened as core.util.open_regular opens them (no link followed, no FIFO waited on, the type checked on the
descriptor, so what was checked is what is read) and read with a bound: text and JSON files by their limits, the
manifest's files by SERVED_FILE_LIMIT; a shard is hashed only once its size is the recorded one and the one its
safetensors header describes, every tensor's bytes its dtype and shape. Every check is bounded: the ones that render
the template run in a child process under a time and memory limit, after `template_bounds` streamed each rendering
under TEMPLATE_OUTPUT_LIMIT; the reload runs next in the same child (its libraries imported once) under its own
timeout and no memory bound, at most RELOAD_MAX_NEW_TOKENS tokens and RELOAD_SECONDS_PER_ANSWER seconds an answer. Messages are printed escaped and bounded (core/display.py).

Checks, each reported with what was expected:
- files: every file a server reads is present, and the bundle is confined (above);
- integrity: every file a server reads besides the weights has the size and sha256 serving_config.json
  records (`files`, format 2), and no other file lies in the bundle;
- permissions: every file grants the read bits of the session's shipped mode (0644, readable by a server running
  as another user, unless the lab's `[nomination] file_mode` says otherwise; read from the notebook when one is
  given) and the directory their search bits, so the check does not pass only because it runs as the owner;
- serving_config: `serving_config.json` parses (tools.nomination.bundle.ServingConfig);
- template_compiles: `chat_template.jinja` compiles in the Jinja environment transformers itself
  builds (`transformers.utils.chat_template_utils.render_jinja_template`: sandboxed, with its
  `raise_exception` / `strftime_now` globals and its extensions), so `{% raise_exception(...) %}`
  in statement form (an unknown tag) is caught here, not in production;
- template_matches_renderer: it renders byte-identically to the training renderer (`core.chat.render_text`
  with the template training used, `training_chat_template.jinja`: the model's own, or ChatML) under the
  served system prompt for the conversation shapes of `SHAPES`, add_generation_prompt on and off;
- template_minijinja: it renders the same in minijinja, the Rust engine of TGI and other servers, set up as they
  set it up (trim_blocks, lstrip_blocks, a `raise_exception` function, the tokenizer's special tokens), as in
  transformers' Jinja2 (so, with template_matches_renderer, as the training renderer);
- tokenizer_template: the template in `tokenizer_config.json` and the one AutoTokenizer loads are
  that same file;
- system_prompt, generation_config, stop_ids, max_input_tokens: the system prompt file is non-empty
  and is the served one; generation_config.json carries the served decoding (whose fingerprint is
  the recorded one), its stop ids followed by every other `eos_token_id` the model's own configs name
  (`bundle.generation_stop_ids`; config.json's, of the bundle or the adapter's base, among them); every stop id is in
  the vocabulary and the end-of-turn token (derived from the chat template) is one of them; max input tokens is positive;
- weights: every shard the index names exists with its recorded size and sha256, every tensor of
  every shard is in the index (an unindexed tensor would silently load as random weights), no
  safetensors file lies outside the index; for adapters the adapter file's size and sha256;
- adapter_base: the adapter's base is the recorded base path, and its weights hash is the recorded
  revision;
- decision_hash: with a notebook, the evidence's last decision is in its chain;
- reload: loaded as a server loads it (AutoTokenizer; AutoModelForCausalLM, or base + PeftModel;
  the generation config from its file), it answers the measured stop rate's probes (below) at the served
  decoding; every answer is non-empty and has no U+FFFD, and the answers stop on a stop id as often as the
  nominee was measured to stop.

How many unstopped answers the reload may show. The nominee's served evals at the bundle's decoding
that scored `stopped` (a `length_stop` suite; every replicate pooled: read from the notebook when one
is given, else as the bundle's `training_evidence.json` recorded them) give its measured miss rate
q, smoothed to (misses + 1) / (answers + 2) so that a clean measurement still allows a little; the reload fails
when its misses are that unlikely, P(X >= misses | len(PROMPTS), q) < `STOP_ALPHA`. So a server
that never stops (wrong stop ids: 5 misses of 5) fails for any nominee measured to stop more than
6 times in 10 (the bars judge the rate itself), a model measured to stop always fails on two
misses, and a sampled model measured to run out of tokens one time in ten is not refused on one
unlucky draw, which would be a verdict no bar made. With no measured rate (an older bundle, or a
nominee no suite scored for stops) every answer must stop.

The rate holds for the prompts it was measured on, so with a notebook the reload answers those: up to five items
of the measured suites (`bundle.stop_probes`: chosen by a hash of their item ids, unsealed suites only, read from
the lab's items files; a bundle never carries eval items). A fixed set of prompts is another population: a
toy-world nominee measured to stop in 182 of 192 answers ran past 64 tokens on 3 of 5 arithmetic and string
`PROMPTS` it had never been trained near, and its bundle was refused (decision-quality benchmark, small-holdout
seed 407). Without a notebook, or when the items can no longer be read, the reload answers `PROMPTS`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import sys
from itertools import islice
from pathlib import Path
from typing import Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError

from core import chat, loading
from core.bounded import Phase, enter_phase, print_phase, run_phases, streamed
from core.display import bounded, shown
from core.loading import DTYPE_BYTES
from core.util import (
    SHIPPED_FILE_MODE,
    dir_mode,
    not_regular,
    open_regular,
    read_regular,
    shipped_file_mode,
)
from memory.notebook import Notebook, NotebookError
from tools.jobs import zygote
from tools.nomination.bundle import (
    ADAPTER_CONFIG,
    INDEX,
    UNSERVED,
    MeasuredStops,
    ServingConfig,
    TrainingEvidence,
    generation_stop_ids,
    model_stop_ids,
    read_header,
    stop_evals,
    stop_probes,
    stops_of,
)

REQUIRED = ("chat_template.jinja", "system_prompt.txt", "generation_config.json", "serving_config.json",
            "training_evidence.json", "README.md", "tokenizer_config.json", "tokenizer.json")
SHAPES: list[tuple[str, list[dict[str, str]]]] = [
    ("system+user", [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Hi?"}]),
    ("multi-turn", [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "And 3 + 3?"}]),
    ("user only", [{"role": "user", "content": "Name a colour."}]),
    ("embedded newlines", [{"role": "user", "content": "line one\nline two\n\n  indented\n"},
                           {"role": "assistant", "content": "\nok\n\n"}, {"role": "user", "content": "\n"}]),
    ("non-ASCII", [{"role": "user", "content": "Größe? 数字 — ½ 😀 naïve \u00e9\u0301"}]),
    ("every role", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                    {"role": "assistant", "content": "d"}]),
    ("template text in content", [{"role": "user", "content": "{{ messages }} {% if x %} <|im_end|> '\" \\"}]),
]
PROMPTS = [
    "What is 17 + 25?",
    "Count the words in: the cat sat on the mat.",
    'Reverse the string "stone".',
    "Say hello in one short sentence.",
    "Give the answer as JSON: what is 3 times 4?",
]
# The reload's unstopped answers fail it when the nominee's measured stop rate makes that many this unlikely.
STOP_ALPHA = 0.01
# Library errors a broken bundle can raise while it is loaded or run: each is a failed check, reported.
LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, jinja2.TemplateError, SafetensorError,
               NotebookError, MemoryError)

# Bounds: every check ends, in limited memory, whatever the bundle holds. A bundle's template is someone else's
# program (a loop template rendered to 4 GB; `'x' * 10**12` died with a MemoryError traceback), so every check that
# renders it runs in a child process under an address-space limit, a CPU limit and a timeout; the reload, which
# loads the weights, runs in one under a timeout, and generates at most RELOAD_MAX_NEW_TOKENS per answer within
# RELOAD_SECONDS_PER_ANSWER whatever generation_config.json says (one hostile bundle ran 198 s on 5 prompts).
TEMPLATE_SECONDS = 20  # of CPU (a real template's checks take about 2, the tokenizer's load most of it)
TEMPLATE_WALL_SECONDS = 60  # the same checks on a loaded machine
TEMPLATE_MEMORY = 3 * 1024**3  # beyond the child's libraries: loading a tokenizer takes about 1.5 GiB
RELOAD_SECONDS = 600
# The one bounded child's two phases (core.bounded.run_phases): the template checks, then the reload, which
# reuses the libraries the first phase imported (torch and transformers: about 3 CPU-s a child on a CPU machine).
PHASES = [Phase(TEMPLATE_SECONDS, TEMPLATE_WALL_SECONDS, TEMPLATE_MEMORY), Phase(RELOAD_SECONDS, RELOAD_SECONDS)]
# A failed check among these leaves nothing the reload could show: it is not attempted.
BLOCKS_RELOAD = ("template_bounds", "template_compiles", "served_prompts", "weights", "adapter_base", "stop_ids",
                 "generation_config")
RELOAD_MAX_NEW_TOKENS = 256
RELOAD_SECONDS_PER_ANSWER = 60
# The largest text file read whole (templates and the system prompt are a few kB; tokenizer files have their own
# bound, core.loading.TOKENIZER_FILE_LIMIT, which also bounds every JSON file of the bundle).
TEXT_LIMIT = 1024**2
# The largest file of the manifest besides the weights (the bound of tokenizer files, which are the largest of them).
SERVED_FILE_LIMIT = loading.TOKENIZER_FILE_LIMIT
# The most entries a bundle directory may hold (a real one holds about 15 plus its shards).
MAX_ENTRIES = 10_000
# What the bundle writer puts in generation_config.json (tools.nomination.bundle._write_generation_config).
GENERATION_KEYS = frozenset({"do_sample", "max_new_tokens", "repetition_penalty", "eos_token_id", "pad_token_id",
                             "temperature", "top_p", "top_k", "transformers_version"})
# The checks that render the bundle's template, run together in one bounded child.
# The most characters a template may render for one of the checks' short conversations (they render to a few
# hundred); a loop template stops here instead of filling memory.
TEMPLATE_OUTPUT_LIMIT = 1024**2
# The longest message line printed (an answer or an error may quote a lot).
MESSAGE_LIMIT = 2000
TEMPLATE_CHECKS = ("template_bounds", "template_compiles", "template_matches_renderer", "template_minijinja",
                   "tokenizer_template", "stop_ids", "served_prompts")
# minijinja's bound on the work of one rendering (its "fuel": about one unit per instruction); the checks'
# conversations take a few thousand, a template that loops runs out instead of running on.
MINIJINJA_FUEL = 5_000_000


class CheckResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="Check name.")
    status: Literal["passed", "failed", "skipped"] = Field(description="Outcome.")
    messages: list[str] = Field(
        description="Each failure with what was expected (or why it was skipped, or what a pass tolerated).")


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt: str = Field(description="The user prompt.")
    text: str = Field(description="The decoded answer, stop token excluded.")
    n_tokens: int = Field(description="Generated tokens, stop token included.")
    stopped: bool = Field(description="Whether generation ended on a stop id.")


class BundleReport(BaseModel):
    """What check_bundle found; `ok` when no check failed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bundle: str = Field(description="The bundle directory.")
    results: list[CheckResult] = Field(description="Every check, in order.")
    answers: list[Answer] = Field(description="The reload check's answers.")

    @property
    def ok(self) -> bool:
        return all(r.status != "failed" for r in self.results)

    def failures(self) -> dict[str, list[str]]:
        return {r.name: r.messages for r in self.results if r.status == "failed"}


def _read(path: Path, limit: int) -> str:
    """A bundle text file: a regular file of one name (core.util.open_regular), refused (ValueError naming it) past
    `limit` bytes before it is read."""
    return read_regular(path, limit, single_link=True).decode("utf-8")


def _sha256(path: Path, limit: int) -> tuple[int, str | None]:
    """The size of the bundle file at `path` and its sha256, read from the descriptor whose size was checked (at
    most that many bytes); no sha256 (None, nothing read) for a file past `limit` bytes."""
    with os.fdopen(open_regular(path, single_link=True), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            return size, None
        digest, left = hashlib.sha256(), size
        while left and (block := f.read(min(left, 1 << 20))):
            digest.update(block)
            left -= len(block)
        return size, digest.hexdigest() if not left else None


def _digest_problem(name: str, path: Path, want, limit: int, what: str) -> str | None:
    """Why the bundle file at `path` is not the recorded one (`want`: its bytes and sha256; `what` says what a
    difference means), or None; a file past `limit` bytes is not read."""
    size, got = _sha256(path, limit)
    if got == want.sha256 and size == want.bytes:
        return None
    found = f"with sha256 {got[:16]}..." if got is not None else f"(past {limit} bytes: not read)"
    return (f"{shown(name)} is {size} bytes {found}; expected {want.bytes} bytes with sha256 {want.sha256[:16]}... "
            f"({what})")


def _json(path: Path) -> dict:
    """A bundle JSON object; a broken, oversized or non-object one raises ValueError naming the file."""
    try:
        data = json.loads(_read(path, loading.TOKENIZER_FILE_LIMIT))
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{shown(path.name)}: not valid JSON ({shown(str(err), limit=200)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{shown(path.name)}: a JSON {type(data).__name__}; expected an object")
    return data


class _Bundle:
    """The parsed files of one bundle, read once."""

    def __init__(self, path: Path, serving: ServingConfig):
        self.path = path
        self.serving = serving
        self.template = _read(path / serving.chat_template_file, TEXT_LIMIT)
        self.system_prompt = _read(path / serving.system_prompt_file, TEXT_LIMIT)


# ---- template --------------------------------------------------------------------------------------


def _render(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=add_generation_prompt)
    return rendered[0]


def check_template_compiles(b: _Bundle) -> list[str]:
    try:
        _render(b.template, SHAPES[0][1], add_generation_prompt=False)
    except jinja2.TemplateSyntaxError as err:
        return [f"{b.serving.chat_template_file} line {err.lineno}: {err.message}; expected a template that "
                "compiles in transformers' sandboxed Jinja environment (raise_exception is a global: call it "
                "as an expression, {{ raise_exception('...') }}, not as a {% tag %})"]
    except jinja2.TemplateError:
        return []  # it compiled; what it raises when rendering is template_matches_renderer's to report
    return []


def _first_difference(got: str, want: str) -> str:
    i = next((k for k, (a, c) in enumerate(zip(got, want, strict=False)) if a != c), min(len(got), len(want)))
    return f"at character {i}: template gives {got[max(0, i - 20):i + 20]!r}, renderer {want[max(0, i - 20):i + 20]!r}"


def _tokenizers(b: _Bundle):
    """The bundle's tokenizer as a server loads it (the shipped template), and the same tokenizer carrying the
    template training rendered rows with (the bundle's training_template_file)."""
    name = b.serving.training_template_file
    if Path(name).name != name or not (b.path / name).is_file():
        raise ValueError(f"serving_config.json training_template_file {name!r} is not a file of the bundle; expected "
                         "the template training rendered rows with")
    training = loading.load_tokenizer(b.path)
    training.chat_template = _read(b.path / name, TEXT_LIMIT)
    return loading.load_tokenizer(b.path), training


def check_template_matches(b: _Bundle) -> list[str]:
    system = b.serving.decoding.system_prompt or None
    shipped, training = _tokenizers(b)
    try:
        chat.check_tokenizer(training)
    except chat.ChatTemplateError as err:
        return [f"{b.serving.training_template_file}: {err}; expected the template training rendered rows with"]
    problems = _mismatches(
        lambda messages, generation: chat.render_text(training, messages, system, add_generation_prompt=generation),
        lambda messages, generation: shipped.apply_chat_template(messages, chat_template=b.template, tokenize=False,
                                                                 add_generation_prompt=generation),
        jinja2.TemplateError, "the template")
    if problems:
        return [f"{b.serving.chat_template_file} differs from the training renderer (core.chat.render_text with "
                f"{b.serving.training_template_file} and the served system prompt) in {len(problems)} of "
                f"{2 * len(SHAPES)} renderings; expected byte-identical output. First: " + problems[0]]
    return []


def _mismatches(want, got, raised: type[Exception], engine: str) -> list[str]:
    """Every rendering of SHAPES, with and without the generation prompt, where `got(messages, generation)` differs
    from `want(...)` (None: not compared) or raises `raised` (`engine` names what raised)."""
    problems = []
    for name, messages in SHAPES:
        for generation in (False, True):
            where = f"shape {name!r} (add_generation_prompt={generation})"
            expected = want(messages, generation)
            if expected is None:
                continue
            try:
                actual = got(messages, generation)
            except raised as err:
                first = shown(str(err).splitlines()[0] if str(err) else type(err).__name__, limit=300)
                problems.append(f"{where}: {engine} raised {first}")
                continue
            if actual != expected:
                problems.append(f"{where} {_first_difference(actual, expected)}")
    return problems


def _minijinja_render(env, template: str, messages: list[dict], generation: bool, specials: dict) -> str:
    return env.render_str(template, **specials, messages=messages, add_generation_prompt=generation)


def check_template_minijinja(b: _Bundle) -> list[str]:
    """The shipped template renders in minijinja (as TGI sets it up) what it renders in transformers' Jinja2, which
    template_matches_renderer holds to the training renderer: so a minijinja server serves what training saw. A
    conversation the template refuses in Jinja2 is template_matches_renderer's to report."""
    import minijinja

    def raise_exception(message: str) -> None:  # TGI's: a template's own refusal, raised as an error
        raise minijinja.TemplateError(message)

    env = minijinja.Environment()
    env.trim_blocks, env.lstrip_blocks, env.fuel = True, True, MINIJINJA_FUEL
    env.add_function("raise_exception", raise_exception)
    shipped = loading.load_tokenizer(b.path)

    def jinja2_render(messages: list[dict], generation: bool) -> str | None:
        try:
            return shipped.apply_chat_template(messages, chat_template=b.template, tokenize=False,
                                               add_generation_prompt=generation)
        except jinja2.TemplateError:  # a conversation the template refuses: template_matches_renderer's to report
            return None

    problems = _mismatches(jinja2_render, lambda messages, generation: _minijinja_render(
        env, b.template, messages, generation, shipped.special_tokens_map), minijinja.TemplateError, "minijinja")
    if problems:
        return [f"{b.serving.chat_template_file} renders differently in minijinja (the engine of TGI and other servers) "
                f"than in transformers' Jinja2 in {len(problems)} of {2 * len(SHAPES)} renderings; expected a template "
                "that renders byte-identically in both (string escapes such as \\U0000002e are Python-only; "
                "\\u002e is read alike). First: " + problems[0].replace("template gives", "minijinja gives", 1)
                .replace(", renderer ", ", Jinja2 ", 1)]
    return []


def check_tokenizer_template(b: _Bundle) -> list[str]:
    problems = []
    config = _json(b.path / "tokenizer_config.json")
    if config.get("chat_template") != b.template:
        problems.append(f"tokenizer_config.json chat_template differs from {b.serving.chat_template_file}; "
                        "expected the same template in both")
    if loading.load_tokenizer(b.path).chat_template != b.template:
        problems.append(f"AutoTokenizer loads a chat template other than {b.serving.chat_template_file}")
    return problems


# ---- consistency -----------------------------------------------------------------------------------


def check_system_prompt(b: _Bundle) -> list[str]:
    if not b.system_prompt.strip():
        return [f"{b.serving.system_prompt_file} is empty; expected the served system prompt"]
    if b.system_prompt != b.serving.decoding.system_prompt:
        return [f"{b.serving.system_prompt_file} differs from serving_config.json decoding.system_prompt; "
                "expected the served system prompt verbatim"]
    return []


def check_generation_config(b: _Bundle) -> list[str]:
    gen = _json(b.path / "generation_config.json")
    d = b.serving.decoding
    eos = gen.get("eos_token_id")
    want = {"eos_token_id": generation_stop_ids(d, b.serving.model_stop_token_ids), "max_new_tokens": d.max_new_tokens,
            "do_sample": not d.greedy, "repetition_penalty": d.repetition_penalty}
    if not d.greedy:
        want |= {"temperature": d.temperature, "top_p": d.top_p}
    got = {k: gen.get(k, False if k == "do_sample" else None) for k in want}
    got["eos_token_id"] = [eos] if isinstance(eos, int) else eos
    problems = [f"generation_config.json {k} is {got[k]!r}; expected {v!r} (the served decoding"
                + (", then the model's own stop ids)" if k == "eos_token_id" else ")")
                for k, v in want.items() if got[k] != v]
    # The model's own stop ids a server must stop on too: its config.json's (a full bundle's own generation config is
    # the one checked here; an adapter's base has its own).
    base = b.serving.weights.base
    own = (model_stop_ids(b.path, ("config.json",)) if base is None else
           model_stop_ids(Path(base.path)) if (Path(base.path) / "config.json").is_file() else [])
    listed = got["eos_token_id"] if isinstance(got["eos_token_id"], list) else []
    dropped = [i for i in own if i not in listed]
    if dropped:  # Llama-3 Instruct ends some answers with <|end_of_text|>, not <|eot_id|>: a server must stop on both
        problems.append(f"the model's own config.json names stop ids {dropped} that generation_config.json does not "
                        "stop on; expected every eos_token_id of the model's config among the stop ids")
    extra = sorted(k for k in gen if k not in GENERATION_KEYS)
    if extra:  # num_beams, min_new_tokens, ... change what a server generates (and how long it takes)
        problems.append(f"generation_config.json sets {', '.join(shown(k) for k in bounded(extra, 5))}; expected only "
                        f"the served decoding's settings ({', '.join(sorted(GENERATION_KEYS))})")
    if b.serving.decoding_sha256 != d.fingerprint():
        problems.append(f"serving_config.json decoding_sha256 is {b.serving.decoding_sha256}; expected the "
                        f"fingerprint of its decoding, {d.fingerprint()} (the decoding was edited)")
    return problems


def check_stop_ids(b: _Bundle) -> list[str]:
    tokenizer = loading.load_tokenizer(b.path)
    vocab = len(tokenizer)
    stops = list(b.serving.decoding.stop_token_ids)
    problems = [f"stop id {s} is not in the vocabulary (ids 0..{vocab - 1}); expected ids of real tokens"
                for s in generation_stop_ids(b.serving.decoding, b.serving.model_stop_token_ids) if not 0 <= s < vocab]
    # The end of turn the model was trained to emit: derived from the template training rendered rows with, so a
    # broken or swapped shipped template is template_compiles' and template_matches_renderer's to report, not this.
    try:
        _, training = _tokenizers(b)
    except ValueError:
        return problems  # no training template: template_matches_renderer names it
    try:
        fmt = chat.chat_format(training)
    except chat.ChatTemplateError as err:
        return [*problems, f"{b.serving.training_template_file}: {err}; expected a template that closes assistant "
                "turns with an end-of-turn token"]
    if fmt.eot_id not in stops:
        problems.append(f"the end-of-turn token {fmt.eot_token} (id {fmt.eot_id}, from the chat template) is not a stop "
                        f"id {stops}; expected it among them, or answers run past the end of the turn")
    return problems


def check_max_input_tokens(b: _Bundle) -> list[str]:
    n = b.serving.max_input_tokens
    return [] if n > 0 else [f"serving_config.json max_input_tokens is {n}; expected a positive number"]


def _shard_problems(b: _Bundle) -> list[str]:
    """The index against the shards: every named shard recorded and present, every shard named, and
    every tensor of a shard mapped to it (and only tensors it holds)."""
    weight_map = _json(b.path / INDEX).get("weight_map", {})
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return [f"{INDEX} weight_map is not an object of tensor name -> shard file; expected the shard index"]
    outside = sorted({v for v in weight_map.values() if not plain_name(v)})
    if outside:
        return [f"{INDEX} maps tensors to {shown(outside[0])}" + (f" (and {len(outside) - 1} more)" if len(outside) > 1
                else "") + ", a name outside the bundle; expected plain file names of the bundle's own shards"]
    named, recorded = sorted(set(weight_map.values())), set(b.serving.weights.files)
    problems = [f"{INDEX} names {name}, which serving_config.json does not record"
                + ("" if (b.path / name).is_file() else " and which is missing") for name in named if name not in recorded]
    for name in sorted(recorded - set(named)):
        problems.append(f"{name} is recorded in serving_config.json but {INDEX} names none of its tensors; "
                        "expected every shard in the index (its tensors would not load)")
    for stray in sorted(p.name for p in b.path.glob("*.safetensors") if p.name not in recorded | set(named)):
        problems.append(f"{stray} lies in the bundle but not in {INDEX}; expected every shard in the index")
    for name in (n for n in named if (b.path / n).is_file()):
        header = read_header(b.path / name)
        unmapped = sorted(t for t in header if weight_map.get(t) != name)
        absent = sorted(t for t, shard in weight_map.items() if shard == name and t not in header)
        if unmapped:
            problems.append(f"{name}: {len(unmapped)} tensors (e.g. {unmapped[0]}) are not mapped to it in {INDEX}; "
                            "expected every tensor indexed (unindexed weights load as random values)")
        if absent:
            problems.append(f"{INDEX} maps {len(absent)} tensors (e.g. {absent[0]}) to {name}, which does not hold them")
    return problems


def check_weights(b: _Bundle) -> list[str]:
    """Every weights file is the recorded one. What is hashed is bounded first: a file is hashed only once its size
    is the recorded size and the size its safetensors header describes, each tensor's bytes its dtype and shape (and,
    for a full model, the index is the shards'), so a sparse terabyte whose size was recorded is refused unread."""
    files = sorted(b.serving.weights.files.items())
    problems = []
    for name, want in files:
        path = b.path / name
        if not path.is_file():
            problems.append(f"{name} is missing; expected {want.bytes} bytes")
        elif (size := os.stat(path, follow_symlinks=False).st_size) != want.bytes:
            problems.append(f"{name} is {size} bytes (not read); expected {want.bytes} bytes with sha256 "
                            f"{want.sha256[:16]}... (truncated or changed)")
        else:
            problems += _tensor_problems(path)
    if not problems and b.serving.weights.kind == "full":
        problems = _shard_problems(b)
    if problems:
        return problems
    return [p for name, want in files
            if (p := _digest_problem(name, b.path / name, want, want.bytes, "truncated or changed"))]


def _tensor_problems(path: Path) -> list[str]:
    """Whether a weights file's header describes the file: its size (read_header), and each tensor's bytes the
    product of its shape and its dtype's size."""
    try:
        header = read_header(path)
    except ValueError as err:
        return [f"{shown(str(err), limit=MESSAGE_LIMIT)}; expected a safetensors file whose header describes it (not "
                "hashed)"]
    wrong = sorted(t for t, v in header.items() if v["dtype"] in DTYPE_BYTES
                   and v["data_offsets"][1] - v["data_offsets"][0] != math.prod(v["shape"]) * DTYPE_BYTES[v["dtype"]])
    if wrong:
        return [f"{shown(path.name)}: {len(wrong)} tensors (e.g. {shown(wrong[0], limit=80)}) span other than their "
                "shape times their dtype's size; expected a safetensors header that describes its tensors (not hashed)"]
    return []


def check_adapter_base(b: _Bundle) -> list[str]:
    from core.weights import weights_sha256

    base = b.serving.weights.base
    adapter = _json(b.path / ADAPTER_CONFIG)
    named = adapter.get("base_model_name_or_path")
    if named is None or Path(named).resolve() != Path(base.path).resolve():
        return [f"{ADAPTER_CONFIG} base_model_name_or_path is {named!r}; expected the recorded base {base.path}"]
    if not (Path(base.path) / "config.json").is_file():
        return [f"the recorded base {base.path} is not a model directory; expected it present at that path"]
    odd = _special_entries(Path(base.path))
    if odd:  # the bundle names the base: a FIFO there would stop the hash below forever, a device feed it without end
        return [f"the recorded base {shown(base.path)} holds {odd[0]}" + (f" (and {len(odd) - 1} more)" if len(odd) > 1
                else "") + "; expected a model directory of regular files (nothing of it was read)"]
    revision = weights_sha256(Path(base.path))
    if revision != base.revision:
        return [f"the base at {base.path} has weights hash {revision}; expected the recorded revision {base.revision}"]
    return []


def _special_entries(directory: Path) -> list[str]:
    """The entries of a directory outside the bundle (an adapter's base) that are neither directories nor regular
    files once links are followed (a model cache links its files to blobs), named with what they are."""
    found = []
    for entry in islice(directory.iterdir(), MAX_ENTRIES + 1):
        try:
            st = os.stat(entry)
        except OSError:
            continue  # a dangling link: nothing to read
        why = None if stat.S_ISDIR(st.st_mode) else not_regular(st)
        if why is not None:
            found.append(f"{shown(entry.name)}: {why}")
    return found


def check_decision_hash(b: _Bundle, notebook_path: Path) -> list[str]:
    evidence = TrainingEvidence.model_validate_json(_read(b.path / "training_evidence.json", loading.CONFIG_FILE_LIMIT))
    want = evidence.last_decision
    with Notebook.open(notebook_path, readonly=True) as nb:
        found = nb.recorded_hash(evidence.session, want.seq)
    if found is None:
        return [f"decision {want.seq} of session {evidence.session} is not in {notebook_path}; expected the "
                "evidence's last decision in the notebook's chain"]
    if found != want.hash:
        return [f"decision {want.seq} in {notebook_path} has hash {found}; the evidence records {want.hash}"]
    return []


def _templates(b: _Bundle) -> dict[str, str]:
    """Every chat template the bundle carries, by where it is."""
    out = {b.serving.chat_template_file: b.template}
    training = b.path / b.serving.training_template_file
    if plain_name(b.serving.training_template_file) and training.is_file():
        out[b.serving.training_template_file] = _read(training, TEXT_LIMIT)
    config = _json(b.path / "tokenizer_config.json").get("chat_template")
    named = config if isinstance(config, list) else [{"name": "default", "template": config}]
    for entry in named:
        if isinstance(entry, dict) and isinstance(entry.get("template"), str):
            out[f"tokenizer_config.json chat_template {shown(str(entry.get('name')))}"] = entry["template"]
    return out


def check_template_bounds(b: _Bundle) -> list[str]:
    """Every template renders every conversation the checks and the reload use within TEMPLATE_OUTPUT_LIMIT
    characters, streamed, so one that would print 4 GB stops at the limit (the other template checks run only
    after this one passes; a template that loops without printing is stopped by the child's time limit)."""
    # transformers' own (sandboxed) environment, compiled as apply_chat_template compiles it
    from transformers.utils.chat_template_utils import _compile_jinja_template

    conversations = [m for _, m in SHAPES] + [[{"role": "user", "content": p}] for p in PROMPTS]
    for where, template in _templates(b).items():
        try:
            compiled = _compile_jinja_template(template)
        except jinja2.TemplateError:
            continue  # does not compile: template_compiles says so
        for messages in conversations:
            for generation in (False, True):
                if _streamed_length(compiled, messages, generation) > TEMPLATE_OUTPUT_LIMIT:
                    return [f"{where} renders more than {TEMPLATE_OUTPUT_LIMIT} characters for a conversation of "
                            f"{len(messages)} short turns; expected a template that renders in bounds"]
    return []


def _streamed_length(compiled, messages: list[dict], generation: bool) -> int:
    """Characters the template renders, counted as they stream and stopped past the limit (core.bounded.streamed);
    a template that raises has rendered less than the limit (its error is the other checks' to report)."""
    try:
        text = streamed(compiled, TEMPLATE_OUTPUT_LIMIT, messages=messages, add_generation_prompt=generation)
    except (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError, AttributeError, RecursionError):
        return 0
    return TEMPLATE_OUTPUT_LIMIT + 1 if text is None else len(text)


def check_served_prompts(b: _Bundle) -> list[str]:
    """The reload's prompts render under the shipped template as a server renders them (run in the bounded child
    with the other template checks, so the reload never renders a template that does not end)."""
    tokenizer = loading.load_tokenizer(b.path)
    for prompt in PROMPTS:
        tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                      add_generation_prompt=b.serving.add_generation_prompt)
    return []


# ---- integrity and confinement ---------------------------------------------------------------------


def plain_name(name: str) -> bool:
    """A file name of the bundle itself: no directory part, no traversal, nothing absolute."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0")


def check_integrity(b: _Bundle) -> list[str]:
    """Every file a server reads besides the weights has the size and sha256 serving_config.json records, and
    the bundle holds no file the manifest leaves out (an added normalizer in tokenizer.json passed before)."""
    recorded = b.serving.files
    if recorded is None:
        return [f"serving_config.json records no digests of the served files (format_version "
                f"{b.serving.format_version}); expected format 2, whose manifest covers tokenizer.json and every "
                "other file a server reads (rebuild the bundle)"]
    problems = []
    for name in ("tokenizer.json", "tokenizer_config.json", b.serving.chat_template_file):
        if name not in recorded:
            problems.append(f"serving_config.json files does not record {shown(name)}; expected its digest")
    for name, want in sorted(recorded.items()):
        path = b.path / name
        if not plain_name(name) or not path.is_file():
            problems.append(f"serving_config.json files names {shown(name)}, which is not a file of the bundle")
        elif (problem := _digest_problem(name, path, want, SERVED_FILE_LIMIT, "edited since it was written")):
            problems.append(problem)
    listed = set(recorded) | set(b.serving.weights.files) | set(UNSERVED)
    unlisted = sorted(p.name for p in b.path.iterdir() if p.name not in listed)
    problems += [f"{shown(name)} lies in the bundle but in no manifest of serving_config.json; expected only the "
                 "files it records" for name in unlisted]
    return problems


def check_permissions(b: _Bundle, notebook_path: Path | None) -> list[str]:
    """Every entry of the bundle grants the read bits of the shipped mode (and the directories its search bits):
    a server running as another user reads the bundle only then, whoever runs this check."""
    mode = SHIPPED_FILE_MODE
    if notebook_path is not None:
        evidence = TrainingEvidence.model_validate_json(_read(b.path / "training_evidence.json", loading.CONFIG_FILE_LIMIT))
        with Notebook.open(notebook_path, readonly=True) as nb:
            mode = shipped_file_mode(nb.session(evidence.session).config)
    short = []
    for path in [b.path, *sorted(b.path.iterdir())]:
        if path.is_symlink():
            continue
        want = (dir_mode(mode) & 0o555) if path.is_dir() else (mode & 0o444)
        have = path.stat().st_mode & 0o777
        if want & ~have:
            short.append(f"{'the bundle directory' if path == b.path else shown(path.name)} has mode {have:04o}")
    if not short:
        return []
    more = f" (and {len(short) - 3} more)" if len(short) > 3 else ""
    return [f"{'; '.join(short[:3])}{more}; expected files granting the read bits of {mode:04o} and directories the "
            f"search bits of {dir_mode(mode):04o} (the lab's shipped mode), or a server running as another user "
            "cannot read the bundle"]


def confinement_problems(path: Path) -> list[str]:
    """What would make reading the bundle read something else, or never end: a symbolic link, a FIFO (a read waits
    for a writer forever), a device (/dev/zero reads without end), a socket, a hard link (its other name may lie
    outside the bundle), code, pickles, an auto_map, an oversized tokenizer file. Checked before any file is read,
    from each entry's own stats (a link's target, a device, a pipe are never opened)."""
    entries = sorted(islice(path.iterdir(), MAX_ENTRIES + 1))  # a directory of millions is not listed whole
    if len(entries) > MAX_ENTRIES:
        return [f"more than {MAX_ENTRIES} entries; expected a bundle of at most {MAX_ENTRIES} files"]
    problems = [p for p in (_entry_problem(path.resolve(), e) for e in entries) if p]
    if problems:
        return problems
    try:
        return [m.replace(f"{shown(str(path))}/", "", 1) for m in loading.model_problems(path)]
    except loading.UnsafeModelError as err:
        return [str(err)]


def _entry_problem(root: Path, entry: Path) -> str | None:
    """Why one entry of the bundle is not a file of its own to read, or None (a directory is integrity's to name)."""
    st = os.lstat(entry)
    if stat.S_ISLNK(st.st_mode):
        inside = Path(os.path.realpath(entry)).is_relative_to(root)  # realpath: a link loop is no exception here
        where = "(inside the bundle)" if inside else "leading out of the bundle"
        return (f"{shown(entry.name)} is a symbolic link {where}; expected every file inside it, a regular file of its "
                "own (its target is not read)")
    if stat.S_ISDIR(st.st_mode):
        return None
    why = not_regular(st, single_link=True)
    return None if why is None else (f"{shown(entry.name)}: {why}; expected the bundle's own files, each a regular "
                                     "file with one name (it is not opened)")


def _name_problems(serving: ServingConfig) -> list[str]:
    names = [serving.chat_template_file, serving.system_prompt_file, serving.training_template_file,
             *serving.weights.files, *([serving.weights.index] if serving.weights.index else [])]
    return [f"serving_config.json names {shown(n)}; expected a plain file name of the bundle (no directory, no "
            "'..', nothing absolute)" for n in names if not plain_name(n)]


# ---- reload ----------------------------------------------------------------------------------------


def reload_device() -> tuple[str, str]:
    """Where the reload serves the bundle: on this process's GPU in bfloat16 when it has one (the bundle job given a
    GPU, check-bundle on a GPU host), as a server would; else on the CPU in float32."""
    import torch

    return ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")


def _load_model(b: _Bundle, device: str, dtype: str):
    import torch

    kwargs = {"dtype": getattr(torch, dtype)}
    if b.serving.weights.kind == "full":
        return loading.load_causal_lm(b.path, **kwargs).to(device).eval()
    base = loading.load_causal_lm(b.serving.weights.base.path, **kwargs)
    return loading.load_adapter(base, b.path).to(device).eval()


def _reload_generation(b: _Bundle):
    """The bundle's generation config as a server reads it, bounded by the check's own limits (the file's
    max_new_tokens is the bundle's claim, not the check's budget)."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(b.path)
    generation.max_new_tokens = reload_max_new_tokens(b)
    generation.max_time = RELOAD_SECONDS_PER_ANSWER
    return generation


def reload_max_new_tokens(b: _Bundle) -> int:
    """The tokens an answer may take in the reload: the served limit, capped by the check's RELOAD_MAX_NEW_TOKENS."""
    return min(b.serving.decoding.max_new_tokens, RELOAD_MAX_NEW_TOKENS)


def reload_conversations(probes: list[list[dict[str, str]]]) -> list[list[dict[str, str]]]:
    """What the reload answers: the probes of the population the nominee's stop rate was measured on, else PROMPTS."""
    return probes or [[{"role": "user", "content": prompt}] for prompt in PROMPTS]


def reload_answers(b: _Bundle, probes: list[list[dict[str, str]]]) -> list[Answer]:
    """The bundle loaded as a server loads it, answering `reload_conversations(probes)` at the served decoding."""
    import torch

    tokenizer = loading.load_tokenizer(b.path)
    device, dtype = reload_device()
    model = _load_model(b, device, dtype)
    generation = _reload_generation(b)
    stops = set(b.serving.decoding.stop_token_ids)
    torch.manual_seed(0)  # sampled decoding: the same bundle gives the same answers
    answers = []
    for conversation in reload_conversations(probes):
        prompt = conversation[-1]["content"]
        inputs = tokenizer.apply_chat_template(conversation, return_tensors="pt",
                                               add_generation_prompt=b.serving.add_generation_prompt,
                                               return_dict=True).to(device)
        if inputs["input_ids"].shape[1] > b.serving.max_input_tokens:
            raise ValueError(f"prompt {prompt!r} renders to {inputs['input_ids'].shape[1]} tokens, over "
                             f"max_input_tokens {b.serving.max_input_tokens}")
        with torch.inference_mode():
            out = model.generate(**inputs, generation_config=generation)
        new = out[0, inputs["input_ids"].shape[1]:].tolist()
        stopped = bool(new) and new[-1] in stops
        text = tokenizer.decode(new[:-1] if stopped else new, skip_special_tokens=False)
        answers.append(Answer(prompt=prompt, text=text, n_tokens=len(new), stopped=stopped))
    return answers


def reload_evidence(b: _Bundle, notebook_path: Path | None) -> tuple[MeasuredStops | None, list[list[dict[str, str]]]]:
    """The nominee's measured stops at the bundle's decoding, and the items the reload answers. With a notebook, both
    from it (the items, `bundle.stop_probes`, read from the lab's files); without one, the stops as the bundle's
    evidence recorded them when it was written (None for a bundle from before they were recorded) and no items (a
    bundle carries none: the reload then answers PROMPTS)."""
    evidence = TrainingEvidence.model_validate_json(_read(b.path / "training_evidence.json", loading.CONFIG_FILE_LIMIT))
    if notebook_path is None:
        return evidence.stops, []
    with Notebook.open(notebook_path, readonly=True) as nb:
        evals = stop_evals(nb, evidence.session, evidence.nominee, b.serving.decoding_sha256)
        return stops_of(evals), stop_probes(nb, evals)


def _tail(n: int, k: int, q: float) -> float:
    """P(X >= k) for X ~ Binomial(n, q)."""
    return sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k, n + 1))


def stop_verdict(answers: list[Answer], max_new_tokens: int, measured: MeasuredStops | None) -> tuple[bool, str]:
    """Whether the reload's unstopped answers are more than the nominee's measured stop rate explains, and why."""
    missed = [a.prompt for a in answers if not a.stopped]
    if not missed:
        return True, ""
    what = (f"{len(missed)} of {len(answers)} answers did not end on a stop id within {max_new_tokens} tokens "
            f"({', '.join(repr(p) for p in missed)})")
    if measured is None:
        return False, f"{what}; expected every answer to stop (no measured stop rate for this decoding)"
    q = (measured.answers - measured.stopped + 1) / (measured.answers + 2)
    p = _tail(len(answers), len(missed), q)
    rate = (f"the nominee stopped in {measured.stopped} of {measured.answers} measured answers "
            f"({', '.join(measured.suites)}), so this many misses has probability {p:.3g}")
    if p < STOP_ALPHA:
        return False, f"{what}; {rate} < {STOP_ALPHA}: the bundle does not stop as the nominee was measured to"
    return True, f"{what}: tolerated, {rate} >= {STOP_ALPHA}"


def answer_problems(answers: list[Answer], max_new_tokens: int, measured: MeasuredStops | None = None,
                    hint: str = "") -> tuple[list[str], list[str]]:
    """The reload's failures, and what it tolerated (unstopped answers its measured stop rate explains); `hint`
    follows a failed stop verdict."""
    problems = []
    for a in answers:
        if not a.text.strip():
            problems.append(f"answer to {a.prompt!r} is empty; expected text before the stop id")
        if "\ufffd" in a.text:
            problems.append(f"answer to {a.prompt!r} contains U+FFFD (broken byte decoding): {a.text!r}")
    ok, why = stop_verdict(answers, max_new_tokens, measured)
    if not ok:
        problems.insert(0, why + hint)
    return problems, [why] if ok and why else []


# ---- running ---------------------------------------------------------------------------------------


def _run(name: str, fn, *args) -> CheckResult:
    try:
        problems = fn(*args)
    except MemoryError:  # in a bounded child: the check's own memory limit, not the machine's
        problems = ["did not finish in bounds: ran out of the memory the check allows; expected a bundle that loads "
                    "and renders in bounds"]
    except LOAD_ERRORS as err:
        problems = [f"{type(err).__name__}: {shown(str(err), limit=MESSAGE_LIMIT)}"]
    return CheckResult(name=name, status="failed" if problems else "passed", messages=problems)


def _skipped(name: str, why: str) -> CheckResult:
    return CheckResult(name=name, status="skipped", messages=[why])


def _why(err: OSError | ValueError) -> str:
    if isinstance(err, OSError):
        return f"cannot be read ({err.strerror})"
    if not isinstance(err, ValidationError):
        return str(err)
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    more = f" (and {err.error_count() - 1} more problems)" if err.error_count() > 1 else ""
    # A rule across fields names its field in its message ("weights.base: ..."); pydantic prefixes "Value error, ".
    what = first["msg"].removeprefix("Value error, ") if not where else f"{where}: {first['msg']}"
    return f"{shown(what, limit=MESSAGE_LIMIT)}{more}; expected a serving config as tools.nomination.bundle writes it"


def _missing(path: Path, serving: ServingConfig | None) -> list[str]:
    """Files a server reads that are not in the bundle (those serving_config.json names included)."""
    names = list(REQUIRED)
    if serving is not None:
        names += [serving.chat_template_file, serving.system_prompt_file, *serving.weights.files]
        names += ["config.json", INDEX] if serving.weights.kind == "full" else [ADAPTER_CONFIG]
    return [f for f in dict.fromkeys(names) if not (path / f).is_file()]


def _parse(path: Path) -> tuple[list[CheckResult], _Bundle | None]:
    """The files and serving_config checks; the parsed bundle when both pass. Nothing is read from a bundle
    that is not confined (confinement_problems)."""
    confined = confinement_problems(path)
    if confined:
        return [CheckResult(name="files", status="failed", messages=confined)], None
    try:
        serving = ServingConfig.model_validate_json(_read(path / "serving_config.json", loading.CONFIG_FILE_LIMIT))
        names = _name_problems(serving)
        parsed = CheckResult(name="serving_config", status="failed" if names else "passed", messages=names)
        serving = None if names else serving
    except (OSError, ValueError) as err:
        serving = None
        parsed = CheckResult(name="serving_config", status="failed", messages=[f"serving_config.json: {_why(err)}"])
    missing = _missing(path, serving)
    files = CheckResult(name="files", status="failed" if missing else "passed",
                        messages=[f"{f} is missing; expected it in the bundle" for f in missing])
    if serving is None or missing:
        return [files, parsed], None
    try:
        return [files, parsed], _Bundle(path, serving)
    except UnicodeDecodeError as err:
        files = CheckResult(name="files", status="failed", messages=[f"{err}; expected UTF-8 text files"])
    except (OSError, ValueError) as err:
        files = CheckResult(name="files", status="failed", messages=[str(err)])
    return [files, parsed], None


def check_bundle(path: str | Path, notebook_path: str | Path | None = None) -> BundleReport:
    """Run every check on the bundle at `path` (and the decision-hash check against `notebook_path`)."""
    path = Path(path)
    results, b = _parse(path)
    if b is None:
        return BundleReport(bundle=str(path), results=results, answers=[])
    results += [
        _run("integrity", check_integrity, b),
        _run("permissions", check_permissions, b, None if notebook_path is None else Path(notebook_path)),
        _run("system_prompt", check_system_prompt, b),
        _run("generation_config", check_generation_config, b),
        _run("max_input_tokens", check_max_input_tokens, b),
        _run("weights", check_weights, b),
    ]
    later = []
    if b.serving.weights.kind == "adapter":
        later.append(_run("adapter_base", check_adapter_base, b))
    if notebook_path is not None:
        later.append(_run("decision_hash", check_decision_hash, b, Path(notebook_path)))
    templates, answers, reload = _bounded_checks(path, None if notebook_path is None else Path(notebook_path),
                                                 reload=not _blockers(results + later))
    results += templates + later
    blocked = _blockers(results)
    results.append(_skipped("reload", f"not attempted: {', '.join(blocked)} failed") if blocked or reload is None
                   else reload)
    return BundleReport(bundle=str(path), results=results, answers=answers)


def template_checks(b: _Bundle) -> list[CheckResult]:
    """The checks that render the bundle's template (TEMPLATE_CHECKS), in-process: run them through
    _bounded_checks unless the template is trusted."""
    bounds = _run("template_bounds", check_template_bounds, b)
    if bounds.status == "failed":  # rendering it again in the checks below would only meet the limit again
        return [bounds, *(_skipped(n, "the template does not render in bounds") for n in TEMPLATE_CHECKS[1:])]
    compiles = _run("template_compiles", check_template_compiles, b)
    rendering = [("template_matches_renderer", check_template_matches), ("stop_ids", check_stop_ids),
                 ("served_prompts", check_served_prompts)]  # each renders the template: moot when it does not compile
    rendered = [_run(n, fn, b) if compiles.status == "passed" else _skipped(n, "the template does not compile")
                for n, fn in rendering]
    minijinja = (_run("template_minijinja", check_template_minijinja, b) if compiles.status == "passed"
                 else _skipped("template_minijinja", "the template does not compile"))
    return [bounds, compiles, rendered[0], minijinja, _run("tokenizer_template", check_tokenizer_template, b),
            *rendered[1:]]


def _blockers(results: list[CheckResult]) -> list[str]:
    return [r.name for r in results if r.status == "failed" and r.name in BLOCKS_RELOAD]


def _bounded_checks(path: Path, notebook_path: Path | None, reload: bool
                    ) -> tuple[list[CheckResult], list[Answer], CheckResult | None]:
    """The template checks and, when `reload` and they leave nothing that blocks it, the reload: both in one child
    (`python -m tools.nomination.check_bundle --child RELOAD BUNDLE [NOTEBOOK]`), each phase under its PHASES bounds.
    The reload's result is None when it was not attempted."""
    template, reloaded = run_phases("tools.nomination.check_bundle",
                                    ["--child", str(int(reload)), str(path.resolve()),
                                     *([str(notebook_path.resolve())] if notebook_path is not None else [])], PHASES,
                                    python=zygote.listening_prefix(os.environ))
    if isinstance(template, str):
        why = f"the template checks did not finish in bounds: {template}; expected a template that renders in bounds"
        return [CheckResult(name=name, status="failed", messages=[why]) for name in TEMPLATE_CHECKS], [], None
    templates = [CheckResult.model_validate(r) for r in template["results"]]
    if isinstance(reloaded, str):
        return templates, [], CheckResult(name="reload", status="failed", messages=[
            f"the bundle did not load and answer in bounds: {reloaded}; expected {len(PROMPTS)} answers of at most "
            f"{RELOAD_MAX_NEW_TOKENS} tokens, each within {RELOAD_SECONDS_PER_ANSWER} s"])
    if reloaded is None:
        return templates, [], None
    return templates, [Answer.model_validate(a) for a in reloaded["answers"]], CheckResult.model_validate(
        reloaded["result"])


def _import_libraries() -> None:
    """In the child, before the first phase's memory bound is taken: every library the checks import. What they map
    differs by host (a CUDA build of torch maps several GiB of address space on import: a 3 GiB limit set before exec
    stopped every template check of the H200's GPU session; a CPU build maps a few hundred MiB), and the bound is for
    what the bundle's template makes the checks allocate. transformers 5.25 loads a tokenizer through modules that
    import torch (and `kernels`), which on the H200 took a template check past its bound before the template was
    read."""
    import jinja2  # noqa: F401 - mapped before the bound is taken
    import minijinja  # noqa: F401
    import torch  # noqa: F401

    # Lazy names: touching them imports what AutoTokenizer's path reaches (modeling_utils: accelerate, kernels,
    # torch.distributed).
    from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast  # noqa: F401
    from transformers.models.auto import modeling_auto  # noqa: F401
    from transformers.utils import chat_template_utils  # noqa: F401


def _child(reload: bool, path: Path, notebook_path: Path | None) -> None:
    """The child's side of _bounded_checks: each phase's results as one JSON line (core.bounded.print_phase)."""
    _import_libraries()
    enter_phase(PHASES, 0)
    results, b = _parse(path)
    if b is None:  # changed since the parent parsed it
        failed = [r for r in results if r.status == "failed"]
        print_phase(0, {"results": [r.model_dump() for r in failed]})
        print_phase(1, {"answers": [], "result": failed[0].model_dump()})
        return
    templates = template_checks(b)
    print_phase(0, {"results": [r.model_dump() for r in templates]})
    if not reload or _blockers(templates):
        return
    enter_phase(PHASES, 1)
    answers, result = check_reload(b, notebook_path)
    print_phase(1, {"answers": [a.model_dump() for a in answers], "result": result.model_dump()})


def check_reload(b: _Bundle, notebook_path: Path | None) -> tuple[list[Answer], CheckResult]:
    """The reload check: its answers, and its result (what a pass tolerated among the messages)."""
    try:
        measured, probes = reload_evidence(b, notebook_path)
    except LOAD_ERRORS as err:  # read before loading the model: a broken evidence file is named as such
        return [], CheckResult(name="reload", status="failed", messages=[
            f"training_evidence.json: the nominee's measured stops cannot be read: {type(err).__name__}: {err}"])
    try:
        answers = reload_answers(b, probes)
    except LOAD_ERRORS as err:
        return [], CheckResult(name="reload", status="failed", messages=[
            f"the bundle does not load and generate as a server would: {type(err).__name__}: {err}"])
    # Without the measured suites' items the rate is read on another population: say so beside a refusal.
    hint = ("; these were check-bundle's fixed prompts, not the measured suites' items (with --lab the reload "
            "answers those)") if measured is not None and not probes else ""
    problems, tolerated = answer_problems(answers, reload_max_new_tokens(b), measured, hint)
    device, dtype = reload_device()
    return answers, CheckResult(name="reload", status="failed" if problems else "passed",
                                messages=problems or [*tolerated, f"served on {device} in {dtype}"])


def print_report(report: BundleReport) -> None:
    """Every check, its messages escaped (file names and contents are someone else's text) and bounded."""
    out = sys.stdout  # read at call time: a caller (or a test) may have redirected it
    for r in report.results:
        label = {"passed": "ok     ", "failed": "FAILED ", "skipped": "skipped"}[r.status]
        messages = bounded([shown(m, limit=MESSAGE_LIMIT) for m in r.messages])
        print(f"  {label} {r.name}" + (f": {messages[0]}" if messages else ""), file=out)
        for extra in messages[1:]:
            print(f"          {' ' * len(r.name)}  {extra}", file=out)
    failed = len(report.failures())
    verdict = "passes every check" if report.ok else f"FAILS {failed} of {len(report.results)} checks"
    print(f"{shown(report.bundle)}: {verdict}", file=out)


def check_bundle_command(bundle: Path, lab: Path | None) -> int:
    """The CLI: print every check; 0 if all pass, 1 if any fails, 2 for a DIR or notebook that is not there."""
    if not bundle.is_dir():
        print(f"error: check-bundle: {shown(str(bundle))} is not a directory", file=sys.stderr)
        return 2
    notebook = None if lab is None else lab / "notebook.db"
    if notebook is not None and not notebook.is_file():
        print(f"error: check-bundle: --lab {shown(str(lab))}: no notebook.db there", file=sys.stderr)
        return 2
    try:
        report = check_bundle(bundle, notebook)
    except NotebookError as err:
        print(f"error: check-bundle: {err}", file=sys.stderr)
        return 2
    print_report(report)
    return 0 if report.ok else 1


if __name__ == "__main__":  # the bounded child of _bounded_checks: `--child RELOAD BUNDLE [NOTEBOOK]`
    _, _, _reload, _bundle, *_notebook = sys.argv
    _child(_reload == "1", Path(_bundle), Path(_notebook[0]) if _notebook else None)
