"""check-bundle: a serving bundle is nominated only if it loads and serves the way it was measured.

    report = check_bundle(Path("lab/bundles/s1"), notebook_path=Path("lab/notebook.db"))
    report.ok, [r.messages for r in report.results if r.status == "failed"]

Command (exit 0 when every check passes, 1 when any fails, 2 when DIR is not a directory):

    python run_agent.py check-bundle DIR [--lab LAB]

Checks, each reported with what was expected:
- files: every file a server reads is present;
- serving_config: `serving_config.json` parses (tools.nomination.bundle.ServingConfig);
- template_compiles: `chat_template.jinja` compiles in the Jinja environment transformers itself
  builds (`transformers.utils.chat_template_utils.render_jinja_template`: sandboxed, with its
  `raise_exception` / `strftime_now` globals and its extensions), so `{% raise_exception(...) %}`
  in statement form (an unknown tag) is caught here, not in production;
- template_matches_renderer: it renders byte-identically to `core.chat.render_text` under the
  served system prompt for the conversation shapes of `SHAPES`, add_generation_prompt on and off;
- tokenizer_template: the template in `tokenizer_config.json` and the one AutoTokenizer loads are
  that same file;
- system_prompt, generation_config, stop_ids, max_input_tokens: the system prompt file is non-empty
  and is the served one; generation_config.json carries the served decoding (whose fingerprint is
  the recorded one); every stop id is in
  the vocabulary and the end-of-turn token is one of them; max input tokens is positive;
- weights: every shard the index names exists with its recorded size and sha256, every tensor of
  every shard is in the index (an unindexed tensor would silently load as random weights), no
  safetensors file lies outside the index; for adapters the adapter file's size and sha256;
- adapter_base: the adapter's base is the recorded base path, and its weights hash is the recorded
  revision;
- decision_hash: with a notebook, the evidence's last decision is in its chain;
- reload: loaded as a server loads it (AutoTokenizer; AutoModelForCausalLM, or base + PeftModel;
  the generation config from its file), it answers `PROMPTS` at the served decoding; every answer is
  non-empty and has no U+FFFD, and the answers stop on a stop id as often as the nominee was measured
  to stop (below).

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
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError

from core.chat import EOT_TOKEN, render_text
from core.util import file_sha256
from memory.notebook import Notebook, NotebookError
from tools.nomination.bundle import (
    ADAPTER_CONFIG,
    INDEX,
    MeasuredStops,
    ServingConfig,
    TrainingEvidence,
    measured_stops,
    read_header,
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
               NotebookError)


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


def _json(path: Path) -> dict:
    """A bundle JSON file; a broken one raises ValueError naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path.name}: not valid JSON ({err})") from None


class _Bundle:
    """The parsed files of one bundle, read once."""

    def __init__(self, path: Path, serving: ServingConfig):
        self.path = path
        self.serving = serving
        self.template = (path / serving.chat_template_file).read_text(encoding="utf-8")
        self.system_prompt = (path / serving.system_prompt_file).read_text(encoding="utf-8")


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


def check_template_matches(b: _Bundle) -> list[str]:
    system = b.serving.decoding.system_prompt or None
    problems = []
    for name, messages in SHAPES:
        for generation in (False, True):
            want = render_text(messages, system, add_generation_prompt=generation)
            try:
                got = _render(b.template, messages, generation)
            except jinja2.TemplateError as err:
                problems.append(f"shape {name!r} (add_generation_prompt={generation}): the template raised {err}")
                continue
            if got != want:
                problems.append(f"shape {name!r} (add_generation_prompt={generation}) {_first_difference(got, want)}")
    if problems:
        return [f"{b.serving.chat_template_file} differs from the training renderer (core.chat.render_text with the "
                f"served system prompt) in {len(problems)} of {2 * len(SHAPES)} renderings; expected byte-identical "
                "output. First: " + problems[0]]
    return []


