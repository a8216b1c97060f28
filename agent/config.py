"""The lab configuration: `lab.toml` parsed once into typed models, and the `--budget` string.

A lab directory holds `lab.toml`; every path in it is relative to that directory. Loading is strict
and refuses, with one message naming the file, the key and what was expected (`LabConfigError`):

- a lab.toml that cannot be read (a directory, a dangling symlink, a symlink loop, not UTF-8),
  nesting deeper than MAX_TOML_DEPTH, NaN or infinite numbers;
- wrong types without coercion (pydantic strict mode: `true` is no integer, `"0.1"` no float,
  `"yes"` no bool), unknown keys, missing keys;
- paths that are not what they must be: empty, missing, a directory where a file belongs (or the
  reverse), a model directory without a parseable `config.json` naming its `model_type`, or
  without a tokenizer where one is needed;
- a model directory whose own files are out of bounds (core/loading.py model_dir_problems): a config.json size or
  count that is not an integer in its range (a list where an int belongs, a string vocab_size, 50 million layers,
  absurd expert counts), remote code (`auto_map`, Python files), pickled weights, a safetensors header whose
  length, entries or tensors do not describe its file, or weights of more than MAX_PARAMS parameters;
- anything that looks like a secret, in any key or value (API keys such as sk-/ghp_/xox*/AKIA...,
  "Bearer ..." tokens, private keys, URLs with user:password@). The value is never echoed, so it
  reaches neither the terminal nor the notebook. API keys live in the environment: `api_key_env`
  names the variable;
- Slurm values that could add their own `#SBATCH` line: partition, account and qos are plain
  Slurm names, and each `extra_sbatch` entry is one `--option[=value]` without whitespace whose
  option is one of SBATCH_ALLOWED, by its full name (none overrides what the launcher sets itself:
  partition, time, resources, log paths; sbatch would read an abbreviation as the whole option);
- job resources past any machine (tools/jobs/executor.py: MAX_TIME_LIMIT_MIN, MAX_GPUS_PER_NODE, ...);
  what the partition's nodes or this host have is checked before a session opens (agent/inputs.py).

`[train]` holds the user's training recipe (trainers/recipe.py: per trainer family the method, LoRA, learning rate
and its range, schedule, steps, batches, lengths and the family's own knobs); keys left out are derived from the base
model's config.json by the rules table there, never the toy world's numbers.

Two optional entries feed the model card only: `[model] license` (the base model's license; default: the
`license:` of the base directory's README.md front matter) and `[truth]` (a ground-truth scorer of the
nominee, run after the sealed confirmation and never shown to the planner; tools/ground_truth.py).

    cfg = load_lab_config(Path("lab"))      # reads lab/lab.toml
"""

from __future__ import annotations

import math
import re
import tomllib
from itertools import takewhile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    model_serializer,
    model_validator,
)

from core.display import bounded, shown
from core.jsonl import JSONLineError, describe_non_file, loads
from core.loading import CONFIG_FILE_LIMIT, MAX_PARAMS, model_dir_problems
from core.redact import secret_kind
from core.util import parse_file_mode
from evals.decoding import Decoding
from memory.records import TRUTH_N_MAX, TRUTH_N_MIN
from tools.jobs.executor import ExecutorSection, SlurmSection
from trainers.recipe import VERIFYING_SCORERS, TrainRecipe, TrainSection, model_shape, resolve

LAB_FILE = "lab.toml"
MAX_TOML_DEPTH = 8  # the deepest legitimate key, executor.slurm.extra_sbatch[i], is 4 levels down


class LabConfigError(Exception):
    """lab.toml (or a CLI flag) is not what the lab needs; the message names the file and key."""


class BudgetError(ValueError):
    """A --budget string that is not one of the accepted forms."""


MIN_BUDGET_GPUH = 1 / 60  # one GPU-minute: less cannot pay for a single job
MAX_BUDGET_GPUH = 1_000_000.0  # ~114 GPU-years; more is a typo, not a session
BUDGET_FORMS = ("accepted forms: GPU-hours like 60gpuh or 0.5gpuh, or GPU-minutes like 90gpum (ASCII digits, "
                "no spaces), from 1gpum up to 1000000gpuh")
_BUDGET_RE = re.compile(r"(?P<value>[0-9]{1,7}(?:\.[0-9]{1,6})?)(?P<unit>gpuh|gpum)", re.ASCII)


