"""The model card of a nomination (`README.md` of its bundle), generated from the notebook only.

    text = render_card(nb, "s1", nominee_id=7, parent_id=1, runner_up_id=5, weights=WeightsInfo(kind="full"))

Every number in the card is followed by a reference to the notebook record it was read from, as an
HTML comment that renders invisibly:

    0.417<!-- nb eval:12 metrics.correct -->

The grammar is `<!-- nb TABLE:ID[+ID...] EXPR -->`, TABLE one of artifact, job, eval, noise_floor,
comparison, bars, decision (row ids; decision ids are chain seqs). EXPR is a dotted path into the
record (`resources.args.lr`, `verdicts.0.value`; `*` spans every element of a list or dict) or a
function of the values the path yields over the named records: `sum(...)`, `count(...)` (the length
of the one list or dict found, else the number of values), `diff(...)` (first record minus second),
`ci_low(...)` / `ci_high(...)` (the interval of the mean of per-item values: Wilson score for 0/1
values, Student t otherwise). Identifiers (names, paths, hashes, job ids, times) are written as
code spans; constants of the card itself too. So a reader, or a test, can check every number.

What the card reads, and where from:
- lineage: the nominee's model ancestors through `artifact.parents` (datasets are the parents of
  kind `dataset`), each with its producing job (`artifact.job_key`): method = job kind, steps =
  `result.steps`, learning rate = `resources.args.lr`, job id = `external_id`;
- the base and the parent: the lab's own `[model] base` and `[model] parent` as the session's config snapshot
  recorded them; the lineage's root artifact is the session's parent, which is the base itself only when
  `[model] parent` is unset or names the base; the license is the parent's `recipe.license` (recorded when the
  session registered it: lab.toml's [model] license, else the base's README.md front matter), with
  `recipe.license_source` saying which;
- the recipe: for each lineage member, the recorded config of the job that made it (`resources.args`): the
  method, LoRA (rank, alpha, dropout, target modules) or full fine-tuning, the learning rate and its schedule
  (warm-up, decay, floor), weight decay, batch and micro-batch, steps, row length, and the objective's own
  weights (DPO beta and NLL weight, the KL coefficient, RFT's samples); merges and soups list their parts
  with their weights or dose;
- paths: only lab-relative names (a path outside the lab by its directory name): the card names no path of
  the lab's machine, free text read from the notebook (failure details, refusal reasons) included;
- evaluations: the first replicate-0 eval at served decoding of each suite (the look that counts,
  as in evals/compare.py), for the nominee, the parent and the runner-up; noise floors: the session state's
  (memory/state.py), in the unit each bar's threshold used (threshold = value x floor): as the verdict recorded it
  (`comparison:ID verdicts.N.floor`), else the calibration's replicates' mean absolute delta, named as such;
- the sealed confirmation: `confirm` decisions for the nominee (each cited by its seq) and their evals;
- ground truth: the nominee's `truth` decision (tools/ground_truth.py), when the lab declares a scorer;
- bars, verdicts (promote: every bar held; reject) with each bar's floor, changes of incumbent, refused
  comparisons and refused bundles (every failure of each), failed job attempts and GPU-hours by kind.
Every session fact (bars, floors, verdicts, confirmations, the ground truth, the chain head) comes from the session
state; the notebook is read directly only for rows the state names (artifacts, evals, jobs).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.display import shown
from core.versions import Versions, installed
from memory.notebook import Artifact, ChatTemplateRef, EvalRecord, JobRecord, Notebook
from memory.records import BundleRefusal, CompareRefusal
from memory.report import family
from memory.skips import skipped_steps
from memory.state import BarFloor, IncumbentChange, SessionState, Verdict, fold

# Fewer items than this and a suite cannot resolve differences of a few points: said in the limitations.
MIN_ITEMS = 100
# Metrics where lower is better; `n_tokens` says nothing good or bad by itself; the rest: higher is better.
LOWER_IS_BETTER = {"looping", "tail_loop", "catastrophic", "ngram_repeat_ratio", "truncated", "empty",
                   "replacement_char", "unparsed", "no_answer"}
NEUTRAL = {"n_tokens"}


class WeightsInfo(BaseModel):
    """What the card says about the bundle's weights (the bundle writer knows; the notebook does not)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["full", "adapter"] = Field(description="A merged full model, or a PEFT adapter over a base.")
    base_path: str | None = Field(None, description="The adapter's base model directory (adapters only).")
    base_revision: str | None = Field(None, description="sha256 of the base's weights (adapters only).")


# ---- references --------------------------------------------------------------------------------


def ref(table: str, ids: int | Iterable[int], expr: str) -> str:
    """The HTML comment naming the record(s) a number came from."""
    joined = str(ids) if isinstance(ids, int) else "+".join(str(i) for i in ids)
    return f"<!-- nb {table}:{joined} {expr} -->"