def check_tokenizer_template(b: _Bundle) -> list[str]:
    from transformers import AutoTokenizer

    problems = []
    config = _json(b.path / "tokenizer_config.json")
    if config.get("chat_template") != b.template:
        problems.append(f"tokenizer_config.json chat_template differs from {b.serving.chat_template_file}; "
                        "expected the same template in both")
    if AutoTokenizer.from_pretrained(b.path).chat_template != b.template:
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
    want = {"eos_token_id": list(d.stop_token_ids), "max_new_tokens": d.max_new_tokens,
            "do_sample": not d.greedy, "repetition_penalty": d.repetition_penalty}
    if not d.greedy:
        want |= {"temperature": d.temperature, "top_p": d.top_p}
    got = {k: gen.get(k, False if k == "do_sample" else None) for k in want}
    got["eos_token_id"] = [eos] if isinstance(eos, int) else eos
    problems = [f"generation_config.json {k} is {got[k]!r}; expected {v!r} (the served decoding)"
                for k, v in want.items() if got[k] != v]
    if b.serving.decoding_sha256 != d.fingerprint():
        problems.append(f"serving_config.json decoding_sha256 is {b.serving.decoding_sha256}; expected the "
                        f"fingerprint of its decoding, {d.fingerprint()} (the decoding was edited)")
    return problems


def check_stop_ids(b: _Bundle) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(b.path)
    vocab = len(tokenizer)
    stops = list(b.serving.decoding.stop_token_ids)
    problems = [f"stop id {s} is not in the vocabulary (ids 0..{vocab - 1}); expected ids of real tokens"
                for s in stops if not 0 <= s < vocab]
    eot = tokenizer.convert_tokens_to_ids(EOT_TOKEN)
    if eot not in stops:
        problems.append(f"the end-of-turn token {EOT_TOKEN} (id {eot}) is not a stop id {stops}; expected it among "
                        "them, or answers run past the end of the turn")
    return problems


def check_max_input_tokens(b: _Bundle) -> list[str]:
    n = b.serving.max_input_tokens
    return [] if n > 0 else [f"serving_config.json max_input_tokens is {n}; expected a positive number"]


def _shard_problems(b: _Bundle) -> list[str]:
    """The index against the shards: every named shard recorded and present, every shard named, and
    every tensor of a shard mapped to it (and only tensors it holds)."""
    weight_map: dict[str, str] = _json(b.path / INDEX).get("weight_map", {})
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
    problems = []
    for name, want in sorted(b.serving.weights.files.items()):
        path = b.path / name
        if not path.is_file():
            problems.append(f"{name} is missing; expected {want.bytes} bytes")
        elif path.stat().st_size != want.bytes or file_sha256(path) != want.sha256:
            problems.append(f"{name} is {path.stat().st_size} bytes with sha256 {file_sha256(path)[:16]}...; expected "
                            f"{want.bytes} bytes with sha256 {want.sha256[:16]}... (truncated or changed)")
    if problems:
        return problems
    if b.serving.weights.kind == "full":
        return _shard_problems(b)
    return []


def check_adapter_base(b: _Bundle) -> list[str]:
    from trainers.common import weights_sha256

    base = b.serving.weights.base
    adapter = _json(b.path / ADAPTER_CONFIG)
    named = adapter.get("base_model_name_or_path")
    if named is None or Path(named).resolve() != Path(base.path).resolve():
        return [f"{ADAPTER_CONFIG} base_model_name_or_path is {named!r}; expected the recorded base {base.path}"]
    if not (Path(base.path) / "config.json").is_file():
        return [f"the recorded base {base.path} is not a model directory; expected it present at that path"]
    revision = weights_sha256(Path(base.path))
    if revision != base.revision:
        return [f"the base at {base.path} has weights hash {revision}; expected the recorded revision {base.revision}"]
    return []


def check_decision_hash(b: _Bundle, notebook_path: Path) -> list[str]:
    evidence = TrainingEvidence.model_validate_json((b.path / "training_evidence.json").read_text(encoding="utf-8"))
    want = evidence.last_decision
    with Notebook.open(notebook_path, readonly=True) as nb:
        found = [d for d in nb.decisions(evidence.session) if d.seq == want.seq]
    if not found:
        return [f"decision {want.seq} of session {evidence.session} is not in {notebook_path}; expected the "
                "evidence's last decision in the notebook's chain"]
    if found[0].hash != want.hash:
        return [f"decision {want.seq} in {notebook_path} has hash {found[0].hash}; the evidence records {want.hash}"]
    return []


