"""The serving bundle of a nomination: one directory a server loads as is, written atomically.

    result = write_bundle(nb, "s1", nominee_id=7, out_dir=Path("lab/bundles/s1"), parent_id=1, runner_up_id=5)
    report = check_bundle(result.path, notebook_path=nb.path)      # tools/nomination/check_bundle.py

The agent nominates in three steps (tools/nominate.py, tools/sealed_open.py, tools/nomination/publish.py):
`write_bundle` + `check_bundle` on a candidate bundle (`<name>.candidate`), and the `nominate`
decision only when every check passes (a `refuse` listing each failure otherwise, and the next
candidate is tried); then the sealed confirmation, once, for the nominee; then `write_records`
rewrites the card and the evidence with the sealed result in, the bundle is checked again and
renamed to its final place, and recorded as a `bundle` artifact (`bundle_sha256`). Nothing here
writes a notebook row.

A bundle holds:
- weights: a full model as sharded safetensors (`model-0000K-of-0000N.safetensors`, at most
  `shard_bytes` each) with `model.safetensors.index.json`, plus `config.json`; or a PEFT adapter
  (`adapter_config.json`, `adapter_model.safetensors`) over a base directory recorded with its
  weights hash as the revision. Every weight file's size and sha256 are in `serving_config.json`, and so
  (format 2) are those of every other file a server reads (`ServingConfig.files`: tokenizer, templates,
  configs, system prompt), so an edited tokenizer.json fails check-bundle;
- the tokenizer, with `chat_template.jinja` = `core.chat.serving_template(tokenizer, served system prompt)`
  (the model's own template, or ChatML for a model that had none, behind a preamble that applies the
  served system prompt the way the template handles system turns; also written into
  `tokenizer_config.json`), and `training_chat_template.jinja`, the template training rendered with;
- `system_prompt.txt` (the served system prompt, verbatim), `generation_config.json` (stop ids and
  the served decoding), `serving_config.json` (`ServingConfig`), `training_evidence.json`
  (`TrainingEvidence`) and the model card `README.md` (tools/nomination/card.py).

The weights shipped are the weights evaluated: the writer refuses a checkpoint whose weights hash
on disk is no longer the one its artifact recorded (damaged or replaced since its evaluation).

The served decoding is the one the nominee's served evaluations recorded: a bundle ships exactly
the decoding, system prompt and template its numbers were measured with (DESIGN.md invariant 4).

Atomicity: everything is written into a hidden sibling directory which is renamed into place as
the last step; any failure removes it, so a failed nomination leaves no half bundle.

Modes: a server often runs as another user, so before the rename every file is set to the session's shipped mode
(0644, or the lab's `[nomination] file_mode`: core.util.shipped_file_mode) and the directory to its searchable
counterpart (0755), whatever the umask and the atomic writes' owner-only temporary files would give; check-bundle
checks it (`permissions`).

Stop ids: generation_config.json stops on the served stop ids (the template's end of turn, the tokenizer's EOS) and
then on every other id the model's own generation_config.json and config.json name as `eos_token_id` (Llama-3
Instruct names `<|end_of_text|>` beside `<|eot_id|>`); serving_config.json records those (`model_stop_token_ids`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core import chat
from core.display import shown
from core.loading import CONFIG_FILE_LIMIT, header_problems
from core.util import (
    file_sha256,
    set_tree_modes,
    sha256_text,
    shipped_file_mode,
    write_atomic,
    write_json_atomic,
)
from core.versions import Versions
from evals.decoding import Decoding
from memory.notebook import Artifact, EvalRecord, Notebook
from memory.state import fold
from tools.data.datasets import audit_clean
from tools.nomination import card

INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_SHARD_BYTES = 2 * 1024**3
TRAINING_TEMPLATE = "training_chat_template.jinja"
# 2: serving_config.json records the digest of every file a server reads besides the weights (`files`).
FORMAT_VERSION = 2
# The files of a bundle that are not served (rewritten after the check: the card and the evidence) and the
# serving config itself; every other file is in the weights' or the served files' digests.
UNSERVED = ("serving_config.json", "training_evidence.json", "README.md")


class BundleError(ValueError):
    """A bundle that cannot be written (no served eval, an existing directory, unreadable weights)."""


# ---- the bundle's files, as models -----------------------------------------------------------------


class FileDigest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    bytes: int = Field(description="File size in bytes.")
    sha256: str = Field(description="sha256 of the file's bytes.")


class BaseRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str = Field(description="Local directory of the base model the adapter applies to.")
    revision: str = Field(description="The base's weights hash (trainers.common.weights_sha256): its exact revision.")


class WeightsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["full", "adapter"] = Field(description="Merged full model, or a PEFT adapter over `base`.")
    files: dict[str, FileDigest] = Field(description="Every weight file of the bundle (shards or the adapter).")
    index: str | None = Field(description="The shard index file (full models), None for adapters.")
    base: BaseRef | None = Field(description="The base an adapter applies to; None for full models.")


class ServingConfig(BaseModel):
    """`serving_config.json`: how a server must serve the bundle."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format_version: int = Field(description="Bundle format version.")
    weights: WeightsSpec = Field(description="The weight files and, for adapters, the base.")
    max_input_tokens: int = Field(description="Most prompt tokens a request may carry (must be positive).")
    add_generation_prompt: bool = Field(description="Render requests with the assistant header appended.")
    decoding: Decoding = Field(description="The served decoding (system prompt, sampling, stop ids).")
    decoding_sha256: str = Field(description="Its fingerprint, as recorded with every served eval.")
    system_prompt_file: str = Field(description="File holding the served system prompt.")
    chat_template_file: str = Field(description="File holding the chat template.")
    files: dict[str, FileDigest] | None = Field(
        None, description="Size and sha256 of every other file a server reads (tokenizer, templates, configs, "
        "system prompt), so an edited tokenizer.json is caught; None in format 1 bundles, which check-bundle refuses.")

    @model_validator(mode="after")
    def _weights_kind(self) -> ServingConfig:
        # An adapter without its base (or a full model without its index) cannot be served; said here, at parse.
        w = self.weights
        if w.kind == "adapter" and w.base is None:
            raise ValueError("weights.base: an adapter needs the base it applies to (path and revision)")
        if w.kind == "full" and w.index is None:
            raise ValueError("weights.index: a full model needs its shard index file")
        return self
    training_template_file: str = Field(
        TRAINING_TEMPLATE, description="File holding the template training rendered rows with (the model's own, or "
        "ChatML for a model that had none); the shipped template must render as it does with the served system prompt.")
    model_stop_token_ids: list[int] = Field(
        default_factory=list, description="Stop ids the model's own generation_config.json and config.json name "
        "(eos_token_id) beyond the served decoding's: generation_config.json stops on them after the served ones.")