def parse_budget(text: str) -> float:
    """'60gpuh' -> 60.0, '90gpum' -> 1.5 (GPU-hours); anything else raises BudgetError.

    ASCII digits only: Python's `\\d` and `float()` also take other scripts' digits ('٦٠gpuh')."""
    match = _BUDGET_RE.fullmatch(text)
    if not match:
        raise BudgetError(f"--budget {text!r} is not a GPU budget; {BUDGET_FORMS}")
    value = float(match["value"]) / (60.0 if match["unit"] == "gpum" else 1.0)
    if not MIN_BUDGET_GPUH <= value <= MAX_BUDGET_GPUH:
        raise BudgetError(f"--budget {text!r} is outside the accepted range: at least 1gpum "
                          f"({MIN_BUDGET_GPUH:.4f} GPU-hours), at most {MAX_BUDGET_GPUH:.0f}gpuh; {BUDGET_FORMS}")
    return value


# ---- paths ---------------------------------------------------------------------------------------


def _path_text(value: Any) -> Path:
    """lab.toml paths are non-empty strings; strict mode would refuse a str for a Path field."""
    if not isinstance(value, str):
        raise ValueError(f"expected a path string, got {type(value).__name__}")
    if not value.strip() or "\0" in value:
        raise ValueError("expected a path, got an empty string" if not value.strip() else "a path cannot hold NUL")
    return Path(value)


def _resolve(value: Path, info: ValidationInfo) -> Path:
    root = Path((info.context or {}).get("lab_dir", "."))
    return value if value.is_absolute() else root / value


def _a_file(value: Path, info: ValidationInfo) -> Path:
    resolved = _resolve(value, info)
    why = describe_non_file(resolved)
    if why is not None:
        raise ValueError(f"path {str(value)!r} {why} (expected a file; looked for {resolved})")
    return resolved


def _a_text_file(value: Path, info: ValidationInfo) -> Path:
    resolved = _a_file(value, info)
    data = resolved.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"path {str(value)!r}: line {line} is not valid UTF-8 (byte 0x{data[e.start]:02x}); "
                         "expected UTF-8 text") from None
    return resolved


def _a_dir(value: Path, info: ValidationInfo) -> Path:
    resolved = _resolve(value, info)
    if not resolved.is_dir():
        what = "does not exist" if not resolved.exists() else "is not a directory"
        raise ValueError(f"path {str(value)!r} {what} (expected a directory; looked for {resolved})")
    return resolved


def _a_model_dir(value: Path, info: ValidationInfo) -> Path:
    """A transformers model directory: config.json that parses as an object naming its model_type."""
    resolved = _a_dir(value, info)
    config = resolved / "config.json"
    why = describe_non_file(config)
    if why is not None:
        raise ValueError(f"path {str(value)!r} is no model directory: its config.json {why}")
    if config.stat().st_size > CONFIG_FILE_LIMIT:
        raise ValueError(f"path {str(value)!r}: config.json: {config.stat().st_size} bytes; expected a config file of "
                         f"at most {CONFIG_FILE_LIMIT} bytes")
    try:
        parsed = loads(config.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, JSONLineError) as e:
        raise ValueError(f"path {str(value)!r}: config.json does not parse ({e})") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("model_type"), str):
        raise ValueError(f"path {str(value)!r}: config.json names no `model_type` (not a loadable transformers config)")
    # The model's own files are inputs too: read bounded, before anything hands them to transformers.
    problems = model_dir_problems(resolved)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"path {str(value)!r}: {problems[0]}{more}")
    return resolved


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _a_tokenizer_dir(value: Path, info: ValidationInfo) -> Path:
    resolved = _a_dir(value, info)
    if not has_tokenizer(resolved):
        raise ValueError(f"path {str(value)!r} holds no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return resolved


_PathStr = BeforeValidator(_path_text)
LabFile = Annotated[Path, _PathStr, AfterValidator(_a_file)]
TextFile = Annotated[Path, _PathStr, AfterValidator(_a_text_file)]
ModelDir = Annotated[Path, _PathStr, AfterValidator(_a_model_dir)]
TokenizerDir = Annotated[Path, _PathStr, AfterValidator(_a_tokenizer_dir)]


# ---- names and Slurm values ----------------------------------------------------------------------

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", re.ASCII)
_SLURM_WORD_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.,:+@-]{0,127}", re.ASCII)
_SBATCH_RE = re.compile(r"--(?P<key>[a-z][a-z0-9_-]*)(?:=(?P<value>[!-~]+))?", re.ASCII)
# The sbatch options extra_sbatch may pass, by their full names: each chooses or restricts the nodes a job runs on,
# delays it, or labels it; none changes what the launcher sets or reads (partition, account, resources, tasks, time,
# signals, requeue policy aside, the environment, the logs). An allow-list rather than a list of the reserved names:
# sbatch reads its options with getopt_long, which takes any unambiguous prefix of a long option (`--arr=` is
# `--array`, `--ch=` `--chdir`: both passed the reserved-name check), and a reserved list misses options the launcher
# relies on (--gres, --gpus, --ntasks, --mem-per-cpu, --export, --hold, --wait, ...) and those later Slurm versions
# add. Exact names from a fixed list leave no prefix and no new option to reason about. `requeue` is here because the
# launcher admits a requeued run as a new attempt (tools/jobs/launcher.py); `begin` delays a job, which the pending
# report then names.
SBATCH_ALLOWED = frozenset({
    "constraint", "prefer", "exclusive", "reservation", "nodelist", "exclude", "switches", "licenses", "hint",
    "tmp", "core-spec", "thread-spec", "sockets-per-node", "cores-per-socket", "threads-per-core", "gpu-bind",
    "gpu-freq", "cpu-freq", "mem-bind", "network", "begin", "requeue", "nice", "comment", "wckey", "mail-type",
    "mail-user", "mcs-label", "acctg-freq", "profile"})