# ---- reload ----------------------------------------------------------------------------------------


def _load_model(b: _Bundle):
    from transformers import AutoModelForCausalLM

    if b.serving.weights.kind == "full":
        return AutoModelForCausalLM.from_pretrained(b.path).eval()
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(b.serving.weights.base.path)
    return PeftModel.from_pretrained(base, b.path).eval()


def reload_answers(b: _Bundle) -> list[Answer]:
    """The bundle loaded as a server loads it, answering PROMPTS at the served decoding."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(b.path)
    model = _load_model(b)
    generation = GenerationConfig.from_pretrained(b.path)
    stops = set(b.serving.decoding.stop_token_ids)
    torch.manual_seed(0)  # sampled decoding: the same bundle gives the same answers
    answers = []
    for prompt in PROMPTS:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], return_tensors="pt",
                                               add_generation_prompt=b.serving.add_generation_prompt, return_dict=True)
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


def reload_stops(b: _Bundle, notebook_path: Path | None) -> MeasuredStops | None:
    """The nominee's measured stops at the bundle's decoding: from the notebook when given, else as the bundle's
    evidence recorded them when it was written (None for a bundle from before they were recorded)."""
    evidence = TrainingEvidence.model_validate_json((b.path / "training_evidence.json").read_text(encoding="utf-8"))
    if notebook_path is None:
        return evidence.stops
    with Notebook.open(notebook_path, readonly=True) as nb:
        return measured_stops(nb, evidence.session, evidence.nominee, b.serving.decoding_sha256)


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


def answer_problems(answers: list[Answer], max_new_tokens: int,
                    measured: MeasuredStops | None = None) -> tuple[list[str], list[str]]:
    """The reload's failures, and what it tolerated (unstopped answers its measured stop rate explains)."""
    problems = []
    for a in answers:
        if not a.text.strip():
            problems.append(f"answer to {a.prompt!r} is empty; expected text before the stop id")
        if "\ufffd" in a.text:
            problems.append(f"answer to {a.prompt!r} contains U+FFFD (broken byte decoding): {a.text!r}")
    ok, why = stop_verdict(answers, max_new_tokens, measured)
    if not ok:
        problems.insert(0, why)
    return problems, [why] if ok and why else []


# ---- running ---------------------------------------------------------------------------------------


def _run(name: str, fn, *args) -> CheckResult:
    try:
        problems = fn(*args)
    except LOAD_ERRORS as err:
        problems = [f"{type(err).__name__}: {err}"]
    return CheckResult(name=name, status="failed" if problems else "passed", messages=problems)


def _skipped(name: str, why: str) -> CheckResult:
    return CheckResult(name=name, status="skipped", messages=[why])


def _why(err: OSError | ValidationError) -> str:
    if isinstance(err, OSError):
        return f"cannot be read ({err.strerror})"
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = f" (and {err.error_count() - 1} more problems)" if err.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}; expected a serving config as tools.nomination.bundle writes it"


def _missing(path: Path, serving: ServingConfig | None) -> list[str]:
    """Files a server reads that are not in the bundle (those serving_config.json names included)."""
    names = list(REQUIRED)
    if serving is not None:
        names += [serving.chat_template_file, serving.system_prompt_file, *serving.weights.files]
        names += ["config.json", INDEX] if serving.weights.kind == "full" else [ADAPTER_CONFIG]
    return [f for f in dict.fromkeys(names) if not (path / f).is_file()]


def _parse(path: Path) -> tuple[list[CheckResult], _Bundle | None]:
    """The files and serving_config checks; the parsed bundle when both pass."""
    try:
        serving = ServingConfig.model_validate_json((path / "serving_config.json").read_text(encoding="utf-8"))
        parsed = CheckResult(name="serving_config", status="passed", messages=[])
    except (OSError, ValidationError) as err:
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
        return [files, parsed], None