class LineageStage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact_id: int = Field(description="Notebook artifact id.")
    name: str = Field(description="Artifact name.")
    kind: str = Field(description="Artifact kind (checkpoint, base, ...).")
    sha256: str = Field(description="Its weights hash.")
    parents: list[int] = Field(description="Parent artifact ids (models and datasets).")
    method: str | None = Field(description="Producing job kind (sft, dpo, merge, ...); None for inputs.")
    job_key: str | None = Field(description="Producing job's idempotency key.")
    job_id: str | None = Field(description="Executor job id (Slurm job id) of the completed attempt.")
    attempts: int = Field(description="Attempts the job took (requeues and retries included).")
    steps: int | None = Field(description="Optimizer steps (training jobs).")
    lr: float | None = Field(description="Peak learning rate (training jobs).")
    gpu_hours: float | None = Field(description="Settled GPU-hours of all attempts of the job.")


class DatasetEvidence(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    artifact_id: int = Field(description="Notebook artifact id.")
    name: str = Field(description="Dataset name.")
    sha256: str = Field(description="Content hash.")
    rows: int | None = Field(description="Rows, from the manifest.")
    audit_passed: bool | None = Field(description="Leak audit result (None when no audit is recorded).")
    audit_sha256: str | None = Field(description="sha256 of the audit result.")
    audit_hits: int | None = Field(description="Rows the audit matched against holdouts and eval prompts (and dropped).")


class BarsEvidence(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    bars_id: int = Field(description="bars row id.")
    sha256: str = Field(description="sha256 of the canonical spec.")
    registered_at: str = Field(description="When it was registered.")


class DecisionRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    seq: int = Field(description="Decision seq.")
    hash: str = Field(description="Its chain hash.")


class MeasuredStops(BaseModel):
    """How often the nominee stopped in its served evaluations at the bundle's decoding (check-bundle's reload
    judges its unstopped answers by this)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    answers: int = Field(description="Answers scored for `stopped`, every replicate of every such suite pooled.")
    stopped: int = Field(description="Of them, those that ended on a stop id.")
    suites: list[str] = Field(description="The suites they came from.")


def stop_evals(nb: Notebook, session: str, artifact_id: int, decoding_sha256: str) -> list[EvalRecord]:
    """The artifact's served evals at that decoding that scored `stopped`."""
    return [e for e in nb.evals(artifact_id=artifact_id, session=session)
            if e.served and e.decoding_sha256 == decoding_sha256
            and isinstance(e.metrics.get("stopped"), (int, float)) and e.items]


def measured_stops(nb: Notebook, session: str, artifact_id: int, decoding_sha256: str) -> MeasuredStops | None:
    """The artifact's served evals at that decoding that scored `stopped`, pooled; None if there are none."""
    return stops_of(stop_evals(nb, session, artifact_id, decoding_sha256))


def stops_of(evals: list[EvalRecord]) -> MeasuredStops | None:
    """`stop_evals` pooled."""
    if not evals:
        return None
    return MeasuredStops(answers=sum(len(e.items) for e in evals),
                         stopped=sum(round(e.metrics["stopped"] * len(e.items)) for e in evals),
                         suites=sorted({e.suite for e in evals}))


# The most probes the reload answers, and the bounds of one it takes (longer items are passed over).
PROBES = 5
PROBE_MESSAGES = 8
PROBE_CHARS = 4000


def stop_probes(nb: Notebook, evals: list[EvalRecord]) -> list[list[dict[str, str]]]:
    """Conversations of up to PROBES items of the suites a stop rate was measured on (its `stop_evals`), the lowest sha256
    of their item ids first (a sample fixed before any outcome), read from the items files their eval jobs ran on;
    unsealed suites only. check-bundle's reload answers these: the rate is a rate on their population. Read from the
    lab when checking, never written into a bundle (eval items stay out of what is shipped). Empty when the items
    can no longer be read."""
    files: dict[str, Path] = {}
    for e in evals:
        job = nb.get_job(e.job_key) if e.job_key else None
        suites = (job.resources.get("args") or {}).get("suites", []) if job is not None else []
        for suite in suites:
            if suite.get("name") == e.suite and not suite.get("sealed") and suite.get("items_path"):
                for item in e.items:
                    files.setdefault(item["item_id"], Path(suite["items_path"]))
    order = {item_id: rank for rank, item_id in enumerate(sorted(files, key=sha256_text))}
    found: dict[str, list[dict[str, str]]] = {}
    for path in sorted(set(files.values())):
        try:
            with open(path, encoding="utf-8") as lines:
                for line in lines:
                    row = json.loads(line)
                    item_id = row.get("id") if isinstance(row, dict) else None
                    if not isinstance(item_id, str) or item_id not in order or files[item_id] != path:
                        continue
                    messages = row.get("messages")
                    if _probe_shaped(messages):
                        found[item_id] = [{"role": m["role"], "content": m["content"]} for m in messages]
        except (OSError, ValueError):  # moved or rewritten since the eval: the reload falls back to its PROMPTS
            return []
    return [found[item_id] for item_id in sorted(found, key=order.__getitem__)[:PROBES]]


def _probe_shaped(messages: object) -> bool:
    return (isinstance(messages, list) and 1 <= len(messages) <= PROBE_MESSAGES
            and all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                    and isinstance(m.get("content"), str) and len(m["content"]) <= PROBE_CHARS for m in messages)
            and messages[-1]["role"] == "user")


class TrainingEvidence(BaseModel):
    """`training_evidence.json`: where the weights came from, as the notebook recorded it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    session: str = Field(description="Notebook session id.")
    notebook: str = Field(description="The notebook file, relative to the lab directory (a bundle names no path of "
                          "the lab's machine).")
    nominee: int = Field(description="Nominee artifact id.")
    nominee_sha256: str = Field(description="The nominee's weights hash in the notebook.")
    lineage: list[LineageStage] = Field(description="The model lineage, base first.")
    datasets: list[DatasetEvidence] = Field(description="Every dataset of the lineage with its audit.")
    bars: list[BarsEvidence] = Field(description="Every bars registration of the session.")
    comparisons: list[int] = Field(description="Comparison ids in which the nominee was the candidate.")
    last_decision: DecisionRef = Field(description="The session's last decision when the bundle was written.")
    stops: MeasuredStops | None = Field(
        None, description="The nominee's measured stops at the served decoding, for check-bundle without a notebook "
        "(with one, the notebook's are read); None when no served eval scored `stopped` (or an older bundle).")


class BundleResult(BaseModel):
    """What `write_bundle` returns."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: Path = Field(description="The bundle directory.")
    kind: Literal["full", "adapter"] = Field(description="Full model or adapter.")
    files: dict[str, FileDigest] = Field(description="Every file of the bundle.")
    sha256: str = Field(description="sha256 over the sorted (name, file sha256) list: the bundle artifact's hash.")
    versions: Versions | None = Field(None, description="The versions of torch, transformers, peft, trl and mamba-ssm the job ran with (stamped by the job wrapper, tools/jobs/jobrun.py).")


# ---- safetensors headers ---------------------------------------------------------------------------


def read_header(path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's JSON header (name -> dtype, shape, data_offsets).

    Raises ValueError when the file is shorter than its header says (a truncated shard)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name}: {len(head)} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if 8 + length > size:
            raise ValueError(f"{path.name}: header of {length} bytes does not fit in the file's {size} bytes")
        problems = header_problems(path)  # bounded, and typed: a list header is a message, not a traceback
        if problems:
            raise ValueError(f"{path.name}: {problems[0]}; expected a safetensors header")
        header = json.loads(f.read(length))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + length + end != size:
        raise ValueError(f"{path.name}: {size} bytes, but its header describes {8 + length + end}")
    return tensors


def source_tensors(model_dir: Path) -> list[tuple[str, str, int]]:
    """(file, tensor name, bytes) of a model directory's weights, in storage order."""
    files = (sorted(set(json.loads((model_dir / INDEX).read_text())["weight_map"].values()))
             if (model_dir / INDEX).is_file() else sorted(p.name for p in model_dir.glob("*.safetensors")))
    if not files:
        raise BundleError(f"{model_dir}: no safetensors weights")
    out = []
    for name in files:
        try:
            header = read_header(model_dir / name)
        except (OSError, ValueError) as err:  # a damaged checkpoint cannot be bundled: say which file
            raise BundleError(f"{model_dir / name}: unreadable weights ({err})") from None
        for tensor, meta in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            out.append((name, tensor, meta["data_offsets"][1] - meta["data_offsets"][0]))
    return out


def plan_shards(tensors: list[tuple[str, str, int]], shard_bytes: int) -> list[list[tuple[str, str, int]]]:
    """Consecutive groups of at most `shard_bytes` (a bigger tensor gets a shard of its own)."""
    shards: list[list[tuple[str, str, int]]] = [[]]
    size = 0
    for entry in tensors:
        if shards[-1] and size + entry[2] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[2]
    return shards


def write_shards(model_dir: Path, out: Path, shard_bytes: int) -> dict[str, FileDigest]:
    """Reshards a model's tensors (bytes unchanged) into `out`, one shard in memory at a time; writes the index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = plan_shards(source_tensors(model_dir), shard_bytes)
    weight_map, total = {}, 0
    for k, group in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for file in sorted({f for f, _, _ in group}):
            with safe_open(model_dir / file, framework="pt") as f:
                tensors |= {t: f.get_tensor(t) for src, t, _ in group if src == file}
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(n for _, _, n in group)
    write_json_atomic(out / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return {name: digest(out / name) for name in sorted(set(weight_map.values()))}


def digest(path: Path) -> FileDigest:
    return FileDigest(bytes=path.stat().st_size, sha256=file_sha256(path))


# ---- reading the nominee from the notebook ---------------------------------------------------------


def served_decoding(nb: Notebook, session: str, nominee_id: int) -> Decoding:
    """The decoding of the nominee's served evals; refuses none, or more than one."""
    served = [e for e in nb.evals(artifact_id=nominee_id, session=session) if e.served]
    prints = sorted({e.decoding_sha256 for e in served})
    if not served:
        raise BundleError(f"artifact {nominee_id} has no eval at served decoding in session {session}: "
                          "a bundle ships the decoding its evaluations used")
    if len(prints) > 1:
        raise BundleError(f"artifact {nominee_id} was evaluated as served under {len(prints)} decodings "
                          f"({', '.join(p[:12] for p in prints)}): which one ships is ambiguous")
    return Decoding.model_validate(served[0].decoding)


def _stage(nb: Notebook, art: Artifact) -> LineageStage:
    job = card.producing_job(nb, art)
    attempts = nb.jobs(key=art.job_key) if art.job_key else []
    args = job.resources.get("args", {}) if job else {}
    steps = job.result.get("steps") if job and job.result else None
    settled = [a.gpu_hours for a in attempts if a.gpu_hours is not None]
    return LineageStage(
        artifact_id=art.id, name=art.name, kind=art.kind, sha256=art.sha256, parents=art.parents,
        method=job.kind if job else None, job_key=art.job_key, job_id=job.external_id if job else None,
        attempts=len(attempts), steps=steps if isinstance(steps, int) else None,
        lr=args.get("lr") if isinstance(args.get("lr"), int | float) else None,
        gpu_hours=sum(settled) if settled else None,
    )


def _dataset(ds: Artifact) -> DatasetEvidence:
    audit = ds.recipe.get("audit")
    return DatasetEvidence(
        artifact_id=ds.id, name=ds.name, sha256=ds.sha256, rows=ds.recipe.get("rows"),
        audit_passed=None if audit is None else audit_clean(ds.recipe), audit_sha256=ds.recipe.get("audit_sha256"),
        audit_hits=None if audit is None else len(audit.get("hits", [])),
    )


def training_evidence(nb: Notebook, session: str, nominee_id: int) -> TrainingEvidence:
    lineage = card.model_lineage(nb, nominee_id)
    state = fold(nb, session)
    return TrainingEvidence(
        session=session, notebook=nb.path.name, nominee=nominee_id, nominee_sha256=nb.artifact(nominee_id).sha256,
        lineage=[_stage(nb, a) for a in lineage],
        datasets=[_dataset(d) for d in card.lineage_datasets(nb, lineage)],
        bars=[BarsEvidence(bars_id=b.id, sha256=b.sha256, registered_at=b.registered_at) for b in state.registrations],
        comparisons=[v.comparison_id for v in state.of(nominee_id)],
        last_decision=DecisionRef(seq=state.head.seq, hash=state.head.hash),
        stops=measured_stops(nb, session, nominee_id, served_decoding(nb, session, nominee_id).fingerprint()),
    )


# ---- writing ---------------------------------------------------------------------------------------


def _write_tokenizer(src: Path, out: Path, system_prompt: str | None) -> int | None:
    """The checkpoint's tokenizer with the shipped template (its training template behind the served system
    prompt: core.chat.serving_template) in chat_template.jinja and the tokenizer config, and the training
    template itself in training_chat_template.jinja (what check-bundle compares against); returns its pad id."""
    from core import loading

    tokenizer = loading.load_tokenizer(src)
    try:
        training = chat.chat_format(tokenizer).template
        template = chat.serving_template(tokenizer, system_prompt)
    except chat.ChatTemplateError as err:
        raise BundleError(f"{src}: chat template: {err}") from None
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template  # servers that read only the config see the same template
    write_json_atomic(config_path, config)
    write_atomic(out / "chat_template.jinja", template)
    write_atomic(out / TRAINING_TEMPLATE, training)
    return tokenizer.pad_token_id


def model_stop_ids(config_dir: Path, files: tuple[str, ...] = ("generation_config.json", "config.json")) -> list[int]:
    """Every `eos_token_id` the model's own `files` name (an id or a list), in order."""
    found: list[int] = []
    for name in files:
        path = config_dir / name
        if not path.is_file():
            continue
        if path.stat().st_size > CONFIG_FILE_LIMIT:  # an adapter's base lies outside the bundle: bounded here too
            raise BundleError(f"{shown(str(path))}: {path.stat().st_size} bytes; expected a config of at most "
                              f"{CONFIG_FILE_LIMIT}")
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError) as err:
            raise BundleError(f"{path}: not a JSON object ({type(err).__name__}); expected the model's config") from None
        ids = eos if isinstance(eos, list) else [eos]
        found += [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i not in found]
    return found