# Options the launcher sets itself (tools/jobs/launcher.py) or that would move the logs it reads: named as such when
# lab.toml gives one of them, or an abbreviation of one.
_RESERVED_SBATCH = ("partition", "account", "qos", "time", "job-name", "nodes", "ntasks-per-node", "gpus-per-node",
                    "cpus-per-task", "mem", "signal", "output", "error", "array", "wrap", "chdir", "open-mode",
                    "no-requeue")


def _name(value: str) -> str:
    if not _NAME_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a name: use 1-64 ASCII letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit (names become file names)")
    return value


def _slurm_word(value: str) -> str:
    if not _SLURM_WORD_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not a Slurm name: ASCII letters, digits and _ . , : + @ - only "
                         "(no spaces, newlines or '#', which could add an #SBATCH line)")
    return value


def _flag(line: str) -> str:
    return line.removeprefix("#SBATCH ").lstrip(" ") if line.startswith("#SBATCH ") else line


def _sbatch_line(line: str) -> str:
    flag = _flag(line)
    match = _SBATCH_RE.fullmatch(flag)
    if match is None or "#" in flag:
        raise ValueError(f"{line!r} is not one long option like '--constraint=h100' (no whitespace, newlines or '#')")
    key = match["key"].replace("_", "-")
    if key in SBATCH_ALLOWED:
        return line
    if key in _RESERVED_SBATCH:
        raise ValueError(f"{line!r}: --{key} is set by the launcher from [executor] / [executor.slurm]; "
                         "it cannot be overridden here")
    meant = [r for r in _RESERVED_SBATCH if r.startswith(key)]
    if meant:  # sbatch (getopt_long) reads an unambiguous prefix as the whole option
        raise ValueError(f"{line!r}: --{key} abbreviates --{meant[0]}, which the launcher sets from [executor] / "
                         "[executor.slurm]; it cannot be overridden here")
    raise ValueError(f"{line!r}: --{key} is not among the sbatch options extra_sbatch may pass; expected one of "
                     f"{', '.join(sorted(SBATCH_ALLOWED))}, by its full name")


def _sbatch_lines(lines: list[str]) -> list[str]:
    keys = [_SBATCH_RE.fullmatch(_flag(line))["key"].replace("_", "-") for line in lines]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"option --{repeated[0]} is given twice")
    return lines


def _http_url(value: str) -> str:
    if not re.fullmatch(r"https?://[^\s/?#@]+(?:[/?#]\S*)?", value, re.ASCII):
        raise ValueError("expected an http:// or https:// URL without spaces, e.g. http://127.0.0.1:8000/v1")
    return value


