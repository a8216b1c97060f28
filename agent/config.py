"""The lab configuration: `lab.toml` parsed once into typed models, and the `--budget` string.

A lab directory holds `lab.toml`; every path in it is relative to that directory. Loading refuses
unknown keys, wrong types and missing paths with one message naming the file, the key and what was
expected (`LabConfigError`). API keys never live in the file: `api_key_env` names the environment
variable that holds one.

    cfg = load_lab_config(Path("lab"))      # reads lab/lab.toml
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from evals.decoding import Decoding
from tools.executor import ExecutorSection

LAB_FILE = "lab.toml"


class LabConfigError(Exception):
    """lab.toml (or a CLI flag) is not what the lab needs; the message names the file and key."""


class BudgetError(ValueError):
    """A --budget string that is not one of the accepted forms."""


BUDGET_FORMS = "accepted forms: GPU-hours like 60gpuh or 0.5gpuh, or GPU-minutes like 90gpum"
_BUDGET_RE = re.compile(r"^(?P<value>\d+(?:\.\d+)?)(?P<unit>gpuh|gpum)$")


def parse_budget(text: str) -> float:
    """'60gpuh' -> 60.0, '90gpum' -> 1.5 (GPU-hours); anything else raises BudgetError."""
    match = _BUDGET_RE.match(text.strip())
    if not match:
        raise BudgetError(f"--budget {text!r} is not a GPU budget; {BUDGET_FORMS}")
    value = float(match["value"]) / (60.0 if match["unit"] == "gpum" else 1.0)
    if value <= 0:
        raise BudgetError(f"--budget {text!r} must be positive; {BUDGET_FORMS}")
    return value


def _existing_path(value: Path, info: ValidationInfo) -> Path:
    """Resolve a lab-relative path against the lab directory and require that it exists."""
    root = Path((info.context or {}).get("lab_dir", "."))
    resolved = value if value.is_absolute() else root / value
    if not resolved.exists():
        raise ValueError(f"path {str(value)!r} does not exist (looked for {resolved})")
    return resolved


LabPath = Annotated[Path, AfterValidator(_existing_path)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    base: LabPath = Field(description="Local directory of the base model (any transformers causal LM).")
    parent: LabPath | None = Field(None, description="Checkpoint the session starts from (stage-1 parent); defaults to base.")
    tokenizer: LabPath | None = Field(None, description="Tokenizer directory when it is not inside the model directory.")


class FeedbackSection(_Section):
    file: LabPath = Field(description="Battles file: JSONL (or Parquet) in the documented feedback format.")
    dev_fraction: float = Field(0.1, gt=0, lt=1, description="Share of battles held out for selection (dev holdout).")
    sealed_fraction: float = Field(0.1, gt=0, lt=1, description="Share sealed for the one-time confirmation of the nominee.")
    stratify_by: str | None = Field(None, description="Optional meta tag to stratify splits by, on top of the vote.")

    @model_validator(mode="after")
    def _train_left(self) -> FeedbackSection:
        if self.dev_fraction + self.sealed_fraction >= 0.9:
            raise ValueError("dev_fraction + sealed_fraction must leave at least 10% of battles for training")
        return self


class DataSource(_Section):
    name: str = Field(description="Short name used in dataset recipes and the notebook.")
    path: LabPath = Field(description="JSONL or Parquet file of chat rows with a `messages` column.")
    cap: int | None = Field(None, gt=0, description="Most rows taken from this source in one replay mix.")


class EvalSuite(_Section):
    name: str = Field(description="Suite name as it appears in bars and the notebook.")
    scorer: Literal[
        "math", "mcq", "constraints", "loops", "length_stop", "battle_margin", "reward_proxy", "judge", "synthetic",
    ] = Field(description="Scorer that grades this suite (one file in evals/).")
    file: LabPath | None = Field(None, description="Items file (JSONL); holdout-battle scorers read the dev split instead.")
    sealed: bool = Field(False, description="Sealed confirmation suite: scored once per session, for the nominee only.")
    replicates: int = Field(3, ge=3, description="K replicates of the incumbent used to calibrate this suite's noise floor.")


class EndpointSection(_Section):
    """An OpenAI-compatible endpoint; the key is read from the named environment variable."""

    base_url: str | None = Field(None, description="Endpoint base URL, e.g. http://127.0.0.1:8000/v1.")
    model: str | None = Field(None, description="Model name sent with each request.")
    api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable that holds the API key.")


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
    path: LabPath | None = Field(None, description="Reward model directory (sequence-classification checkpoint).")

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
    system_prompt_file: LabPath | None = Field(None, description="Text file with the served system prompt.")
    decoding: DecodingSection = Field(default_factory=DecodingSection, description="Served decoding settings.")

    def served_decoding(self, stop_token_ids: tuple[int, ...]) -> Decoding:
        prompt = self.system_prompt_file.read_text(encoding="utf-8").strip() if self.system_prompt_file else ""
        return Decoding(system_prompt=prompt, stop_token_ids=stop_token_ids, **self.decoding.model_dump())


class BudgetSection(_Section):
    reserve_fraction: float = Field(
        0.05, ge=0, lt=0.5, description="Share of the session budget kept back for the final nomination checks."
    )


class LabConfig(_Section):
    """Everything a lab needs, from `lab.toml`."""

    model: ModelSection = Field(description="Base model and the parent checkpoint to improve.")
    feedback: FeedbackSection = Field(description="Human side-by-side feedback and how it is split.")
    data: list[DataSource] = Field(default_factory=list, description="Local replay/instruction data sources.")
    evals: list[EvalSuite] = Field(default_factory=list, description="Evaluation suites.")
    bars: LabPath | None = Field(None, description="Promotion bars file (TOML), registered before any scoring.")
    executor: ExecutorSection = Field(default_factory=ExecutorSection, description="Job engine settings.")
    planner: PlannerSection = Field(default_factory=PlannerSection, description="Who proposes the next step.")
    judge: JudgeSection = Field(default_factory=JudgeSection, description="Pairwise judge for holdout battles.")
    serving: ServingSection = Field(default_factory=ServingSection, description="How the nominee will be served.")
    budget: BudgetSection = Field(default_factory=BudgetSection, description="Budget policy.")

    @model_validator(mode="after")
    def _unique_names(self) -> LabConfig:
        for what, names in (("data", [d.name for d in self.data]), ("evals", [e.name for e in self.evals])):
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"[[{what}]] names must be unique; repeated: {', '.join(dupes)}")
        return self


def load_lab_config(lab_dir: Path) -> LabConfig:
    """Read and validate `lab_dir/lab.toml`; raise LabConfigError with every problem it finds."""
    path = lab_dir / LAB_FILE
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise LabConfigError(f"{path}: no such file (a lab directory needs a {LAB_FILE})") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise LabConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return LabConfig.model_validate(raw, context={"lab_dir": lab_dir})
    except ValidationError as exc:
        raise LabConfigError(format_validation_error(path, exc)) from None


def format_validation_error(path: Path, exc: ValidationError) -> str:
    """One message: the file, then one line per problem with its key and what was expected."""
    lines = [f"{path}: {exc.error_count()} problem(s):"]
    for err in exc.errors():
        lines.append(f"  {_key(err['loc'])}: {_expected(err)}")
    return "\n".join(lines)


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
    if kind == "extra_forbidden" and err["loc"][-1] in ("api_key", "key", "token"):
        return "secrets never go in lab.toml: put the key in an environment variable and name it with `api_key_env`"
    if kind == "extra_forbidden":
        return "unknown key (not part of the lab.toml format; check its spelling)"
    if kind == "missing":
        return "required key is missing"
    message = err["msg"].removeprefix("Value error, ")
    if isinstance(got, (str, int, float, bool)) and kind not in ("value_error",):
        return f"{message} (got {got!r})"
    return message