def num(value: float | int, reference: str, digits: int = 4) -> str:
    """A number as the card prints it (integers exactly, floats to `digits` significant digits)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"card: {value!r} is not a number")
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e15:
        text = str(int(value))
    elif not math.isfinite(value):
        return f"`{value}`"
    else:
        text = f"{value:.{digits}g}"
    return text + reference


def code(text: Any) -> str:
    """An identifier as a code span; backticks and table pipes cannot break out of it, and control characters and
    bidi overrides (someone else's text in a name) are shown as escapes."""
    return "`" + shown(str(text)).replace("`", "'").replace("|", "/") + "`"


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Interval of the mean: Wilson score for 0/1 values (Wilson 1927, JASA 22:209), else Student t."""
    from scipy import stats as sps  # here, not at import: every bundle check imports this module

    n = len(values)
    mean = sum(values) / n
    z = sps.norm.ppf(0.5 + level / 2)
    if all(v in (0.0, 1.0) for v in values):
        centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n))
        return centre - half, centre + half
    if n < 2:
        return mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = sps.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


# ---- reading the notebook ----------------------------------------------------------------------


def model_lineage(nb: Notebook, artifact_id: int) -> list[Artifact]:
    """The artifact and its model ancestors (parents not of kind dataset), oldest first."""
    order: list[Artifact] = []
    seen: set[int] = set()

    def visit(aid: int) -> None:
        if aid in seen:
            return
        seen.add(aid)
        art = nb.artifact(aid)
        for parent in art.parents:
            if nb.artifact(parent).kind != "dataset":
                visit(parent)
        order.append(art)

    visit(artifact_id)
    return order


def lineage_datasets(nb: Notebook, lineage: list[Artifact]) -> list[Artifact]:
    """Every dataset a lineage member was trained on, in first-use order."""
    found: dict[int, Artifact] = {}
    for art in lineage:
        for parent in art.parents:
            candidate = nb.artifact(parent)
            if candidate.kind == "dataset":
                found.setdefault(candidate.id, candidate)
    return list(found.values())


def producing_job(nb: Notebook, art: Artifact) -> JobRecord | None:
    """The completed attempt of the job that made an artifact (None for inputs such as the base)."""
    if art.job_key is None:
        return None
    done = [j for j in nb.jobs(key=art.job_key) if j.state == "completed"]
    return done[-1] if done else nb.get_job(art.job_key)


def first_served(nb: Notebook, session: str, artifact_id: int, suite: str) -> EvalRecord | None:
    """The first full (replicate 0) eval of a suite at served decoding: the look that counts."""
    evs = [e for e in nb.evals(artifact_id=artifact_id, suite=suite, session=session) if e.replicate == 0 and e.served]
    return evs[0] if evs else None


def sealed_suites(state: SessionState, artifact_id: int) -> list[str]:
    return [c.suite for c in state.confirmed(artifact_id)]


def served_suites(nb: Notebook, state: SessionState, artifact_id: int) -> list[str]:
    """Suites with a served eval of the artifact, sealed suites left out."""
    skip = set(sealed_suites(state, artifact_id))
    suites = [e.suite for e in nb.evals(artifact_id=artifact_id, session=state.session) if e.served and e.replicate == 0]
    return sorted({s for s in suites if s not in skip})


def metric_names(ev: EvalRecord) -> list[str]:
    return sorted(m for m, v in ev.metrics.items() if not m.startswith("n_") and isinstance(v, int | float))


def item_values(ev: EvalRecord, metric: str) -> list[float]:
    return [o["values"][metric] for o in ev.items if metric in o.get("values", {})]


def worse(metric: str, nominee: float, parent: float) -> bool:
    """Whether the nominee's value is worse than the parent's (False for metrics without a direction)."""
    if metric in NEUTRAL:
        return False
    return nominee > parent if metric in LOWER_IS_BETTER else nominee < parent


class LabNames:
    """Lab-relative names for the lab's paths: the card ships to people who do not have the lab's machine."""

    def __init__(self, nb: Notebook, session: str):
        recorded = nb.session(session).lab
        spellings = {recorded, str(Path(recorded).resolve()), str(nb.path.parent), str(nb.path.parent.resolve())}
        # longest first: a root inside another spelling's is replaced whole
        self.roots = sorted({r.rstrip("/") for r in spellings if r.rstrip("/")}, key=len, reverse=True)

    def path(self, path: str | Path | None) -> str:
        """A path inside the lab relative to it; one outside it by its last component (a model's directory name)."""
        text = str(path or "")
        for root in self.roots:
            if text == root:
                return "."
            if text.startswith(root + "/"):
                return text[len(root) + 1:]
        return Path(text).name if text.startswith("/") else text

    def text(self, text: str) -> str:
        """Free text (a failure detail, a refusal reason) with every spelling of the lab root taken out (where it
        ends a path component: `/labs/a` is not taken out of `/labs/ab`)."""
        for root in self.roots:
            text = re.sub(re.escape(root) + r"(/|(?![\w-]|\.\w))", lambda m: "" if m[1] else ".", text)
        return text


def lab_model(nb: Notebook, session: str) -> tuple[str | None, str | None]:
    """The lab's `[model] base` and `[model] parent` as the session recorded them (parent None when unset)."""
    model = (nb.session(session).config.get("lab") or {}).get("model") or {}
    return model.get("base"), model.get("parent")


# ---- sections ----------------------------------------------------------------------------------


def _value_ci(ev: EvalRecord, metric: str) -> str:
    """`mean [low, high] (n)` of one metric of one eval, each number with its reference."""
    values = item_values(ev, metric)
    if not values:
        return num(ev.metrics[metric], ref("eval", ev.id, f"metrics.{metric}"))
    low, high = mean_ci(values)
    path = f"items.*.values.{metric}"
    n_key = f"n_{metric}"
    n_text = (num(ev.metrics[n_key], ref("eval", ev.id, f"metrics.{n_key}")) if n_key in ev.metrics
              else num(len(values), ref("eval", ev.id, f"count({path})")))
    return (f"{num(ev.metrics[metric], ref('eval', ev.id, f'metrics.{metric}'))} "
            f"[{num(low, ref('eval', ev.id, f'ci_low({path})'))}, {num(high, ref('eval', ev.id, f'ci_high({path})'))}]"
            f" n={n_text}")


def _model_section(nb: Notebook, state: SessionState, nominee: Artifact, lineage: list[Artifact],
                   weights: WeightsInfo) -> list[str]:
    session = state.session
    names = LabNames(nb, session)
    lines = [f"# {code(nominee.name)}: a chat model nominated by session {code(session)}", "",
             "## Model", ""]
    what = "a merged full model (sharded safetensors)" if weights.kind == "full" else (
        f"a PEFT adapter over {code(names.path(weights.base_path))} (weights hash {code(weights.base_revision)})")
    lines.append(f"The nominee is notebook artifact {code(nominee.id)} ({code(nominee.kind)} at "
                 f"{code(names.path(nominee.path))}, weights hash {code(nominee.sha256)}), shipped as {what}.")
    lines.append(_origin_line(nb, session, lineage[0], names))
    chat_ref = state.opened.chat_template if state.opened is not None else None
    if chat_ref is not None:
        lines.append(_chat_template_line(chat_ref))
    if state.head is not None:
        lines.append(f"Everything below was read from the lab notebook of session {code(session)}; its decision "
                     f"chain stood at seq {code(state.head.seq)} with hash {code(state.head.hash)}.")
    return [*lines, ""]


def _origin_line(nb: Notebook, session: str, root: Artifact, names: LabNames) -> str:
    """Where the lineage starts, named as the lab names it: the session's parent, and the base when that is another
    model (`[model] parent` set to a fine-tune of `[model] base`)."""
    base, parent = lab_model(nb, session)
    start = f"{code(root.name)} ({code(names.path(root.path))}, hash {code(root.sha256)})"
    if base is None:  # a session recorded without a lab config
        return f"Its lineage starts at the session's parent {start}."
    if parent is None or Path(parent) == Path(base):
        return f"Its lineage starts at the session's parent {start}, which is the lab's base model ({code('[model] base')})."
    return (f"Its lineage starts at the session's parent {start} ({code('[model] parent')}), a checkpoint derived from "
            f"the lab's base model {code(names.path(base))} ({code('[model] base')}), which this session did not train.")


def _chat_template_line(chat_ref: ChatTemplateRef) -> str:
    """Which chat template the model trains, evaluates and ships with, as the session's `open` decision recorded it."""
    which = ("its base's own chat template" if chat_ref.source == "model" else
             "ChatML, because its base tokenizer has no chat template of its own")
    system = ("system turns rendered by the template" if chat_ref.system_turns == "native" else
              "no system role in the template, so the system prompt is folded into the first user turn")
    # Not code(): it turns table pipes into slashes, and end-of-turn tokens are spelled with pipes (<|eot_id|>);
    # this line is no table row, so only a backtick could break out of the span.
    eot = "`" + shown(chat_ref.eot_token).replace("`", "'") + "`"
    return (f"It was trained, evaluated and is served in {which} (sha256 {code(chat_ref.sha256)}; end of turn "
            f"{eot}, token id {chat_ref.stop_token_ids[0]}; {system}): {code('training_chat_template.jinja')} is that "
            "template, and "
            f"{code('chat_template.jinja')} is it behind the served system prompt.")


def _usage_section(nb: Notebook, served: EvalRecord, weights: WeightsInfo) -> list[str]:
    # Remote code stays off: a bundle is data (check-bundle refuses one that carries code).
    load = ("model = AutoModelForCausalLM.from_pretrained(bundle, trust_remote_code=False)" if weights.kind == "full" else
            "from peft import PeftModel\n\n"
            "base = AutoModelForCausalLM.from_pretrained(serving[\"weights\"][\"base\"][\"path\"], "
            "trust_remote_code=False)\n"
            "model = PeftModel.from_pretrained(base, bundle)")
    snippet = [
        "```python", "import json", "from pathlib import Path", "",
        "from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig", "",
        "bundle = Path(\".\")  # this directory", "serving = json.loads((bundle / \"serving_config.json\").read_text())",
        "tokenizer = AutoTokenizer.from_pretrained(bundle, trust_remote_code=False)", load,
        "generation = GenerationConfig.from_pretrained(bundle)  # stop ids and the served decoding",
        "# The chat template inserts the served system prompt (system_prompt.txt) when a conversation has none.",
        "messages = [{\"role\": \"user\", \"content\": \"What is 12 + 30?\"}]",
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=serving[\"add_generation_prompt\"],",
        "                                       return_tensors=\"pt\", return_dict=True)",
        "assert inputs[\"input_ids\"].shape[1] <= serving[\"max_input_tokens\"]",
        "output = model.generate(**inputs, generation_config=generation)",
        "print(tokenizer.decode(output[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))", "```",
    ]
    d = served.decoding
    decoding = (f"temperature {num(d['temperature'], ref('eval', served.id, 'decoding.temperature'))}, top-p "
                f"{num(d['top_p'], ref('eval', served.id, 'decoding.top_p'))}, repetition penalty "
                f"{num(d['repetition_penalty'], ref('eval', served.id, 'decoding.repetition_penalty'))}, at most "
                f"{num(d['max_new_tokens'], ref('eval', served.id, 'decoding.max_new_tokens'))} new tokens, stop ids "
                + ", ".join(num(s, ref("eval", served.id, f"decoding.stop_token_ids.{i}"))
                            for i, s in enumerate(d["stop_token_ids"])))
    return ["## How to use", "", "Load it from this directory with transformers (no network needed):", "",
            *snippet, "",
            f"Served decoding (the decoding every served evaluation of the nominee used): {decoding}. "
            f"Files: {code('chat_template.jinja')} (also in the tokenizer config), {code('system_prompt.txt')}, "
            f"{code('generation_config.json')}, {code('serving_config.json')}, {code('training_evidence.json')}.", ""]


def _lineage_section(nb: Notebook, lineage: list[Artifact]) -> list[str]:
    lines = ["## Lineage", "", "| artifact | method | init | data | steps | learning rate | job |",
             "|---|---|---|---|---|---|---|"]
    for art in lineage:
        job = producing_job(nb, art)
        inits = [nb.artifact(p) for p in art.parents]
        init = ", ".join(code(p.name) for p in inits if p.kind != "dataset") or "(session parent)"
        data = ", ".join(code(p.name) for p in inits if p.kind == "dataset") or "-"
        method = code(job.kind) if job else code(art.recipe.get("method", "input"))
        steps = lr = job_id = "-"
        if job is not None:
            if job.result and isinstance(job.result.get("steps"), int):
                steps = num(job.result["steps"], ref("job", job.id, "result.steps"))
            if "snapshot" in art.recipe:  # a snapshot of the run (tools/train.py): the step it was saved at
                steps = num(art.recipe["snapshot"]["step"], ref("artifact", art.id, "recipe.snapshot.step"))
            if isinstance(job.resources.get("args", {}).get("lr"), int | float):
                lr = num(job.resources["args"]["lr"], ref("job", job.id, "resources.args.lr"))
            job_id = code(job.external_id or job.key[:12])
        lines.append(f"| {code(art.name)} | {method} | {init} | {data} | {steps} | {lr} | {job_id} |")
    return [*lines, ""]


# The trainer config keys the recipe states, in the order it states them (trainers/common.py TrainConfig and each
# trainer's own config: dpo, klce, rft); each as (key, label).
_SCHEDULE = (("lr", "peak learning rate"), ("schedule", "schedule"), ("warmup_steps", "warm-up steps"),
             ("min_lr_ratio", "final learning rate as a share of the peak"), ("weight_decay", "weight decay"),
             ("batch_size", "rows per step"), ("micro_batch_size", "rows per forward pass"), ("steps", "steps"),
             ("max_len", "max tokens per row"))
_OBJECTIVE = (("beta", "DPO beta"), ("nll_weight", "NLL weight"), ("kl_coef", "KL coefficient to the parent"),
              ("k", "samples per prompt"), ("temperature", "sampling temperature"), ("selection", "answer kept"))
_LORA = (("r", "rank"), ("alpha", "alpha"), ("dropout", "dropout"))


def _setting(job: JobRecord, path: str, label: str, value: Any) -> str:
    """One recorded setting: numbers with their reference, anything else as code."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{label} {num(value, ref('job', job.id, f'resources.args.{path}'))}"
    return f"{label} {code(value)}"


def _training_recipe(job: JobRecord, args: dict[str, Any]) -> str:
    lora = args.get("lora")
    if isinstance(lora, dict):
        parts = [_setting(job, f"lora.{k}", label, lora[k]) for k, label in _LORA if k in lora]
        targets = lora.get("target_modules")
        parts.append("target modules " + (", ".join(code(t) for t in targets) if targets else
                                          code("the trainer's default for the architecture")))
        if lora.get("train_lm_head"):
            parts.append("lm_head trained in full")
        tuning = "LoRA (" + ", ".join(parts) + ")"
    else:
        tuning = "full fine-tuning (every weight trained)"
    schedule = [_setting(job, k, label, args[k]) for k, label in _SCHEDULE if args.get(k) is not None]
    objective = [_setting(job, k, label, args[k]) for k, label in _OBJECTIVE if args.get(k) is not None]
    return "; ".join([tuning, ", ".join(schedule), *([", ".join(objective)] if objective else [])])


def _merge_recipe(nb: Notebook, art: Artifact, job: JobRecord | None) -> str:
    """What a merge made the artifact of: a soup's parts and weights, a dose's two ends and alpha, a LoRA merge."""
    r = art.recipe
    parts = [nb.artifact(i) for i in r.get("models", [])] or [nb.artifact(p) for p in art.parents
                                                            if nb.artifact(p).kind != "dataset"]
    if r.get("merge") == "soup":
        if not r.get("weights"):
            return "equal-weight soup of " + ", ".join(code(p.name) for p in parts)
        return "weight soup of " + ", ".join(
            f"{code(p.name)} (weight {num(w, ref('artifact', art.id, f'recipe.weights.{i}'))})"
            for i, (p, w) in enumerate(zip(parts, r["weights"], strict=False)))
    if r.get("merge") == "dose" and len(parts) == 2:
        return (f"dose interpolation from {code(parts[0].name)} (its start) to {code(parts[1].name)} (its end) at alpha "
                f"{num(r['alpha'], ref('artifact', art.id, 'recipe.alpha'))}")
    if r.get("merge") == "lora" and isinstance(r.get("adapter"), int):
        inits = [p for p in parts if p.id != r["adapter"] and p.kind != "adapter"]
        into = code(inits[0].name) if inits else "its parent"
        return (f"the LoRA adapter {code(nb.artifact(r['adapter']).name)} merged into {into}'s weights (W + alpha/r B A, "
                "as peft merges)")
    return "merge of " + ", ".join(code(p.name) for p in parts)


def _recipe_section(nb: Notebook, lineage: list[Artifact]) -> list[str]:
    """The recipe that made the nominee's weights: every lineage member's recorded job config, oldest first."""
    lines = ["## Recipe", "", "How each model of the lineage was made, read from the recorded config of the job "
             "that made it:", ""]
    for art in lineage:
        job = producing_job(nb, art)
        args = (job.resources.get("args") or {}) if job is not None else {}
        if job is None:
            what = "the session's starting point; not trained in this session"
        elif art.recipe.get("merge") or job.kind == "merge":
            what = _merge_recipe(nb, art, job)
        elif isinstance(args.get("lr"), int | float):
            what = f"{code(job.kind)}: " + _training_recipe(job, args)
        else:
            what = f"{code(job.kind)} (no training config recorded)"
        if "snapshot" in art.recipe:
            what += f"; the snapshot at step {num(art.recipe['snapshot']['step'], ref('artifact', art.id, 'recipe.snapshot.step'))}"
        lines.append(f"- {code(art.name)}: {what}")
    return [*lines, ""]


def _software_section(nb: Notebook, lineage: list[Artifact]) -> list[str]:
    """The versions of the packages that made the weights (each lineage job's recorded result, core/versions.py) and
    of the ones this bundle was written with: a figure of this card is reproduced with the same versions."""
    names = list(Versions.model_fields)
    lines = ["## Software", "", "| made by | " + " | ".join(n.replace("_", "-") for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for art in lineage:
        job = producing_job(nb, art)
        result = (job.result or {}) if job is not None else {}
        found = result.get("versions") or (result.get("train") or {}).get("versions")
        if job is not None and found:
            lines.append(f"| {code(art.name)} ({ref('job', job.id, 'result.versions')}) | "
                         + " | ".join(code(found.get(n) or "-") for n in names) + " |")
    here = installed()
    lines.append("| this bundle and card | " + " | ".join(code(getattr(here, n) or "-") for n in names) + " |")
    return [*lines, ""]


def _data_section(datasets: list[Artifact]) -> list[str]:
    lines = ["## Training data", ""]
    if not datasets:
        return [*lines, "No dataset artifact is recorded in the nominee's lineage.", ""]
    lines += ["| dataset | builder | rows | tokens | content hash | leak audit |", "|---|---|---|---|---|---|"]
    for ds in datasets:
        r, audit = ds.recipe, ds.recipe.get("audit", {})
        rows = num(r["rows"], ref("artifact", ds.id, "recipe.rows")) if "rows" in r else "-"
        tokens = num(r["tokens"], ref("artifact", ds.id, "recipe.tokens")) if "tokens" in r else "-"
        if audit:
            # The audit rejects rows, not builds (tools/data/datasets.py): its hits are the rows left out.
            verdict = "passed" if not audit.get("hits") else "passed, overlapping rows dropped"
            result = (f"{verdict}: {num(audit['rows_checked'], ref('artifact', ds.id, 'recipe.audit.rows_checked'))} "
                      f"prompts against {num(sum(audit['references'].values()), ref('artifact', ds.id, 'sum(recipe.audit.references.*)'))}"
                      f" holdout and eval prompts, {num(len(audit['hits']), ref('artifact', ds.id, 'count(recipe.audit.hits)'))}"
                      f" dropped (audit hash {code(r.get('audit_sha256', '-'))})")
        else:
            result = "no audit recorded"
        lines.append(f"| {code(ds.name)} | {code(r.get('builder', ds.kind))} | {rows} | {tokens} | {code(ds.sha256)} | {result} |")
    return [*lines, ""]


def bar_floor_text(f: BarFloor, comparison_id: int | None, index: int | None) -> str:
    """One noise floor as a bar's threshold used it (threshold = value x floor), with its reference: the verdict that
    recorded it, or the calibration row when it is the replicates' mean absolute delta itself."""
    if f.recorded and comparison_id is not None:
        shown = num(f.unit, ref("comparison", comparison_id, f"verdicts.{index}.floor"))
    elif f.unit == f.mean_abs_delta:
        shown = num(f.unit, ref("noise_floor", f.floor_id, "mean_abs_delta"))
    else:  # derived under `resolvable` for a verdict recorded before floors were kept: no record holds the number
        shown = code(f"{f.unit:.4g}")
    return (f"{shown} ({code(f.floor_unit)} floor of calibration {code(f.floor_id)}, "
            f"K={num(f.k, ref('noise_floor', f.floor_id, 'k'))})")


def _floor_text(state: SessionState, nominee_id: int, suite: str, metric: str) -> str:
    """The floor of (suite, metric) in the unit the bars' thresholds used: as the nominee's latest verdict recorded
    it, else as a comparison against the nominee would read it; a metric no noise-floor bar reads shows the
    replicates' mean absolute delta, named as such."""
    for v in reversed(state.of(nominee_id)):
        for i, (b, f) in enumerate(zip(v.bars, v.floors, strict=True)):
            if f is not None and (b.bar.suite, b.bar.metric) == (suite, metric):
                return bar_floor_text(f, v.comparison_id, i)
    for f in state.bar_floors(nominee_id):
        if (f.rule.suite, f.rule.metric) == (suite, metric):
            return bar_floor_text(f, None, None)
    floor = state.first_floor(suite, metric)
    if floor is None:
        return "not calibrated"
    f = floor.record
    return (f"{num(f.mean_abs_delta, ref('noise_floor', f.id, 'mean_abs_delta'))} (replicates' mean absolute delta, "
            f"K={num(f.k, ref('noise_floor', f.id, 'k'))}; no bar reads it)")


def _eval_section(nb: Notebook, state: SessionState, sides: list[tuple[str, Artifact | None]]) -> list[str]:
    nominee, session = sides[0][1], state.session
    lines = ["## Evaluation", "",
             "Each cell: the mean over items of the first full look at served decoding, its interval "
             f"({code('95%')}: Wilson score for binary values, Student t otherwise) and the item count. "
             "Noise floor: one noise floor in the unit the bars' thresholds used (threshold = value x floor): under "
             f"{code('resolvable')} the mean absolute difference between the incumbent's replicates, never finer than "
             f"the suite resolves; under {code('replicates')} that difference alone.", ""]
    suites = served_suites(nb, state, nominee.id)
    if not suites:
        return [*lines, "The nominee has no served evaluation in this session.", ""]
    header = " | ".join(f"{role} {code(art.name)}" for role, art in sides if art is not None)
    for suite in suites:
        evs = [(art, first_served(nb, session, art.id, suite)) for _, art in sides if art is not None]
        lines += [f"### Suite {code(suite)}", "", f"| metric | {header} | noise floor |",
                  "|---" * (len(evs) + 2) + "|"]
        for metric in metric_names(evs[0][1]):
            cells = [_value_ci(ev, metric) if ev is not None and metric in ev.metrics else "not evaluated"
                     for _, ev in evs]
            lines.append(f"| {code(metric)} | " + " | ".join(cells) + f" | {_floor_text(state, nominee.id, suite, metric)} |")
        lines.append("")
    return lines


def _evals_block(nb: Notebook, title: str, evs: list[EvalRecord], empty: str) -> list[str]:
    lines = [title, ""]
    if not evs:
        return [*lines, empty, ""]
    for ev in evs:
        lines.append(f"- suite {code(ev.suite)} (eval {code(ev.id)}): " + "; ".join(
            f"{code(m)} {_value_ci(ev, m)}" for m in metric_names(ev)))
    return [*lines, ""]


def _sealed_section(nb: Notebook, state: SessionState, nominee: Artifact) -> list[str]:
    """Each sealed suite opened for the nominee: its `confirm` decision, then the one eval it allowed."""
    lines = ["## Sealed confirmation", ""]
    confirms = state.confirmed(nominee.id)
    if not confirms:
        return [*lines, "No sealed confirmation suite was scored for the nominee in this session.", ""]
    lines.append("Scored once, for the nominee only, after its bundle passed check-bundle; never used for selection.")
    for c in confirms:
        evs = nb.evals(artifact_id=nominee.id, suite=c.suite, session=state.session)[:1]
        opened = f"- suite {code(c.suite)} (opened by decision {code(c.seq)}"
        if not evs:  # undecided: a battle suite whose sealed battles hold no decisive vote had nothing to score
            lines.append(f"{opened}): " + ("undecided: its sealed battles hold no decisive vote, nothing to score"
                                           if c.undecided else "no result was recorded (its job failed)"))
            continue
        ev = evs[0]
        lines.append(f"{opened}, eval {code(ev.id)}): " + "; ".join(f"{code(m)} {_value_ci(ev, m)}" for m in metric_names(ev)))
    return [*lines, ""]


def _truth_missing(nb: Notebook, session: str, nominee: Artifact) -> list[str]:
    """Why there is no ground truth: the lab declares no scorer, or its measurement recorded no result."""
    declared = (nb.session(session).config.get("lab") or {}).get("truth")
    if not declared:
        return [f"The lab declares no ground-truth scorer ({code('[truth]')} in lab.toml), so none was measured."]
    calls = [c for c in nb.tool_calls(session) if c.tool == "ground_truth" and c.args.get("artifact") == nominee.id]
    why = (f": its tool call {code(calls[-1].id)} ended {code(calls[-1].status)} "
           f"({code(calls[-1].outcome.summary if calls[-1].outcome is not None else '')})" if calls else ": it was not run")
    return [f"The lab declares the ground-truth scorer {code(declared.get('kind'))} (sample of "
            f"{code(declared.get('n'))} prompts), but no result is recorded for the nominee{why}."]


def _truth_section(nb: Notebook, state: SessionState, nominee: Artifact) -> list[str]:
    """The nominee's true win rate against the parent, by the lab's noise-free scorer."""
    lines = ["## Ground truth", ""]
    d = state.truth(nominee.id)
    if d is None:
        return [*lines, *_truth_missing(nb, state.session, nominee), ""]
    t = d.payload

    def at(expr: str, value: float | int) -> str:
        return num(value, ref("decision", d.seq, expr))

    audit = "passed" if t.audit_passed else "FAILED"
    lines += [
        f"Measured once, after the sealed confirmation, by the lab's noise-free scorer {code(t.scorer)} on a fresh "
        f"sample drawn apart from every prompt of the lab (decision {code(d.seq)}, job {code(t.job_key[:12])}); "
        "never shown to the agent's planner, so it checks the agent's choice rather than informing it.", "",
        f"- true win rate against the parent {code(nb.artifact(t.parent).name)} (points: win {code(1)}, "
        f"tie or both bad {code(0.5)}, loss {code(0)}): {at('payload.win_rate', t.win_rate)} ({code('95%')} CI {at('payload.ci_low', t.ci_low)} to "
        f"{at('payload.ci_high', t.ci_high)}), n = {at('payload.n', t.n)} prompts, sample seed {code(t.seed)}",
        f"- accuracy: nominee {at('payload.accuracy', t.accuracy)}, parent {at('payload.other_accuracy', t.other_accuracy)}",
        "- outcomes: " + ", ".join(f"{code(k)} {at(f'payload.outcomes.{k}', v)}" for k, v in t.outcomes.items()),
        f"- leak audit of the sample: {audit}{ref('decision', d.seq, 'payload.audit_passed')} against "
        f"{at('sum(payload.audit_references.*)', sum(t.audit_references.values()))} prompts of the lab "
        f"(audit hash {code(t.audit_sha256)})", "",
        "| family | n | nominee accuracy | parent accuracy | win rate |", "|---|---|---|---|---|",
    ]
    if t.artifact_id == t.parent:
        lines[4:4] = ["The nominee is the parent itself: this compares two independently sampled draws of one model, "
                      "so it shows the scorer's noise, not a gain.", ""]
    for family_name, f in t.per_family.items():
        p = f"payload.per_family.{family_name}"
        lines.append(f"| {code(family_name)} | {at(f'{p}.n', f.n)} | {at(f'{p}.accuracy', f.accuracy)} | "
                     f"{at(f'{p}.other_accuracy', f.other_accuracy)} | {at(f'{p}.win_rate', f.win_rate)} |")
    return [*lines, ""]


def _verdict_rows(v: Verdict, only_failed: bool) -> list[str]:
    rows = []
    for i, (b, f) in enumerate(zip(v.bars, v.floors, strict=True)):
        if only_failed and b.holds:
            continue
        shown = code(b.value) if isinstance(b.value, str) else num(b.value, ref("comparison", v.comparison_id,
                                                                                  f"verdicts.{i}.value"))
        floor = "" if f is None else f" (noise floor {bar_floor_text(f, v.comparison_id, i)})"
        rows.append(f"  - {code(b.bar.target)} {code(b.bar.statistic)} {code(b.bar.op)} "
                    f"threshold {num(b.threshold, ref('comparison', v.comparison_id, f'verdicts.{i}.threshold'))}"
                    f"{floor}: {shown} ({'holds' if b.holds else 'fails'})")
    return rows


def _decisions_section(nb: Notebook, state: SessionState) -> list[str]:
    lines = ["## Promotion decisions and bars", ""]
    for r in state.registrations:
        lines.append(f"Bars {code(r.id)} (hash {code(r.sha256)}, registered {code(r.registered_at)}, noise floors "
                     f"{code(r.floor_unit)}{_rule_keys(r)}):")
        for i, rule in enumerate(r.rules):
            unit = " noise floors" if rule.in_noise_units else ""
            lines.append(f"- {code(rule.target)}: {code(rule.statistic)} {code(rule.op)} "
                         f"{num(rule.value, ref('bars', r.id, f'spec.bars.{i}.value'))}{unit}")
        lines.append("")
    events = sorted([*state.verdicts, *state.changes], key=lambda e: e.seq)
    for e in events:
        if isinstance(e, IncumbentChange):  # the promote tool acting on a verdict that cleared every bar
            lines.append(f"- decision {code(e.seq)}: {code(nb.artifact(e.artifact_id).name)} becomes the "
                         f"incumbent (was {code(nb.artifact(e.previous).name)}; comparison {code(e.comparison_id)})")
        else:
            verdict = "cleared every bar (promote)" if e.cleared else "failed the bars (reject)"
            lines.append(f"- decision {code(e.seq)}: {code(nb.artifact(e.candidate).name)} {verdict} against "
                         f"{code(nb.artifact(e.incumbent).name)} by bars {code(e.bars_id)}")
            lines += _verdict_rows(e, only_failed=False)
    return [*lines, "", *_looks_lines(nb, state), *_audit_lines(nb, state)]


def _rule_keys(r) -> str:
    """The bars' sequential rule and audit rule, when they register them."""
    spec, out = r.spec, []
    if spec.looks > 1:
        out.append(f"up to {num(spec.looks, ref('bars', r.id, 'spec.looks'))} looks at a p bar, alpha spent as "
                   f"t**{num(spec.look_spending, ref('bars', r.id, 'spec.look_spending'))}, continuing while the "
                   f"raw p <= {num(spec.continue_p, ref('bars', r.id, 'spec.continue_p'))}")
    if spec.audit_margin is not None:
        out.append(f"suite audit: a guard the judge contradicts holds at "
                   f"{num(spec.audit_margin, ref('bars', r.id, 'spec.audit_margin'))} x its margin until cleared")
    return ("; " + "; ".join(out)) if out else ""


def _looks_lines(nb: Notebook, state: SessionState) -> list[str]:
    """Every look of a p bar under the sequential rule: the evidence each comparison bought."""
    if not state.looks:
        return []
    lines = ["Sequential looks (each a decision; an unresolved look spends no p-value, more evidence was bought):", ""]
    for x in state.looks:
        p = x.payload
        lines.append(f"- decision {code(x.seq)}: {code(nb.artifact(p.candidate).name)} {code(p.target)} look "
                     f"{num(p.look, ref('decision', x.seq, 'payload.look'))} of {num(p.looks, ref('decision', x.seq, 'payload.looks'))}"
                     f" on {num(p.n, ref('decision', x.seq, 'payload.n'))} items: p {num(p.raw_p, ref('decision', x.seq, 'payload.raw_p'))}"
                     f", p* {num(p.sequential_p, ref('decision', x.seq, 'payload.sequential_p'))}, adjusted "
                     f"{num(p.adjusted_p, ref('decision', x.seq, 'payload.adjusted_p'))}: {code(p.outcome)}")
    return [*lines, ""]


def _audit_lines(nb: Notebook, state: SessionState) -> list[str]:
    """The suite-audit findings: suites whose guard the judge contradicted beyond chance."""
    if not state.findings:
        return []
    lines = ["Suite audit findings (a guard's suite and the judged holdout disagreed beyond chance):", ""]
    for f in state.findings:
        p = f.payload
        status = (f"cleared by {code(f.cleared_by)} (decision {code(f.cleared_seq)})" if f.cleared_seq is not None
                  else "in force: a person has not cleared the suite")
        lines.append(f"- decision {code(f.seq)}: suite {code(p.suite)} ({code(p.metric)}) fails its guard on "
                     f"{code(nb.artifact(p.candidate).name)} ({num(p.guard_value, ref('decision', f.seq, 'payload.guard_value'))}"
                     f" vs {num(p.guard_threshold, ref('decision', f.seq, 'payload.guard_threshold'))}) while "
                     f"{code(p.judge_target)} holds (adjusted p {num(p.judge_adjusted_p, ref('decision', f.seq, 'payload.judge_adjusted_p'))});"
                     f" the guard reads {num(p.widened_threshold, ref('decision', f.seq, 'payload.widened_threshold'))}; {status}")
    return [*lines, ""]


def _rejected_section(nb: Notebook, state: SessionState) -> list[str]:
    lines = ["## Rejected alternatives", ""]
    rejected = [v for v in state.verdicts if not v.cleared]
    for v in rejected:
        lines.append(f"- {code(nb.artifact(v.candidate).name)} (comparison {code(v.comparison_id)}) failed:")
        lines += _verdict_rows(v, only_failed=True)
    refused = [d for d in state.refusals if isinstance(d.payload, CompareRefusal)]
    for d in refused:
        lines.append(f"- {code(nb.artifact(d.payload.candidate).name)} was refused a comparison "
                     f"(decision {code(d.seq)}): {code('; '.join(d.payload.reasons))}")
    bundles = [d for d in state.refusals if isinstance(d.payload, BundleRefusal)]
    for d in bundles:
        lines.append(f"- {code(nb.artifact(d.payload.artifact_id).name)} was refused as the nominee (decision "
                     f"{code(d.seq)}): its bundle failed "
                     f"{num(len(d.payload.reasons), ref('decision', d.seq, 'count(payload.reasons)'))} check(s):")
        lines += [f"  - {code(reason)}" for reason in d.payload.reasons]
    if not rejected and not refused and not bundles:
        lines.append("No candidate was rejected or refused in this session.")
    return [*lines, ""]


def _failures_section(nb: Notebook, session: str) -> list[str]:
    lines = ["## Failed jobs", ""]
    failed = [j for j in nb.jobs(session=session) if j.state == "failed"]
    if not failed:
        return [*lines, "No job attempt failed in this session.", ""]
    lines += ["| job | kind | attempt | failure | GPU-hours | evidence |", "|---|---|---|---|---|---|"]
    for j in failed:
        cost = num(j.gpu_hours, ref("job", j.id, "gpu_hours")) if j.gpu_hours is not None else "not settled"
        lines.append(f"| {code(j.external_id or j.key[:12])} | {code(j.kind)} | {num(j.attempt, ref('job', j.id, 'attempt'))}"
                     f" | {code(j.failure_class)} | {cost} | {code(j.failure_detail or '')} |")
    return [*lines, ""]


def _gpu_line(label: str, jobs: list[JobRecord]) -> str:
    settled = [j for j in jobs if j.gpu_hours is not None]
    if not settled:
        return f"- {label}: none"
    return f"- {label}: {num(sum(j.gpu_hours for j in settled), ref('job', [j.id for j in settled], 'sum(gpu_hours)'))}"


def _compute_section(nb: Notebook, session: str) -> list[str]:
    jobs = nb.jobs(session=session)
    simulated = any(j.charge == "simulated" for j in jobs)
    note = " (simulated: the toy world charges device-seconds at its declared rate)" if simulated else ""
    return ["## GPU-hours", "", f"Settled GPU-hours of every job attempt of the session when this card was written{note}"
            " (the job writing it is not settled yet):",
            _gpu_line("training", [j for j in jobs if family(j.kind) == "training"]),
            _gpu_line("evaluation (reference answers and ground truth included)",
                      [j for j in jobs if family(j.kind) == "evaluation"]),
            _gpu_line("merges", [j for j in jobs if family(j.kind) == "merge"]),
            _gpu_line("other (ingest, data builds, bundles)", [j for j in jobs if family(j.kind) == "other"]),
            _gpu_line("of these, failed attempts", [j for j in jobs if j.state == "failed"]),
            _gpu_line("total", jobs), ""]


def _limitations(nb: Notebook, state: SessionState, nominee: Artifact, parent: Artifact | None) -> list[str]:
    session = state.session
    lines = ["## Limitations", "", "Derived from the recorded evaluations:"]
    for suite in served_suites(nb, state, nominee.id):
        ev = first_served(nb, session, nominee.id, suite)
        pv = first_served(nb, session, parent.id, suite) if parent else None
        for metric in metric_names(ev):
            if pv is not None and metric in pv.metrics and worse(metric, ev.metrics[metric], pv.metrics[metric]):
                lines.append(f"- worse than the parent on {code(suite + '/' + metric)}: "
                             f"{num(ev.metrics[metric], ref('eval', ev.id, f'metrics.{metric}'))} vs "
                             f"{num(pv.metrics[metric], ref('eval', pv.id, f'metrics.{metric}'))} (difference "
                             f"{num(ev.metrics[metric] - pv.metrics[metric], ref('eval', [ev.id, pv.id], f'diff(metrics.{metric})'))})")
        for metric, what in (("looping", "loop rate"), ("truncated", "truncation rate")):
            if metric in ev.metrics:
                lines.append(f"- {what} on {code(suite)}: {num(ev.metrics[metric], ref('eval', ev.id, f'metrics.{metric}'))}")
        n = len(ev.items)
        if n < MIN_ITEMS:
            lines.append(f"- {code(suite)} has only {num(n, ref('eval', ev.id, 'count(items)'))} items: too few to "
                         f"resolve differences of a few points (fewer than {code(MIN_ITEMS)})")
    sealed = [e for suite in sealed_suites(state, nominee.id)
              for e in nb.evals(artifact_id=nominee.id, suite=suite, session=session)[:1]]
    if not sealed:
        lines.append("- no sealed confirmation was scored: the selection evidence is the only evidence")
    for ev in sealed:
        if len(ev.items) < MIN_ITEMS:
            lines.append(f"- the sealed suite {code(ev.suite)} has only {num(len(ev.items), ref('eval', ev.id, 'count(items)'))}"
                         f" items: it can reveal a gross failure, not confirm a difference of a few points")
    skipped = skipped_steps(nb, session)  # planned steps not taken: what they would have shown is missing
    if skipped:
        lines.append("- skipped steps (planned, not taken): " + "; ".join(
            f"{shown(x.step, limit=200)} ({shown(x.reason, limit=300)})" for x in skipped))
    return [*lines, *_truth_limitation(state, nominee), ""]


def _truth_limitation(state: SessionState, nominee: Artifact) -> list[str]:
    """A ground truth whose interval reaches 0.5 (no gain shown over the parent) or lies below it."""
    d = state.truth(nominee.id)
    if d is None or d.payload.ci_low > 0.5 or d.payload.artifact_id == d.payload.parent:  # (the parent vs itself)
        return []
    t, at = d.payload, lambda expr, v: num(v, ref("decision", d.seq, expr))
    what = "worse than the parent" if t.ci_high < 0.5 else "not shown to be better than the parent"
    return [f"- by the ground truth the nominee is {what}: true win rate {at('payload.win_rate', t.win_rate)}, "
            f"interval {at('payload.ci_low', t.ci_low)} to {at('payload.ci_high', t.ci_high)} (n = {at('payload.n', t.n)})"]


def _license_section(base: Artifact) -> list[str]:
    """The base model's license as the session recorded it on its parent (tools/promote.start_incumbent)."""
    lines = ["## License", ""]
    if "license" not in base.recipe:
        return [*lines, "The base model's license is not recorded in the notebook (a session from before licenses "
                "were recorded): check the base model's own terms.", ""]
    where = ref("artifact", base.id, "recipe.license")
    if base.recipe["license"] is None:
        return [*lines, f"The base model's license: not declared{where} (neither lab.toml's {code('[model] license')}"
                " nor a `license:` in the base directory's README.md front matter names one). Check the base model's"
                " own terms before using or redistributing this model.", ""]
    said = f"The base model's license applies to this model: {code(base.recipe['license'])}{where}"
    if base.recipe.get("license_source"):
        said += f" (read from {code(base.recipe['license_source'])}{ref('artifact', base.id, 'recipe.license_source')})"
    return [*lines, said + ".", ""]


def render_card(nb: Notebook, session: str, nominee_id: int, parent_id: int | None, runner_up_id: int | None,
                weights: WeightsInfo) -> str:
    """The whole card as Markdown, read from the notebook only (plus what `weights` says of the bundle)."""
    nominee = nb.artifact(nominee_id)
    parent = nb.artifact(parent_id) if parent_id is not None else None
    runner_up = nb.artifact(runner_up_id) if runner_up_id is not None else None
    served = [e for e in nb.evals(artifact_id=nominee_id, session=session) if e.served]
    if not served:
        raise ValueError(f"card: artifact {nominee_id} has no served evaluation in session {session}")
    lineage, state = model_lineage(nb, nominee_id), fold(nb, session)
    sections = [
        _model_section(nb, state, nominee, lineage, weights),
        _usage_section(nb, served[0], weights),
        _lineage_section(nb, lineage),
        _recipe_section(nb, lineage),
        _software_section(nb, lineage),
        _data_section(lineage_datasets(nb, lineage)),
        _eval_section(nb, state, [("nominee", nominee), ("parent", parent), ("runner-up", runner_up)]),
        _sealed_section(nb, state, nominee),
        _truth_section(nb, state, nominee),
        _decisions_section(nb, state),
        _rejected_section(nb, state),
        _failures_section(nb, session),
        _compute_section(nb, session),
        _limitations(nb, state, nominee, parent),
        _license_section(next((a for a in lineage if a.recipe.get("role") == "parent"), lineage[0])),
    ]
    text = "\n".join(line for section in sections for line in section).rstrip() + "\n"
    return LabNames(nb, session).text(text)  # free text from the notebook (failure details, reasons) names lab paths