def generation_stop_ids(decoding: Decoding, model_stops: list[int]) -> list[int]:
    """What generation_config.json stops on: the served stop ids, then the model's own others (one rule, written by
    the bundle and checked by check-bundle)."""
    served = list(decoding.stop_token_ids)
    return served + [i for i in model_stops if i not in served]


def _write_generation_config(out: Path, decoding: Decoding, pad_id: int | None, model_stops: list[int] | None = None
                             ) -> None:
    from transformers import GenerationConfig

    sampled = {} if decoding.greedy else {"temperature": decoding.temperature, "top_p": decoding.top_p, "top_k": 0}
    GenerationConfig(do_sample=not decoding.greedy, max_new_tokens=decoding.max_new_tokens,
                     repetition_penalty=decoding.repetition_penalty,
                     eos_token_id=generation_stop_ids(decoding, model_stops or []),
                     pad_token_id=pad_id, **sampled).save_pretrained(out)


def _write_weights(src: Path, out: Path, shard_bytes: int) -> WeightsSpec:
    if not (src / ADAPTER_CONFIG).is_file():
        shutil.copy2(src / "config.json", out / "config.json")
        return WeightsSpec(kind="full", files=write_shards(src, out, shard_bytes), index=INDEX, base=None)
    from core.weights import weights_sha256

    adapter = json.loads((src / ADAPTER_CONFIG).read_text())
    base = Path(adapter.get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        raise BundleError(f"{src / ADAPTER_CONFIG}: base_model_name_or_path {str(base)!r} is not a local model directory")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copy2(src / name, out / name)
    return WeightsSpec(kind="adapter", files={ADAPTER_WEIGHTS: digest(out / ADAPTER_WEIGHTS)}, index=None,
                       base=BaseRef(path=str(base.resolve()), revision=weights_sha256(base)))


def weights_source(nb: Notebook, nominee: Artifact, ship: Literal["full", "adapter"]) -> Path:
    """The directory whose weights ship: the nominee's own (full), or the PEFT adapter it is made of.

    An adapter is evaluated as the model merged from it (the merged artifact names the adapter
    artifact as a parent); shipping it as an adapter ships exactly those evaluated weights as base + adapter.
    """
    own = Path(nominee.path)
    if (own / ADAPTER_CONFIG).is_file():
        if ship == "full":
            raise BundleError(f"artifact {nominee.id} ({own}) is a PEFT adapter: merge it to ship a full model")
        return own
    if ship == "full":
        return own
    adapters = [Path(p.path) for p in (nb.artifact(i) for i in nominee.parents) if (Path(p.path) / ADAPTER_CONFIG).is_file()]
    if len(adapters) != 1:
        raise BundleError(f"artifact {nominee.id} is not an adapter nor merged from exactly one adapter "
                          f"(found {len(adapters)} adapter parents): ship it as a full model")
    return adapters[0]


def _max_input_tokens(src: Path, weights: WeightsSpec, decoding: Decoding) -> int:
    """The model's context length (max_position_embeddings) less the served max_new_tokens."""
    config_dir = Path(weights.base.path) if weights.base else src
    context = json.loads((config_dir / "config.json").read_text()).get("max_position_embeddings")
    if not isinstance(context, int):
        raise BundleError(f"{config_dir / 'config.json'}: no max_position_embeddings; pass max_input_tokens")
    return context - decoding.max_new_tokens


def served_files(out: Path, weights: WeightsSpec) -> dict[str, FileDigest]:
    """The digests of the bundle's files a server reads that are not weights (ServingConfig.files)."""
    return {p.name: digest(p) for p in sorted(out.iterdir())
            if p.is_file() and p.name not in weights.files and p.name not in UNSERVED}


def bundle_files(path: Path) -> dict[str, FileDigest]:
    return {p.name: digest(p) for p in sorted(path.iterdir()) if p.is_file()}


def bundle_sha256(files: dict[str, FileDigest]) -> str:
    return sha256_text("\n".join(f"{name} {d.sha256}" for name, d in sorted(files.items())))


def _check_evaluated(nominee: Artifact, src: Path) -> None:
    """The weights on disk are the ones the notebook recorded (and evaluated): a checkpoint damaged or
    replaced since then is refused, not shipped under the evaluated numbers."""
    from core.weights import weights_sha256

    if Path(nominee.path).resolve() != src.resolve() or not any(src.glob("*.safetensors")):
        return  # the adapter a merged nominee was made of (check-bundle checks its base), or no weights (refused below)
    try:
        found = weights_sha256(src)
    except OSError as err:
        raise BundleError(f"{src}: weights cannot be read ({err})") from None
    if found != nominee.sha256:
        raise BundleError(f"{src}: weights hash {found[:16]}... is not artifact {nominee.id}'s recorded "
                          f"{nominee.sha256[:16]}...; expected the evaluated weights (changed or damaged on disk)")


def write_records(nb: Notebook, session: str, nominee_id: int, out: Path, parent_id: int | None,
                  runner_up_id: int | None) -> None:
    """(Re)write the two files read from the notebook, `training_evidence.json` and the card `README.md`,
    as the notebook stands now (in the session's shipped mode); the weights kind comes from the bundle's
    `serving_config.json`."""
    weights = ServingConfig.model_validate_json((out / "serving_config.json").read_text(encoding="utf-8")).weights
    mode = shipped_file_mode(nb.session(session).config)
    evidence = training_evidence(nb, session, nominee_id)
    write_atomic(out / "training_evidence.json", evidence.model_dump_json(indent=2) + "\n", mode)
    info = card.WeightsInfo(kind=weights.kind, base_path=weights.base.path if weights.base else None,
                            base_revision=weights.base.revision if weights.base else None)
    write_atomic(out / "README.md", card.render_card(nb, session, nominee_id, parent_id, runner_up_id, info), mode)


def _fill(nb: Notebook, session: str, nominee: Artifact, tmp: Path, parent_id: int | None,
          runner_up_id: int | None, max_input_tokens: int | None, shard_bytes: int,
          ship: Literal["full", "adapter"]) -> WeightsSpec:
    src = weights_source(nb, nominee, ship)
    decoding = served_decoding(nb, session, nominee.id)
    _check_evaluated(nominee, src)
    weights = _write_weights(src, tmp, shard_bytes)
    system = decoding.system_prompt or None  # evals render no system turn for an empty prompt
    pad_id = _write_tokenizer(src, tmp, system)
    own = [i for i in model_stop_ids(Path(weights.base.path) if weights.base else src)
           if i not in decoding.stop_token_ids]
    _write_generation_config(tmp, decoding, pad_id, own)
    write_atomic(tmp / "system_prompt.txt", decoding.system_prompt)
    serving = ServingConfig(
        format_version=FORMAT_VERSION, weights=weights, add_generation_prompt=True, decoding=decoding,
        max_input_tokens=max_input_tokens if max_input_tokens is not None else _max_input_tokens(src, weights, decoding),
        decoding_sha256=decoding.fingerprint(), system_prompt_file="system_prompt.txt",
        chat_template_file="chat_template.jinja", training_template_file=TRAINING_TEMPLATE,
        files=served_files(tmp, weights), model_stop_token_ids=own,
    )
    write_atomic(tmp / "serving_config.json", serving.model_dump_json(indent=2) + "\n")
    write_records(nb, session, nominee.id, tmp, parent_id, runner_up_id)
    return weights


def write_bundle(nb: Notebook, session: str, nominee_id: int, out_dir: str | Path, *, parent_id: int | None = None,
                 runner_up_id: int | None = None, max_input_tokens: int | None = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, ship: Literal["full", "adapter"] = "full") -> BundleResult:
    """Write the serving bundle of artifact `nominee_id` to `out_dir` (which must not exist).

    `parent_id` and `runner_up_id` are the artifacts the card's evaluation tables set beside the
    nominee (the session's starting parent and the best candidate not nominated). `max_input_tokens`
    defaults to the context length less the served max_new_tokens. `ship="adapter"` ships the PEFT
    adapter the nominee was merged from (or the nominee itself when it is one) over its recorded
    base instead of full weights; the default ships a LoRA arm merged, the form every server loads (vLLM and SGLang do
    not in general load adapters on a hybrid MoE's routed experts). Raises BundleError (nothing written) when the nominee cannot be bundled.
    """
    out = Path(out_dir)
    if out.exists():
        raise BundleError(f"{out}: already exists; bundles are immutable, choose a new directory")
    nominee = nb.artifact(nominee_id)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weights = _fill(nb, session, nominee, tmp, parent_id, runner_up_id, max_input_tokens, shard_bytes, ship)
        set_tree_modes(tmp, shipped_file_mode(nb.session(session).config))  # copies and mkstemp files included
        files = bundle_files(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BundleResult(path=out, kind=weights.kind, files=files, sha256=bundle_sha256(files))