def _env_name(value: str) -> str:
    # Never echo the value: a key pasted here by mistake is exactly what must not be shown.
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", value, re.ASCII):
        raise ValueError("expected the NAME of an environment variable (letters, digits, '_'), not its value")
    return value


Name = Annotated[str, AfterValidator(_name)]
SlurmWord = Annotated[str, AfterValidator(_slurm_word)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class LabSlurmSection(SlurmSection):
    """[executor.slurm] as lab.toml may write it: the launcher's settings with values that cannot inject."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    partition: SlurmWord = Field(description="Slurm partition jobs are submitted to (comma-separated for several).")
    account: SlurmWord | None = Field(None, description="Slurm account to charge.")
    qos: SlurmWord | None = Field(None, description="Slurm quality of service.")
    extra_sbatch: Annotated[list[Annotated[str, AfterValidator(_sbatch_line)]], AfterValidator(_sbatch_lines)] = Field(
        default_factory=list, description="Extra sbatch options, one `--option[=value]` each (an `#SBATCH ` prefix is allowed).")


class LabExecutorSection(ExecutorSection):
    """[executor] of lab.toml: the launcher's ExecutorSection, strict, with a checked Slurm section."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    slurm: LabSlurmSection | None = Field(None, description="Slurm parameters; required when kind = 'slurm'.")


def _license_text(value: str) -> str:
    if not value.strip() or len(value) > 200 or any(c in value for c in "\n\r\0"):
        raise ValueError("expected the base model's license as one line of 1-200 characters, e.g. 'apache-2.0' "
                         "(an SPDX identifier, as model repositories declare it)")
    return value.strip()


class ModelSection(_Section):
    base: ModelDir = Field(description="Local directory of the base model (any transformers causal LM).")
    parent: ModelDir | None = Field(None, description="Checkpoint the session starts from (stage-1 parent); defaults to base.")
    tokenizer: TokenizerDir | None = Field(None, description="Tokenizer directory when it is not inside the model directory.")
    license: Annotated[str, AfterValidator(_license_text)] | None = Field(
        None, description="The base model's license (e.g. 'apache-2.0'); default: the `license:` of the base "
                          "directory's README.md front matter, else shown as not declared.")

    @model_validator(mode="after")
    def _tokenizer_somewhere(self) -> ModelSection:
        if self.tokenizer is None and not has_tokenizer(self.base):
            raise ValueError(f"base: {self.base} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); "
                             "add one or set `tokenizer` to the directory that has it")
        return self

    @model_validator(mode="after")
    def _shape_in_bounds(self) -> ModelSection:
        # Each size within its bound can still multiply past any model (4096 experts of the widest MLP in every one
        # of 1024 layers): the estimate the rules and the memory admission use must describe a trainable model.
        total = model_shape(self.base).params_total
        if total > MAX_PARAMS:
            raise ValueError(f"base: {self.base / 'config.json'} describes a model of {total:.3g} parameters (layers x "
                             f"experts x widths); expected at most {MAX_PARAMS:.0e}")
        return self


class FeedbackSection(_Section):
    file: LabFile = Field(description="Battles file: JSONL (or Parquet) in the documented feedback format.")
    dev_fraction: float = Field(0.1, gt=0, lt=1, description="Share of battles held out for selection (dev holdout).")
    sealed_fraction: float = Field(0.1, gt=0, lt=1, description="Share sealed for the one-time confirmation of the nominee.")
    stratify_by: str | None = Field(None, min_length=1, description="Optional meta tag to stratify splits by, on top of the vote.")
    reserve_fraction: float = Field(
        0.0, ge=0, lt=1, description="Share held in reserve: more holdout prompts, never trained on and never read "
        "until a comparison its dev holdout leaves unresolved draws them for its last look (0: no reserve).")

    @model_validator(mode="after")
    def _train_left(self) -> FeedbackSection:
        if self.dev_fraction + self.sealed_fraction >= 0.9:
            raise ValueError("dev_fraction + sealed_fraction must leave at least 10% of battles for training")
        if self.dev_fraction + self.sealed_fraction + self.reserve_fraction >= 0.9:
            raise ValueError(f"reserve_fraction = {self.reserve_fraction:g}: dev_fraction + sealed_fraction + "
                             "reserve_fraction must leave at least 10% of battles for training")
        return self

    @model_serializer(mode="wrap")
    def _without_no_reserve(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumped without `reserve_fraction` when there is none: a session's recorded lab.toml (what resume compares
        the lab with) stays what it was before the key."""
        return {k: v for k, v in handler(self).items() if k != "reserve_fraction" or v}


class DataSource(_Section):
    name: Name = Field(description="Short name used in dataset recipes and the notebook.")
    path: LabFile = Field(description="kind 'chat': JSONL or Parquet file of chat rows with a `messages` column; "
                                      "kind 'verified': JSONL of eval items (prompt plus gold, choices or constraints).")
    cap: int | None = Field(None, gt=0, description="Most rows taken from this source in one replay mix.")
    kind: Literal["chat", "verified"] = Field(
        "chat", description="'chat': replay data; 'verified': a pool of checkable items for RFT, apart from the eval "
        "suites (leak-audited against them when a dataset is drawn from it).")
    verifier: Name | None = Field(None, description="kind 'verified': the [[evals]] suite whose scorer verifies "
                                                    "answers to these items (the eval scorer is the reward).")

    @model_validator(mode="after")
    def _verifier_for_verified(self) -> DataSource:
        if (self.kind == "verified") != (self.verifier is not None):
            raise ValueError("a [[data]] pool of kind 'verified' needs `verifier` (an [[evals]] suite name), and "
                             "only such a pool takes one")
        return self


class EvalSuite(_Section):
    name: Name = Field(description="Suite name as it appears in bars and the notebook.")
    scorer: Literal[
        "math", "mcq", "constraints", "loops", "length_stop", "battle_margin", "reward_proxy", "judge", "synthetic",
    ] = Field(description="Scorer that grades this suite (one file in evals/).")
    file: LabFile | None = Field(None, description="Items file (JSONL); holdout-battle scorers read the dev split instead.")
    sealed: bool = Field(False, description="Sealed confirmation suite: scored once per session, for the nominee only.")
    replicates: int = Field(3, ge=3, description="K replicates of the incumbent used to calibrate this suite's noise floor.")
    constraint_mode: Literal["plain", "ifeval"] = Field(
        "plain", description="constraints suites only: 'plain' (the instructions' plain meaning, the default) or "
        "'ifeval' (the IFEval reference's exact semantics, for IFEval-comparable numbers).")

    @model_validator(mode="after")
    def _mode_for_constraints(self) -> EvalSuite:
        if self.constraint_mode != "plain" and self.scorer != "constraints":
            raise ValueError(f"constraint_mode applies to constraints suites only (this suite's scorer is {self.scorer})")
        return self


class EndpointSection(_Section):
    """An OpenAI-compatible endpoint; the key is read from the named environment variable."""

    base_url: Annotated[str, AfterValidator(_http_url)] | None = Field(
        None, description="Endpoint base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str | None = Field(None, min_length=1, description="Model name sent with each request.")
    api_key_env: Annotated[str, AfterValidator(_env_name)] = Field(
        "OPENAI_API_KEY", description="Environment variable that holds the API key (its name, never the key).")


class PlannerSection(EndpointSection):
    kind: Literal["playbook", "openai"] = Field("playbook", description="Deterministic playbook or an LLM planner.")

    @model_validator(mode="after")
    def _openai_needs_endpoint(self) -> PlannerSection:
        if self.kind == "openai" and not (self.base_url and self.model):
            raise ValueError("kind = 'openai' needs `base_url` and `model`")
        return self


class JudgeSection(EndpointSection):
    kind: Literal["oracle", "openai", "reward_model"] = Field(
        "oracle", description="Toy-world oracle, an OpenAI-compatible judge, or a local reward model."
    )
    path: ModelDir | None = Field(None, description="Reward model directory (sequence-classification checkpoint).")
    concurrency: int = Field(8, ge=1, le=256, description="openai: judgments in flight at once.")
    retries: int = Field(5, ge=0, le=20, description="openai: retries of a judgment after a connection error, a "
                         "timeout, HTTP 429 or 5xx (exponential backoff with jitter; Retry-After honoured).")
    max_error_share: float = Field(0.05, ge=0, le=1, description="openai: share of a suite's items whose judgment may "
                                   "fail after its retries (recorded as failed, not scored); above it the eval job fails.")
    max_unparsed_share: float = Field(0.05, ge=0, le=1, description="openai: share of a suite's items whose judge "
                                      "replies do not parse into a verdict (recorded as unparsed, not scored); above "
                                      "it the eval job fails, with the reason in its recorded failure.")

    @model_validator(mode="after")
    def _kind_needs_its_fields(self) -> JudgeSection:
        if self.kind == "openai" and not (self.base_url and self.model):
            raise ValueError("kind = 'openai' needs `base_url` and `model`")
        if self.kind == "reward_model" and self.path is None:
            raise ValueError("kind = 'reward_model' needs `path`")
        return self


class DecodingSection(_Section):
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="Served sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Served nucleus mass.")
    repetition_penalty: float = Field(1.0, ge=1.0, le=3.0, description="Served repetition penalty; 1.0 is off.")
    max_new_tokens: int = Field(1024, ge=1, description="Served cap on generated tokens.")


class ServingSection(_Section):
    system_prompt_file: TextFile | None = Field(None, description="Text file with the served system prompt.")
    decoding: DecodingSection = Field(default_factory=DecodingSection, description="Served decoding settings.")

    def served_decoding(self, stop_token_ids: tuple[int, ...]) -> Decoding:
        prompt = self.system_prompt_file.read_text(encoding="utf-8").strip() if self.system_prompt_file else ""
        return Decoding(system_prompt=prompt, stop_token_ids=stop_token_ids, **self.decoding.model_dump())


class TruthSection(_Section):
    """[truth]: a noise-free scorer of the nominee against the parent, run after the sealed confirmation.
    Its result goes to the card and the report only, never to the planner (tools/ground_truth.py)."""

    kind: Literal["world"] = Field(description="Scorer: 'world', the oracle of the toy world built in this lab "
                                               "directory (tools/world/truth.py).")
    n: int = Field(300, ge=TRUTH_N_MIN, le=TRUTH_N_MAX, description="Prompts of the fresh sample, drawn apart from every prompt "
                                                       "of the lab and leak-audited against them.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Sample seed.")

    @model_validator(mode="after")
    def _scorer_is_there(self, info: ValidationInfo) -> TruthSection:
        # Imported here: it imports the scorer, which most commands never need.
        from tools.ground_truth import scorer_problem

        problem = scorer_problem(self.kind, Path((info.context or {}).get("lab_dir", ".")))
        if problem is not None:
            raise ValueError(problem)
        return self


class PlaybookSection(_Section):
    recipe: Literal["combined", "aspen", "brook", "delta", "ember", "islet"] = Field(
        "combined", description="The playbook's named policy: the combined playbook, or one seed's recipe "
        "(agent/planners/recipes.py); `--recipe` overrides it.")


class BudgetSection(_Section):
    reserve_fraction: float = Field(
        0.05, ge=0, lt=0.5, description="Share of the session budget kept back for the final nomination checks."
    )


class NominationSection(_Section):
    """[nomination]: what the shipped files (the bundle and the HTML report) are written with."""

    file_mode: Annotated[str, AfterValidator(lambda v: f"{parse_file_mode(v):04o}")] = Field(
        "0644", description="Octal mode, as a string, of every file of a bundle and of the report (directories get "
        "search wherever read is granted: 0644 -> 0755): readable by a server running as another user by default; "
        "\"0640\" keeps them to the group, \"0600\" to the owner. check-bundle checks the bundle grants it.")


class LabConfig(_Section):
    """Everything a lab needs, from `lab.toml`."""

    model: ModelSection = Field(description="Base model and the parent checkpoint to improve.")
    feedback: FeedbackSection = Field(description="Human side-by-side feedback and how it is split.")
    data: list[DataSource] = Field(default_factory=list, description="Local replay/instruction data sources.")
    evals: list[EvalSuite] = Field(default_factory=list, description="Evaluation suites.")
    bars: LabFile | None = Field(None, description="Promotion bars file (TOML), registered before any scoring.")
    executor: LabExecutorSection = Field(default_factory=LabExecutorSection, description="Job engine settings.")
    planner: PlannerSection = Field(default_factory=PlannerSection, description="Who proposes the next step.")
    judge: JudgeSection = Field(default_factory=JudgeSection, description="Pairwise judge for holdout battles.")
    serving: ServingSection = Field(default_factory=ServingSection, description="How the nominee will be served.")
    budget: BudgetSection = Field(default_factory=BudgetSection, description="Budget policy.")
    truth: TruthSection | None = Field(None, description="Ground-truth scorer of the nominee (card and report only).")
    playbook: PlaybookSection = Field(default_factory=PlaybookSection, description="The playbook's named policy.")
    nomination: NominationSection = Field(default_factory=NominationSection, description="Modes of the shipped files.")
    train: TrainSection = Field(default_factory=TrainSection, description="The training recipe: method, LoRA, "
                                "learning rates and their ranges, schedule, batches, lengths, per trainer family; "
                                "keys left out are derived from the base model (trainers/recipe.py).")

    @model_validator(mode="after")
    def _unique_names(self) -> LabConfig:
        for what, names in (("data", [d.name for d in self.data]), ("evals", [e.name for e in self.evals])):
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"[[{what}]] names must be unique; repeated: {', '.join(dupes)}")
        return self

    @model_validator(mode="after")
    def _verifiers_and_reward_model(self) -> LabConfig:
        known = {e.name: e.scorer for e in self.evals}
        for i, d in enumerate(self.data):
            if d.verifier is not None and known.get(d.verifier) not in VERIFYING_SCORERS:
                raise ValueError(f"data[{i}].verifier: {d.verifier!r} is no [[evals]] suite with a verifying scorer "
                                 f"({', '.join(sorted(VERIFYING_SCORERS))})")
        proxies = [e.name for e in self.evals if e.scorer == "reward_proxy"]
        if proxies and self.judge.kind != "reward_model":
            raise ValueError(f"reward_proxy suites ({', '.join(proxies)}) need a reward model: set [judge] kind = "
                             "'reward_model' and its `path`")
        return self

    @model_validator(mode="after")
    def _train_resolves(self) -> LabConfig:
        known = {e.name: e.scorer for e in self.evals}
        for name in self.train.rft.verifiers or []:
            if known.get(name) not in VERIFYING_SCORERS:
                what = f"its scorer {known[name]} verifies nothing" if name in known else "no [[evals]] suite has it"
                raise ValueError(f"train.rft.verifiers: {name!r} cannot verify RFT samples ({what}; expected a suite "
                                 f"scored by {', '.join(sorted(VERIFYING_SCORERS))})")
        self.train_recipe()  # a derived value that cannot hold (a max_len past the context) is refused at load
        return self

    def train_recipe(self) -> TrainRecipe:
        """[train] settled for every trainer family: what the file says, else the rules over the base model."""
        verifiers = [e.name for e in self.evals if e.scorer in VERIFYING_SCORERS and not e.sealed and e.file is not None]
        return resolve(self.train, model_shape(self.model.base), verifiers)


LICENSE_NOT_DECLARED = "not declared"


def base_license(model: ModelSection) -> tuple[str | None, str]:
    """The base model's license and where it was read: lab.toml's [model] license, else the `license:` key
    of the base directory's README.md front matter (how model repositories declare it), else (None,
    'not declared')."""
    if model.license is not None:
        return model.license, f"{LAB_FILE} [model] license"
    readme = model.base / "README.md"
    found = front_matter_license(readme.read_text(encoding="utf-8", errors="replace")) if readme.is_file() else None
    return (found, f"{readme} front matter") if found else (None, LICENSE_NOT_DECLARED)


def front_matter_license(text: str) -> str | None:
    """`license:` of a README's YAML front matter (`license: mit`, or a list of `- id` lines below it)."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    body = lines[1:next((i for i, line in enumerate(lines[1:], 1) if line.strip() in ("---", "...")), len(lines))]
    for i, line in enumerate(body):
        key, sep, value = line.partition(":")
        if sep and key == "license":
            items = [value] if value.strip() else list(takewhile(lambda x: x.strip().startswith("-"), body[i + 1:]))
            names = [x.strip().removeprefix("-").strip().strip("'\"") for x in items]
            return ", ".join(n for n in names if n)[:200] or None
    return None