def check_bundle(path: str | Path, notebook_path: str | Path | None = None) -> BundleReport:
    """Run every check on the bundle at `path` (and the decision-hash check against `notebook_path`)."""
    path = Path(path)
    results, b = _parse(path)
    if b is None:
        return BundleReport(bundle=str(path), results=results, answers=[])
    results += [
        _run("template_compiles", check_template_compiles, b),
        _run("system_prompt", check_system_prompt, b),
        _run("generation_config", check_generation_config, b),
        _run("stop_ids", check_stop_ids, b),
        _run("max_input_tokens", check_max_input_tokens, b),
        _run("weights", check_weights, b),
    ]
    compiled = results[2].status == "passed"
    results.append(_run("template_matches_renderer", check_template_matches, b) if compiled
                   else _skipped("template_matches_renderer", "the template does not compile"))
    results.append(_run("tokenizer_template", check_tokenizer_template, b))
    if b.serving.weights.kind == "adapter":
        results.append(_run("adapter_base", check_adapter_base, b))
    if notebook_path is not None:
        results.append(_run("decision_hash", check_decision_hash, b, Path(notebook_path)))
    answers: list[Answer] = []
    blocked = [r.name for r in results if r.status == "failed"
               and r.name in ("template_compiles", "weights", "adapter_base", "stop_ids")]
    if blocked:
        results.append(_skipped("reload", f"not attempted: {', '.join(blocked)} failed"))
    else:
        answers, result = check_reload(b, None if notebook_path is None else Path(notebook_path))
        results.append(result)
    return BundleReport(bundle=str(path), results=results, answers=answers)


def check_reload(b: _Bundle, notebook_path: Path | None) -> tuple[list[Answer], CheckResult]:
    """The reload check: its answers, and its result (what a pass tolerated among the messages)."""
    try:
        measured = reload_stops(b, notebook_path)
    except LOAD_ERRORS as err:  # read before loading the model: a broken evidence file is named as such
        return [], CheckResult(name="reload", status="failed", messages=[
            f"training_evidence.json: the nominee's measured stops cannot be read: {type(err).__name__}: {err}"])
    try:
        answers = reload_answers(b)
    except LOAD_ERRORS as err:
        return [], CheckResult(name="reload", status="failed", messages=[
            f"the bundle does not load and generate as a server would: {type(err).__name__}: {err}"])
    problems, tolerated = answer_problems(answers, b.serving.decoding.max_new_tokens, measured)
    return answers, CheckResult(name="reload", status="failed" if problems else "passed",
                                messages=problems or tolerated)


def print_report(report: BundleReport) -> None:
    out = sys.stdout  # read at call time: a caller (or a test) may have redirected it
    for r in report.results:
        label = {"passed": "ok     ", "failed": "FAILED ", "skipped": "skipped"}[r.status]
        print(f"  {label} {r.name}" + (f": {r.messages[0]}" if r.messages else ""), file=out)
        for extra in r.messages[1:]:
            print(f"          {' ' * len(r.name)}  {extra}", file=out)
    failed = len(report.failures())
    verdict = "passes every check" if report.ok else f"FAILS {failed} of {len(report.results)} checks"
    print(f"{report.bundle}: {verdict}", file=out)


def check_bundle_command(bundle: Path, lab: Path | None) -> int:
    """The CLI: print every check; 0 if all pass, 1 if any fails, 2 for a DIR or notebook that is not there."""
    if not bundle.is_dir():
        print(f"error: check-bundle: {bundle} is not a directory", file=sys.stderr)
        return 2
    notebook = None if lab is None else lab / "notebook.db"
    if notebook is not None and not notebook.is_file():
        print(f"error: check-bundle: --lab {lab}: no notebook.db there", file=sys.stderr)
        return 2
    try:
        report = check_bundle(bundle, notebook)
    except NotebookError as err:
        print(f"error: check-bundle: {err}", file=sys.stderr)
        return 2
    print_report(report)
    return 0 if report.ok else 1