def load_lab_config(lab_dir: Path) -> LabConfig:
    """Read and validate `lab_dir/lab.toml`; raise LabConfigError with every problem it finds."""
    path = lab_dir / LAB_FILE
    raw = _read_toml(path)
    problems = scan_raw(raw)
    if problems:  # before pydantic, whose messages would echo the offending values
        listed = bounded([shown(p, limit=500) for p in problems])  # a problem per key of a huge file: the first 20
        raise LabConfigError(f"{path}: {len(problems)} problem(s):\n" + "\n".join(f"  {p}" for p in listed))
    try:
        return LabConfig.model_validate(raw, strict=True, context={"lab_dir": lab_dir})
    except ValidationError as exc:
        raise LabConfigError(format_validation_error(path, exc)) from None


def _read_toml(path: Path) -> dict[str, Any]:
    why = describe_non_file(path)
    if why == "does not exist":
        raise LabConfigError(f"{path}: no such file (a lab directory needs a {LAB_FILE})")
    if why is not None:  # never "no lab.toml, so the toy world": the user meant this lab
        raise LabConfigError(f"{path}: {why} (expected a readable {LAB_FILE})")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise LabConfigError(f"{path}: line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x}); "
                             f"{LAB_FILE} must be UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LabConfigError(f"{path}: not valid TOML: {exc}") from None
    except ValueError as exc:  # tomllib's int() past Python's 4300-digit limit
        raise LabConfigError(f"{path}: not valid TOML: {exc.args[0].split(':')[0]} (TOML integers are 64-bit)") from None
    except RecursionError:
        raise LabConfigError(f"{path}: nested too deeply (a {LAB_FILE} is at most {MAX_TOML_DEPTH} levels deep)") from None


# Shapes of credentials (core/redact.py, the same shapes redacted from every message), so that one
# pasted into any field is refused (and never echoed).


def scan_raw(raw: dict[str, Any]) -> list[str]:
    """Problems pydantic cannot be trusted with: secrets (never echoed), non-finite or out-of-range numbers, depth."""
    problems, stack = [], [((), raw)]
    while stack:
        loc, node = stack.pop()
        if len(loc) >= MAX_TOML_DEPTH:
            problems.append(f"{_key(loc)}: nested more than {MAX_TOML_DEPTH} levels deep")
            continue
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            where = _key((*loc, key))
            if isinstance(key, str) and secret_kind(key):
                problems.append(f"{_key(loc)}: a key looks like {secret_kind(key)}; {_SECRET_ADVICE}")
            elif isinstance(child, str) and secret_kind(child):
                problems.append(f"{where}: the value looks like {secret_kind(child)} (not shown); {_SECRET_ADVICE}")
            elif isinstance(child, float) and not math.isfinite(child):
                problems.append(f"{where}: {child} is not a finite number")
            elif isinstance(child, int) and not -(2**63) <= child < 2**63:
                problems.append(f"{where}: an integer of {len(str(abs(child)))} digits is out of range (TOML integers are 64-bit)")
            else:
                stack.append(((*loc, key), child))
    return sorted(problems)


_SECRET_ADVICE = ("secrets never go in lab.toml: put the key in an environment variable and name it with "
                  "`api_key_env`; keep credentials out of URLs")


def format_validation_error(path: Path, exc: ValidationError) -> str:
    """One message: the file, then one line per problem with its key and what was expected."""
    listed = bounded([shown(f"{_key(err['loc'])}: {_expected(err)}", limit=500) for err in exc.errors()])
    return "\n".join([f"{path}: {exc.error_count()} problem(s):", *(f"  {p}" for p in listed)])


def _key(loc: tuple[Any, ...]) -> str:
    parts = []
    for item in loc:
        if isinstance(item, int):
            parts[-1] = f"{parts[-1]}[{item}]" if parts else f"[{item}]"
        else:
            parts.append(str(item))
    return ".".join(parts) or "(top level)"


def _expected(err: dict[str, Any]) -> str:
    kind, got = err["type"], err.get("input")
    if kind == "extra_forbidden" and err["loc"][-1] in ("api_key", "key", "token", "password", "secret"):
        return _SECRET_ADVICE
    if kind == "extra_forbidden":
        return "unknown key (not part of the lab.toml format; check its spelling)"
    if kind == "missing":
        return "required key is missing"
    message = err["msg"].removeprefix("Value error, ")
    if isinstance(got, (str, int, float, bool)) and kind not in ("value_error",):
        shown = got if not isinstance(got, str) or len(got) <= 80 else got[:80] + "..."
        return f"{message} (got {shown!r})"
    return message
