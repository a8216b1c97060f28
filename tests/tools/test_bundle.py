"""Nomination bundles from a real small session: nominated by the agent, checked, planted defects caught,
card verified.

The session (built once for the module) is a toy lab recorded through the notebook API: a tiny Llama
base (the parent, which never learned to stop), an audited replay dataset, bars registered before
scoring, the parent evaluated K=3 times (noise floors), an SFT arm that learned to answer briefly and
stop (promoted), a runner-up that did not (rejected by a bar), a run that diverged (a real nan_loss
failure), a LoRA arm merged into a model. Trainers and eval jobs run
in-process; each is recorded as a job attempt with its measured wall time. A serving alternative of
the SFT arm without the system prompt is recorded and evaluated the same way; the agent's own tools
(agent/toolbox.py, on the lab's lab.toml) compare and promote it: it clears the bars, but a bundle
cannot ship an empty system prompt. The agent's nomination step (agent.graph.nominate, its jobs run
by the launcher's local executor) then refuses that bundle, falls back to the SFT arm, opens the
sealed confirmation for it and publishes its bundle with the sealed result in the card.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import run_agent
from agent import gates, toolbox
from agent.config import load_lab_config
from agent.graph import Runtime
from agent.graph import nominate as nominate_step
from agent.planners.playbook import PlaybookSettings
from agent.runner import _runtime
from agent.summary import summarize
from core import tiny
from core.chat import CHATML_TEMPLATE, chat_template
from evals import bars, noise, synthetic
from evals.compare import compare
from evals.decoding import Decoding
from evals.job import EvalJobConfig, SuiteSpec
from evals.job import run as run_eval
from evals.records import record_result
from evals.sealed import judge_open
from evals.types import Item
from memory.notebook import Notebook
from memory.records import BundleRefusal
from tools.context import content_name
from tools.data.datasets import ReplayMixConfig, ReplaySource, build_replay_mix, record_dataset
from tools.data.splits import SplitConfig, ingest_feedback
from tools.nomination import bundle as bundle_mod
from tools.nomination.bundle import (
    BundleError,
    ServingConfig,
    TrainingEvidence,
    bundle_files,
    bundle_sha256,
    stop_evals,
    stop_probes,
    write_bundle,
)
from tools.nomination.check_bundle import (
    PROMPTS,
    _parse,
    check_bundle,
    reload_conversations,
    reload_evidence,
)
from tools.nomination.publish import PublishJob, publish_job
from trainers import merge, sft
from trainers.common import LoRASettings, NonFiniteLoss, weights_sha256

pytestmark = pytest.mark.slow

SESSION = "s1"
SYSTEM = "You are a brief assistant."
_WORDS = "apple river stone cloud garden window pencil orange cat dog bird fish tree".split()


@dataclass
class Toy:
    root: Path
    lab: Path
    nb: Notebook
    rt: Runtime
    base: int
    nominee: int
    runner_up: int
    alternative: int  # the promoted serving alternative whose bundle was refused
    merged: int
    dataset: int
    nominated: Path  # the bundle the agent published
    full: Path      # the nominee's bundle written directly, in several shards
    adapter: Path   # the merged LoRA arm's bundle, shipped as base + adapter


def _short_rows(n: int = 64) -> list[dict]:
    """Chat rows with short answers: a tiny model learns to answer in a few tokens and stop."""
    rows = []
    for i in range(n):
        a, b, word = i * 7 % 90 + 1, i * 13 % 80 + 3, _WORDS[i % len(_WORDS)]
        prompt, answer = [(f"What is {a} + {b}?", str(a + b)), (f"Count the words in: {word} {word} {word}.", "3"),
                          (f'Reverse the string "{word}".', word[::-1]), ("Say hello.", "Hello!")][i % 4]
        rows.append({"id": f"row{i}", "messages": [{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": f"OK. {answer}"}]})
    return rows


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _items(path: Path, items: list[Item]) -> Path:
    return _write_jsonl(path, [i.model_dump_json() for i in items])


def _job(nb: Notebook, key: str, kind: str, fn, cfg):
    """Run a job function in-process and record it as one job attempt, settled from its wall time."""
    args = json.loads(cfg.model_dump_json())
    nb.start_job(key, session=SESSION, kind=kind, executor="local", resources={"args": args}, forecast_gpuh=0.01)
    start = time.monotonic()
    try:
        result = fn(cfg)
    except NonFiniteLoss as err:
        hours = (time.monotonic() - start) / 3600
        nb.update_job(key, 1, state="failed", external_id=f"inproc-{key}", failure_class="nan_loss",
                      failure_detail=str(err), gpu_hours=hours)
        nb.record_decision(SESSION, "fail", f"{kind} failed: nan_loss",
                           {"key": key, "attempt": 1, "failure_class": "nan_loss", "detail": str(err)})
        return None
    nb.update_job(key, 1, state="completed", external_id=f"inproc-{key}", result=json.loads(result.model_dump_json()),
                  gpu_hours=(time.monotonic() - start) / 3600)
    return result


def _train(nb: Notebook, root: Path, name: str, model: Path, data: Path, **kw):
    cfg = sft.SFTConfig(model_path=model, data_path=data, output_dir=root / "runs" / name, system_prompt=SYSTEM,
                        batch_size=8, micro_batch_size=8, max_len=64, **kw)
    return _job(nb, f"sft-{name}", "sft", sft.train, cfg)


def _evaluate(nb: Notebook, root: Path, name: str, artifact: int, model: Path, suites, served: Decoding,
              replicates: int = 1, is_served: bool = True) -> list:
    cfg = EvalJobConfig(checkpoint=model, decoding=served, served=is_served, suites=suites, replicates=replicates,
                        output_dir=root / "evals" / name, batch_size=16)
    result = _job(nb, f"eval-{name}", "eval", run_eval, cfg)
    return record_result(nb, SESSION, artifact, result, job_key=f"eval-{name}")


def _checkpoint(nb: Notebook, name: str, path: Path, parents: list[int], job_key: str | None, **recipe) -> int:
    return nb.add_artifact(kind="checkpoint", name=name, path=str(path), sha256=weights_sha256(path),
                           parents=parents, recipe=recipe, job_key=job_key, session=SESSION).id


def _write_lab(root: Path, tok: Path, base_dir: Path) -> tuple[Path, dict[str, Path]]:
    """The toy's lab directory: lab.toml (absolute paths), bars, system prompt, suites and feedback."""
    lab = root / "lab"
    lab.mkdir()
    battles = [{"id": f"b{i:02d}", "messages": [{"role": "user", "content": f"Which is larger, {i} or {i * 3 + 1}?"}],
                "own": str(i * 3 + 1), "other": str(i), "vote": "own" if i % 3 else "other"} for i in range(30)]
    files = {"feedback": _write_jsonl(root / "feedback.jsonl", battles)}
    suites_dir = root / "suites"
    suites_dir.mkdir()
    files["digits"] = _items(suites_dir / "digits.jsonl", [t.item for t in synthetic.generate("digit_sum", 10, seed=11)])
    files["chat"] = _items(suites_dir / "chat.jsonl", [Item(id=f"c{i}", messages=({"role": "user", "content": p},))
                                                        for i, p in enumerate(["Greet me, please.", "Add 40 and 2.",
                                                                               "Thank you!", "Spell dog backwards."])])
    files["sealed"] = _items(suites_dir / "sealed.jsonl", [t.item for t in synthetic.generate("digit_sum", 6, seed=12)])
    files["truth"] = _items(suites_dir / "truth.jsonl", [t.item for t in synthetic.generate("digit_sum", 6, seed=13)])
    # Bars judge each candidate against the incumbent of its time: the stop bar tolerates a small loss only.
    (lab / "bars.toml").write_text('[[bar]]\nsuite = "chat"\nmetric = "stopped"\nrule = "delta >= -0.75"\n\n'
                                   '[[bar]]\nsuite = "digits"\nmetric = "correct"\nrule = "delta >= -1.0"\n')
    (lab / "system_prompt.txt").write_text(SYSTEM + "\n")
    suites = "".join(f'[[evals]]\nname = "{name}"\nscorer = "{scorer}"\nfile = "{files[file]}"\n{extra}\n'
                     for name, scorer, file, extra in (("digits", "synthetic", "digits", ""),
                                                       ("chat", "length_stop", "chat", ""),
                                                       ("loops", "loops", "chat", ""),
                                                       ("sealed", "synthetic", "sealed", "sealed = true\n")))
    (lab / "lab.toml").write_text(f"""bars = "bars.toml"

[model]
base = "{base_dir}"
tokenizer = "{tok}"

[feedback]
file = "{files['feedback']}"
dev_fraction = 0.2
sealed_fraction = 0.2

{suites}
[executor]
time_limit_min = 10

[serving]
system_prompt_file = "system_prompt.txt"

[serving.decoding]
max_new_tokens = 12
""")
    return lab, files


def _tool(ctx, tool: str, **args):
    """One of the agent's own tools, as the graph's act node runs it."""
    outcome = toolbox.run(ctx, tool, toolbox.args_model(tool).model_validate(args), None)
    assert outcome.status == "done", outcome
    return outcome


def _build_session(root: Path) -> Toy:
    torch.set_num_threads(1)  # as every test process (tests/conftest.py): two threads spin on a busy 2-core machine
    tok = tiny.build_tokenizer(root / "tokenizer")
    base_dir = tiny.build_model("llama", tok, root / "base", seed=0)
    lab, files = _write_lab(root, tok, base_dir)
    config = load_lab_config(lab)
    nb = Notebook.open(lab / "notebook.db")
    nb.open_session(SESSION, lab=str(lab), budget_gpuh=1.0, reserve_gpuh=0.05, planner="playbook",
                    executor="local", config={"world": "toy"})
    rt = _runtime(nb, SESSION, lab, config, config.executor, PlaybookSettings.test(), "playbook", True)
    served = rt.ctx.lab.served
    # The parent as the agent records it (tools.promote.start_incumbent), with the base's license.
    base = _checkpoint(nb, "base", base_dir, [], None, role="parent", served_decoding=served.model_dump(mode="json"),
                       license="apache-2.0 (toy world)")

    split_path, _ = ingest_feedback(nb, files["feedback"], SplitConfig(dev_fraction=0.2, sealed_fraction=0.2),
                                    lab / "splits", session=SESSION)
    manifest = build_replay_mix(ReplayMixConfig(
        out=lab / "data" / "short.jsonl", tokenizer=tok, feedback=files["feedback"], split=split_path,
        eval_suites=[files["digits"], files["chat"], files["sealed"], files["truth"]], system_prompt=SYSTEM,
        sources=[ReplaySource(name="short", path=_write_jsonl(root / "short-source.jsonl", _short_rows()))]))
    dataset = record_dataset(nb, manifest, session=SESSION).id
    data = Path(manifest.path)
    bars_id = bars.register(nb, SESSION, bars.load(lab / "bars.toml").spec()).id

    suites = (SuiteSpec(name="digits", scorer="synthetic", items_path=files["digits"]),
              SuiteSpec(name="chat", scorer="length_stop", items_path=files["chat"]),
              SuiteSpec(name="loops", scorer="loops", items_path=files["chat"]))
    parent_evals = _evaluate(nb, root, "base", base, base_dir, suites, served, replicates=3)
    for suite in ("digits", "chat", "loops"):
        noise.calibrate(nb, SESSION, [e for e in parent_evals if e.suite == suite])

    good = _train(nb, root, "good", base_dir, data, steps=16, lr=5e-3)
    nominee = _checkpoint(nb, "sft-good", good.model_dir, [base, dataset], "sft-good", trainer="sft")
    _evaluate(nb, root, "good", nominee, good.model_dir, suites, served)
    _tool(rt.ctx, "compare", candidate=nominee)
    _tool(rt.ctx, "promote", candidate=nominee)
    weak = _train(nb, root, "weak", base_dir, data, steps=1, lr=1e-6)
    runner_up = _checkpoint(nb, "sft-weak", weak.model_dir, [base, dataset], "sft-weak", trainer="sft")
    _evaluate(nb, root, "weak", runner_up, weak.model_dir, suites, served)
    assert not compare(nb, SESSION, runner_up, nominee, bars_id, served).cleared
    assert _train(nb, root, "diverged", base_dir, data, steps=4, lr=1e35, grad_clip=1e38) is None

    lora = _train(nb, root, "lora", good.model_dir, data, steps=2, lr=1e-4, lora=LoRASettings(r=4, alpha=8))
    adapter = _checkpoint(nb, "lora", lora.model_dir, [nominee, dataset], "sft-lora", trainer="sft")
    merge_cfg = merge.LoRAMergeConfig(base=good.model_dir, adapter=lora.model_dir, output_dir=root / "merged")
    merged_result = _job(nb, "merge-lora", "merge", merge.merge_lora, merge_cfg)
    merged = _checkpoint(nb, "lora-merged", merged_result.output_dir, [adapter], "merge-lora", method="lora-merge")
    _evaluate(nb, root, "merged", merged, merged_result.output_dir, suites, served)

    # The defect: a serving alternative without the system prompt (recorded as tools/tune_serving.py
    # records one), promoted by the bars; no bundle may ship an empty system prompt.
    bare = served.model_copy(update={"system_prompt": ""})
    alternative = _checkpoint(nb, content_name("serve", {"weights": nb.artifact(nominee).sha256,
                                                         "decoding": bare.fingerprint()}),
                              good.model_dir, [nominee], None, serving_of=nominee, parent=nominee,
                              served_decoding=bare.model_dump(mode="json"))
    _evaluate(nb, root, "alternative", alternative, good.model_dir, suites, bare)
    _tool(rt.ctx, "compare", candidate=alternative)
    _tool(rt.ctx, "promote", candidate=alternative)
    nominate_step(rt, {"stop_reason": "protocol complete"})
    [published] = nb.artifacts(kind="bundle", session=SESSION)
    full = write_bundle(nb, SESSION, nominee, root / "bundles" / "full", parent_id=base, runner_up_id=runner_up,
                        shard_bytes=300_000)
    adapted = write_bundle(nb, SESSION, merged, root / "bundles" / "adapter", parent_id=nominee, ship="adapter")
    return Toy(root=root, lab=lab, nb=nb, rt=rt, base=base, nominee=nominee, runner_up=runner_up, alternative=alternative,
               merged=merged, dataset=dataset, nominated=Path(published.path), full=full.path, adapter=adapted.path)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Toy:
    built = _build_session(tmp_path_factory.mktemp("nomination"))
    yield built
    built.nb.close()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- the good bundles --------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["nominated", "full"])
def test_toy_bundle_passes_every_check(toy, which):
    report = check_bundle(getattr(toy, which), notebook_path=toy.nb.path)
    assert report.ok, report.failures()
    names = [r.name for r in report.results]
    assert {"template_compiles", "template_matches_renderer", "weights", "reload", "decision_hash"} <= set(names)
    assert all(r.status == "passed" for r in report.results)
    # the reload answered the measured suite's items (its four), not the fixed PROMPTS
    assert [a.prompt for a in report.answers] == [p[-1]["content"] for p in reload_evidence(
        _parse(Path(getattr(toy, which)))[1], toy.nb.path)[1]]
    assert len(report.answers) == 4 and all(a.stopped and a.text.strip() for a in report.answers)


def test_adapter_bundle_passes_and_records_its_base(toy):
    report = check_bundle(toy.adapter, notebook_path=toy.nb.path)
    assert report.ok, report.failures()
    serving = ServingConfig.model_validate_json((toy.adapter / "serving_config.json").read_text())
    nominee_dir = Path(toy.nb.artifact(toy.nominee).path)
    assert serving.weights.kind == "adapter" and Path(serving.weights.base.path) == nominee_dir.resolve()
    assert serving.weights.base.revision == weights_sha256(nominee_dir)
    assert (toy.adapter / "adapter_model.safetensors").is_file() and not (toy.adapter / "config.json").exists()


def test_a_lora_arm_ships_its_merged_weights_by_default(toy, tmp_path):
    """Issue 40: the bundle of a LoRA arm is the merged model unless the adapter form is asked for (vLLM and SGLang
    do not in general load adapters on a hybrid MoE's routed experts; every engine loads merged weights)."""
    out = write_bundle(toy.nb, SESSION, toy.merged, tmp_path / "merged-arm", parent_id=toy.nominee)
    serving = ServingConfig.model_validate_json((out.path / "serving_config.json").read_text())
    assert out.kind == serving.weights.kind == "full" and serving.weights.base is None
    assert not (out.path / "adapter_config.json").exists() and (out.path / "config.json").is_file()
    assert weights_sha256(out.path) == toy.nb.artifact(toy.merged).sha256  # the weights its evals measured


def test_the_reload_judges_stops_by_the_nominees_measured_rate_from_the_notebook_or_the_evidence(toy, tmp_path):
    _, b = _parse(Path(toy.full))
    measured = reload_evidence(b, toy.nb.path)[0]
    chat = [e for e in toy.nb.evals(artifact_id=toy.nominee, session=SESSION) if e.suite == "chat" and e.served]
    assert chat and measured is not None and measured.suites == ["chat"]
    assert measured.answers == sum(len(e.items) for e in chat)
    assert measured.stopped == sum(round(e.metrics["stopped"] * len(e.items)) for e in chat)
    # without a notebook: what the bundle's evidence recorded when it was written, the same figures
    assert reload_evidence(b, None)[0] == measured
    with Notebook.open(tmp_path / "other.db") as other:  # a notebook without this session: nothing measured
        assert reload_evidence(b, other.path)[0] is None
    old = _copy(toy.full, tmp_path / "old")  # a bundle written before the evidence recorded stops
    _rewrite_json(old / "training_evidence.json", lambda e: e.pop("stops"))
    _, b_old = _parse(old)
    assert reload_evidence(b_old, None)[0] is None


def test_the_reload_answers_items_of_the_suites_the_stop_rate_was_measured_on(toy, tmp_path):
    # The rate is a rate on the measured suite's items, so the reload answers those (up to five, chosen by a hash of
    # their ids, not by their outcomes), read from the lab through the notebook; the bundle carries none of them.
    _, b = _parse(Path(toy.full))
    chat = [e for e in toy.nb.evals(artifact_id=toy.nominee, session=SESSION) if e.suite == "chat" and e.served]
    items = {i["id"]: i["messages"] for i in map(json.loads, (toy.root / "suites" / "chat.jsonl").read_text().splitlines())}
    ids = sorted({o["item_id"] for e in chat for o in e.items}, key=lambda i: hashlib.sha256(i.encode()).hexdigest())
    probes = reload_evidence(b, toy.nb.path)[1]
    assert len(ids) == 4 and probes == [items[i] for i in ids]  # every item of the four-item suite, in hash order
    assert reload_conversations(probes) == probes
    evidence = (Path(toy.full) / "training_evidence.json").read_text()
    assert not any(m["content"] in evidence for p in probes for m in p)  # eval items never ship with the bundle
    # Without a notebook, or when the items file is gone: check-bundle's fixed PROMPTS.
    assert reload_evidence(b, None)[1] == [] and reload_conversations([]) == [[{"role": "user", "content": p}]
                                                                         for p in PROMPTS]
    moved = tmp_path / "chat.jsonl"
    shutil.move(toy.root / "suites" / "chat.jsonl", moved)
    try:
        assert reload_evidence(b, toy.nb.path)[1] == []
    finally:
        shutil.move(moved, toy.root / "suites" / "chat.jsonl")


def test_a_broken_evidence_file_fails_the_reload_by_name_without_a_notebook(toy, tmp_path):
    bundle = _copy(toy.full, tmp_path / "bundle")
    (bundle / "training_evidence.json").write_text("{not json")
    report = check_bundle(bundle)
    assert list(report.failures()) == ["reload"], report.failures()
    [message] = report.failures()["reload"]
    assert message.startswith("training_evidence.json: the nominee's measured stops cannot be read: ")
    assert report.answers == []


def test_bundle_holds_sharded_weights_template_and_evidence(toy):
    files = {p.name for p in toy.full.iterdir()}
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) >= 2 and "model.safetensors.index.json" in files
    template = (toy.full / "chat_template.jinja").read_text()
    assert template == chat_template(SYSTEM)
    assert json.loads((toy.full / "tokenizer_config.json").read_text())["chat_template"] == template
    assert (toy.full / "system_prompt.txt").read_text() == SYSTEM
    gen = json.loads((toy.full / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [3] and gen["do_sample"] is False and gen["max_new_tokens"] == 12
    serving = ServingConfig.model_validate_json((toy.full / "serving_config.json").read_text())
    assert serving.max_input_tokens == 2048 - 12 and serving.add_generation_prompt

    evidence = TrainingEvidence.model_validate_json((toy.full / "training_evidence.json").read_text())
    assert [s.name for s in evidence.lineage] == ["base", "sft-good"]
    stage = evidence.lineage[-1]
    assert (stage.method, stage.steps, stage.lr, stage.job_id) == ("sft", 16, 5e-3, "inproc-sft-good")
    [dataset] = evidence.datasets
    assert dataset.audit_passed and dataset.audit_hits == 0 and dataset.sha256 == toy.nb.artifact(dataset.artifact_id).sha256
    assert [b.sha256 for b in evidence.bars] == [toy.nb.bars(b.bars_id).sha256 for b in evidence.bars]
    last = toy.nb.decisions(SESSION)[-1]
    assert (evidence.session, evidence.last_decision.seq, evidence.last_decision.hash) == (SESSION, last.seq, last.hash)


def test_the_trainers_checkpoint_carries_the_template_its_rows_were_rendered_with(toy):
    nominee_dir = Path(toy.nb.artifact(toy.nominee).path)
    assert (nominee_dir / "chat_template.jinja").read_text() == CHATML_TEMPLATE  # the base's own, no system prompt
    # The bundle ships it behind the served system prompt, and keeps it as the training template.
    assert (toy.full / "training_chat_template.jinja").read_text() == CHATML_TEMPLATE


def test_failed_write_leaves_no_half_bundle(toy, tmp_path):
    out = tmp_path / "bundles" / "broken"
    with pytest.raises(Exception, match="no artifact 999"):
        write_bundle(toy.nb, SESSION, toy.nominee, out, parent_id=toy.base, runner_up_id=999)  # fails at the card
    assert not out.exists() and list(out.parent.iterdir()) == []
    with pytest.raises(BundleError, match="already exists"):
        write_bundle(toy.nb, SESSION, toy.nominee, toy.full)
    with pytest.raises(BundleError, match="no eval at served decoding"):
        write_bundle(toy.nb, SESSION, toy.dataset, tmp_path / "dataset-bundle")
    assert not (tmp_path / "dataset-bundle").exists()


# ---- the agent's nomination step ------------------------------------------------------------------


def test_a_refused_bundle_is_recorded_and_the_agent_falls_back_to_a_valid_nomination(toy):
    nb = toy.nb
    assert nb.session(SESSION).status == "done" and nb.verify().ok
    refusals = [d for d in nb.decisions(SESSION, kind="refuse") if isinstance(d.payload, BundleRefusal)]
    [refused] = refusals
    assert refused.payload.artifact_id == toy.alternative and refused.payload.bundle_job is not None
    # Every failed check is listed with what it expected; the served-without-system-prompt bundle has one.
    assert refused.payload.reasons == ["system_prompt: system_prompt.txt is empty; expected the served system prompt"]
    alternative = nb.artifact(toy.alternative).name
    assert not (toy.lab / "bundles" / f"{SESSION}-{alternative}.candidate").exists()
    assert not (toy.lab / "bundles" / f"{SESSION}-{alternative}").exists()
    [nomination] = nb.decisions(SESSION, kind="nominate")
    assert nomination.payload.artifact_id == toy.nominee and nomination.seq > refused.seq
    calls = [(c.tool, c.args.get("artifact"), c.status) for c in nb.tool_calls(SESSION)][-4:]
    assert calls == [("nominate", toy.alternative, "failed"), ("nominate", toy.nominee, "done"),
                     ("sealed_open", toy.nominee, "done"), ("publish", toy.nominee, "done")]
    # The runner-up passed through from the nomination step: the refused incumbent, then the nominee.
    assert [c.args["runner_up"] for c in nb.tool_calls(SESSION) if c.tool in ("nominate", "publish")] == [
        toy.nominee, toy.alternative, toy.alternative]
    [published] = nb.artifacts(kind="bundle", session=SESSION)
    assert published.parents == [toy.nominee] and toy.nominated == toy.lab / "bundles" / f"{SESSION}-sft-good"
    assert published.sha256 == bundle_sha256(bundle_files(toy.nominated))
    assert [p.name for p in (toy.lab / "bundles").iterdir()] == [toy.nominated.name]


def test_sealed_opens_once_for_the_nominee_after_its_check_and_before_its_card(toy):
    nb = toy.nb
    decisions = nb.decisions(SESSION)
    [confirm] = nb.decisions(SESSION, kind="confirm")
    [nomination] = nb.decisions(SESSION, kind="nominate")
    assert (confirm.payload.suite, confirm.payload.artifact_id) == ("sealed", toy.nominee)
    assert nomination.seq < confirm.seq
    [sealed] = nb.evals(artifact_id=toy.nominee, suite="sealed", session=SESSION)
    assert not nb.evals(artifact_id=toy.alternative, suite="sealed", session=SESSION)
    card = (toy.nominated / "README.md").read_text()
    line = next(x for x in card.splitlines() if x.startswith("- suite `sealed`"))
    assert line.startswith(f"- suite `sealed` (opened by decision `{confirm.seq}`, eval `{sealed.id}`): `correct` ")
    assert f"<!-- nb eval:{sealed.id} metrics.correct -->" in line
    assert "no sealed confirmation was scored" not in card
    # The evidence was written after the sealed result: only the session's end follows it in the chain.
    evidence = TrainingEvidence.model_validate_json((toy.nominated / "training_evidence.json").read_text())
    assert evidence.last_decision.seq > confirm.seq
    assert [d.kind for d in decisions if d.seq > evidence.last_decision.seq] == ["stop"]
    # Nothing may open it again, for the nominee or the refused candidate (pure judgments: nothing written).
    s = summarize(nb, SESSION)
    assert "already opened" in gates.check("sealed_open", {"artifact": toy.nominee}, s, 0.0, toy.lab)
    assert "already opened" in gates.check("sealed_open", {"artifact": toy.alternative}, s, 0.0, toy.lab)
    refusal = judge_open(nb, SESSION, "sealed", toy.alternative)
    assert refusal.reasons == [
        f"sealed suite sealed was already opened in session {SESSION} (decision {confirm.seq})",
        f"sealed suite sealed is scored for the nominee only; artifact {toy.alternative} is not the nominee"]


def test_the_nomination_step_on_a_finished_session_does_nothing(toy):
    before = len(toy.nb.decisions(SESSION))
    assert nominate_step(toy.rt, {}) == {"finished": True}
    assert len(toy.nb.decisions(SESSION)) == before


def _checked(toy: Toy) -> dict[str, str]:
    [call] = [c for c in toy.nb.tool_calls(SESSION) if c.tool == "nominate" and c.status == "done"]
    return call.result["data"]["files"]


def test_publish_checks_that_only_the_card_and_evidence_changed_since_the_check(toy, tmp_path):
    checked = _checked(toy)
    now = {name: d.sha256 for name, d in bundle_files(toy.nominated).items()}
    assert {n for n in now if now[n] != checked[n]} == {"README.md", "training_evidence.json"}
    staged = _copy(toy.nominated, tmp_path / "s1-sft-good.candidate")
    _truncated_shard(staged)
    cfg = PublishJob(notebook=toy.nb.path, session=SESSION, nominee=toy.nominee, parent=toy.base,
                     runner_up=toy.alternative, staged=staged, out_dir=tmp_path / "s1-sft-good", checked=checked)
    outcome = publish_job(cfg)
    assert not outcome.passed and not cfg.out_dir.exists() and staged.is_dir()
    assert outcome.problems == [f"files: model-00001-of-00001.safetensors has sha256 "
                                f"{bundle_files(staged)['model-00001-of-00001.safetensors'].sha256[:16]}..., checked as "
                                f"{checked['model-00001-of-00001.safetensors'][:16]}...; expected the checked bytes"]
    other = publish_job(cfg.model_copy(update={"nominee": toy.runner_up}))
    assert other.problems == [f"writer: {staged} holds artifact {toy.nominee} "
                              f"({toy.nb.artifact(toy.nominee).sha256[:16]}...); expected the nominee {toy.runner_up}"]
    intact = publish_job(cfg.model_copy(update={"staged": _copy(toy.nominated, tmp_path / "b.candidate"),
                                                 "out_dir": tmp_path / "b"}))
    assert intact.passed and intact.path == str(tmp_path / "b") and not (tmp_path / "b.candidate").exists()


def test_the_writer_refuses_weights_changed_since_their_evaluation(toy, tmp_path):
    src = _copy(Path(toy.nb.artifact(toy.nominee).path), tmp_path / "model")
    shard = next(src.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last tensor: same size, other weights
    shard.write_bytes(bytes(data))
    moved = toy.nb.artifact(toy.nominee).model_copy(update={"path": str(src)})
    with pytest.raises(BundleError, match=r"weights hash [0-9a-f]{16}\.\.\. is not artifact \d+'s recorded .* "
                                          r"\(changed or damaged on disk\)"):
        bundle_mod._check_evaluated(moved, src)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(BundleError, match="unreadable weights"):
        bundle_mod.source_tensors(src)


# ---- planted defects ---------------------------------------------------------------------------


def _rewrite_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _reseal(bundle: Path) -> None:
    """Re-record the served files' digests after a planted edit, as a forger who rewrote serving_config.json would:
    each defect then fails its own check, not only the manifest (which test_an_edited_served_file_fails_the_manifest
    covers)."""
    serving = ServingConfig.model_validate_json((bundle / "serving_config.json").read_text())
    resealed = serving.model_copy(update={"files": bundle_mod.served_files(bundle, serving.weights)})
    (bundle / "serving_config.json").write_text(resealed.model_dump_json(indent=2))


def _set_template(bundle: Path, template: str) -> None:
    (bundle / "chat_template.jinja").write_text(template)
    _rewrite_json(bundle / "tokenizer_config.json", lambda c: c.__setitem__("chat_template", template))


def _statement_raise(bundle: Path) -> None:
    _set_template(bundle, "{%- if messages | length == 0 -%}{%- raise_exception('no messages') -%}{%- endif -%}"
                  + chat_template(SYSTEM))


def _one_newline(bundle: Path) -> None:
    template = chat_template(SYSTEM)
    _set_template(bundle, template.replace("<|im_end|>\\n' -}}{%- endfor", "<|im_end|>\\n\\n' -}}{%- endfor", 1))


def _stop_id_outside_vocab(bundle: Path) -> None:
    serving = ServingConfig.model_validate_json((bundle / "serving_config.json").read_text())
    decoding = serving.decoding.model_copy(update={"stop_token_ids": (3, 99999)})
    fixed = serving.model_copy(update={"decoding": decoding, "decoding_sha256": decoding.fingerprint()})
    (bundle / "serving_config.json").write_text(fixed.model_dump_json(indent=2))
    _rewrite_json(bundle / "generation_config.json", lambda g: g.__setitem__("eos_token_id", [3, 99999]))


def _empty_system_prompt(bundle: Path) -> None:
    (bundle / "system_prompt.txt").write_text("")


def _truncated_shard(bundle: Path) -> None:
    shard = sorted(bundle.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _shard_missing_from_index(bundle: Path) -> None:
    last = sorted(p.name for p in bundle.glob("model-*.safetensors"))[-1]
    _rewrite_json(bundle / "model.safetensors.index.json",
                  lambda i: i.__setitem__("weight_map", {k: v for k, v in i["weight_map"].items() if v != last}))


def _indexed_shard_deleted(bundle: Path) -> None:
    sorted(bundle.glob("model-*.safetensors"))[0].unlink()


def _adapter_other_base(bundle: Path, other: Path) -> None:
    _rewrite_json(bundle / "adapter_config.json", lambda c: c.__setitem__("base_model_name_or_path", str(other)))


def _decision_hash_edited(bundle: Path) -> None:
    _rewrite_json(bundle / "training_evidence.json", lambda e: e["last_decision"].__setitem__("hash", "f" * 64))


DEFECTS = [
    (_statement_raise, "template_compiles", r"line 1: Encountered unknown tag 'raise_exception'"),
    (_one_newline, "template_matches_renderer", r"differs from the training renderer .* in 14 of 14 renderings"),
    (_stop_id_outside_vocab, "stop_ids", r"stop id 99999 is not in the vocabulary \(ids 0\.\.\d+\)"),
    (_empty_system_prompt, "system_prompt", r"system_prompt\.txt is empty; expected the served system prompt"),
    (_truncated_shard, "weights", r"model-0000\d-of-0000\d\.safetensors is \d+ bytes .* \(truncated or changed\)"),
    (_shard_missing_from_index, "weights", r"names none of its tensors; expected every shard in the index"),
    (_indexed_shard_deleted, "files", r"model-00001-of-0000\d\.safetensors is missing; expected it in the bundle"),
    (_decision_hash_edited, "decision_hash", r"has hash [0-9a-f]{64}; the evidence records f{64}"),
]


@pytest.mark.parametrize(("plant", "check", "message"), DEFECTS, ids=[d[0].__name__.strip("_") for d in DEFECTS])
def test_each_planted_defect_fails_with_its_own_message(toy, tmp_path, plant, check, message):
    bundle = _copy(toy.full, tmp_path / "bundle")
    plant(bundle)
    _reseal(bundle)
    report = check_bundle(bundle, notebook_path=toy.nb.path)
    assert list(report.failures()) == [check], report.failures()
    assert any(re.search(message, m) for m in report.failures()[check]), report.failures()


def test_an_edited_served_file_fails_the_manifest(toy, tmp_path):
    bundle = _copy(toy.full, tmp_path / "bundle")
    _rewrite_json(bundle / "tokenizer.json", lambda t: t.__setitem__("normalizer", {"type": "Lowercase"}))
    (bundle / "notes.txt").write_text("added")
    failures = check_bundle(bundle).failures()
    assert re.match(r"tokenizer\.json is \d+ bytes with sha256 .* \(edited since it was written\)",
                    failures["integrity"][0]), failures
    assert "notes.txt lies in the bundle but in no manifest" in failures["integrity"][1]


def test_adapter_pointing_at_another_base_fails(toy, tmp_path):
    bundle = _copy(toy.adapter, tmp_path / "bundle")
    other = Path(toy.nb.artifact(toy.base).path)
    _adapter_other_base(bundle, other)
    _reseal(bundle)
    report = check_bundle(bundle)
    assert list(report.failures()) == ["adapter_base"], report.failures()
    [message] = report.failures()["adapter_base"]
    assert f"base_model_name_or_path is {str(other)!r}; expected the recorded base" in message
    assert next(r for r in report.results if r.name == "reload").status == "skipped"


def test_unreadable_bundles_are_reported_not_raised(toy, tmp_path):
    empty = check_bundle(tmp_path)
    assert set(empty.failures()) == {"files", "serving_config"}
    assert "serving_config.json: cannot be read" in empty.failures()["serving_config"][0]
    broken = _copy(toy.full, tmp_path / "broken")
    (broken / "generation_config.json").write_text("{not json")
    (broken / "serving_config.json").write_text(json.dumps({"format_version": 1}))
    report = check_bundle(broken)
    assert list(report.failures()) == ["serving_config"]
    assert re.match(r"serving_config\.json: weights: Field required \(and \d+ more problems\)",
                    report.failures()["serving_config"][0])
    garbled = _copy(toy.full, tmp_path / "garbled")
    (garbled / "generation_config.json").write_text("{not json")
    assert _failure(garbled, "generation_config").startswith("ValueError: generation_config.json: not valid JSON")


def _failure(bundle: Path, check: str) -> str:
    return check_bundle(bundle).failures()[check][0]


# ---- the CLI ----------------------------------------------------------------------------------


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """`run_agent.py check-bundle ARGS` through the CLI's own main (an escaping exception fails the test)."""
    code = run_agent.main(["check-bundle", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_bundle_command_exit_status_and_listing(toy, tmp_path, capsys):
    code, out, err = _cli(capsys, str(toy.full), "--lab", str(toy.nb.path.parent))
    assert code == 0, out + err
    assert "passes every check" in out and "ok      reload" in out
    bad = _copy(toy.full, tmp_path / "bad")
    _empty_system_prompt(bad)
    _truncated_shard(bad)
    _reseal(bad)
    code, out, err = _cli(capsys, str(bad))
    assert code == 1 and "FAILED  system_prompt: system_prompt.txt is empty" in out
    assert "FAILED  weights: " in out and "FAILS 2 of" in out
    code, out, err = _cli(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and "is not a directory" in err
    code, out, err = _cli(capsys, str(toy.full), "--lab", str(tmp_path))
    assert code == 2 and "no notebook.db there" in err


# ---- the model card ----------------------------------------------------------------------------

_REF = re.compile(r"<!-- nb (\w+):([\d+]+) (.+?) -->")
_TOKEN = re.compile(r"<!--.*?-->|(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", re.S)


def _records(nb: Notebook, table: str, ids: list[int]) -> list[dict]:
    def one(i: int):
        match table:
            case "artifact":
                return nb.artifact(i)
            case "eval":
                return nb.eval(i)
            case "job":
                return next(j for j in nb.jobs() if j.id == i)
            case "comparison":
                return next(c for c in nb.comparisons(SESSION) if c.id == i)
            case "bars":
                return nb.bars(i)
            case "decision":
                return next(d for d in nb.decisions() if d.seq == i)
            case "noise_floor":
                floors = [f for e in nb.evals(session=SESSION) for m in e.metrics
                          for f in nb.noise_floors(SESSION, e.suite, m)]
                return next(f for f in floors if f.id == i)
        raise AssertionError(f"unknown table {table}")

    return [one(i).model_dump(mode="json") for i in ids]


def _walk(value, parts: list[str]) -> list:
    if not parts:
        return [value]
    head, rest = parts[0], parts[1:]
    if head == "*":
        children = value.values() if isinstance(value, dict) else value
        return [v for child in children for v in _walk(child, rest)]
    return _walk(value[int(head)] if isinstance(value, list) else value[head], rest)


def _wilson_or_t(values: list[float], side: str) -> float:
    n = len(values)
    if set(values) <= {0.0, 1.0}:
        from scipy.stats import binomtest

        ci = binomtest(int(sum(values)), n).proportion_ci(confidence_level=0.95, method="wilson")
        return ci.low if side == "low" else ci.high
    from scipy.stats import t

    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    low, high = t.interval(0.95, n - 1, loc=mean, scale=sd / math.sqrt(n))
    return low if side == "low" else high


def _resolve(nb: Notebook, table: str, ids: str, expr: str) -> float:
    records = _records(nb, table, [int(i) for i in ids.split("+")])
    fn, _, inner = expr.partition("(")
    if not inner:
        [value] = [v for r in records for v in _walk(r, expr.split("."))]
        return value
    path = inner.rstrip(")")
    values = [v for r in records for v in (_walk(r, path.split(".")) if path else [r])]
    match fn:
        case "sum":
            return sum(values)
        case "count":
            return len(values[0]) if len(values) == 1 and isinstance(values[0], list | dict) else len(values)
        case "diff":
            return values[0] - values[1]
        case "ci_low" | "ci_high":
            return _wilson_or_t(values, fn.removeprefix("ci_"))
    raise AssertionError(f"unknown function {fn}")


def _tolerance(shown: str) -> float:
    mantissa, _, exponent = shown.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 0.5 * 10 ** (int(exponent or 0) - decimals) * (1 + 1e-9) if decimals or exponent else 0.0


def _card_numbers(card: str) -> list[tuple[str, re.Match | None]]:
    text = re.sub(r"```.*?```", "", card, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    found, tokens = [], list(_TOKEN.finditer(text))
    for k, tok in enumerate(tokens):
        if tok.group().startswith("<!--"):
            continue
        nxt = tokens[k + 1] if k + 1 < len(tokens) else None
        follows = nxt is not None and nxt.start() == tok.end() and nxt.group().startswith("<!--")
        found.append((tok.group(), _REF.fullmatch(nxt.group()) if follows else None))
    return found


def test_every_number_in_the_card_is_in_the_record_it_names(toy):
    card = (toy.nominated / "README.md").read_text()
    numbers = _card_numbers(card)
    assert len(numbers) >= 40
    tables = set()
    for shown, reference in numbers:
        assert reference is not None, f"{shown} has no notebook reference"
        table, ids, expr = reference.groups()
        actual = _resolve(toy.nb, table, ids, expr)
        assert abs(float(shown) - float(actual)) <= _tolerance(shown), (shown, reference.group(), actual)
        tables.add(table)
    assert {"artifact", "job", "eval", "noise_floor", "comparison", "bars", "decision"} <= tables


def test_card_holds_every_section_the_issue_lists(toy):
    card = (toy.nominated / "README.md").read_text()
    for heading in ("## Model", "## How to use", "## Lineage", "## Training data", "## Evaluation",
                    "## Sealed confirmation", "## Promotion decisions and bars", "## Rejected alternatives",
                    "## Failed jobs", "## GPU-hours", "## Limitations", "## Ground truth", "## License"):
        assert heading in card
    alternative = toy.nb.artifact(toy.alternative).name
    assert f"nominee `sft-good` | parent `base` | runner-up `{alternative}`" in card
    assert re.search(r"`sft-weak` \(comparison `\d+`\) failed:\n  - `chat/stopped` `delta` `>=`", card)
    assert "`nan_loss`" in card and "nan_loss: step" in card
    assert "`apache-2.0 (toy world)`" in card and "suite `sealed`" in card
    # This lab declares no ground-truth scorer: the card says so (tests/tools/test_ground_truth.py has one).
    assert "The lab declares no ground-truth scorer" in card
    assert re.search(r"- loop rate on `loops`: [\d.]+<!--", card)
    assert re.search(r"- `chat` has only 4<!-- nb eval:\d+ count\(items\) --> items", card)


_DRIVER = """
import os, sys
for bundle, snippet in zip(sys.argv[1::2], sys.argv[2::2]):
    os.chdir(bundle)
    print("=== " + bundle, flush=True)
    exec(compile(snippet, os.path.join(bundle, "README.md"), "exec"), {"__name__": "__main__"})
"""


def test_card_usage_snippet_runs_against_the_bundle(toy):
    # One fresh interpreter runs each card's snippet from inside its bundle directory, as a reader would.
    args = []
    for bundle in (toy.nominated, toy.adapter):
        [snippet] = re.findall(r"```python\n(.*?)```", (bundle / "README.md").read_text(), flags=re.S)
        args += [str(bundle), snippet]
    run = subprocess.run([sys.executable, "-c", _DRIVER, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    answers = re.split(r"^=== .*$", run.stdout, flags=re.M)[1:]
    assert len(answers) == 2 and all(a.strip() for a in answers), run.stdout


def test_stop_probes_are_five_items_in_hash_order_from_unsealed_suites_passing_over_long_ones(tmp_path):
    # Eight items measured: one too long to be a probe, and a sealed suite's items never taken.
    rows = [{"id": f"s/{i}", "messages": [{"role": "user", "content": ("x" * 5000) if i == 3 else f"prompt {i}"}]}
            for i in range(8)]
    items = tmp_path / "stop.jsonl"
    items.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sealed = tmp_path / "sealed.jsonl"
    sealed.write_text(json.dumps({"id": "z/0", "messages": [{"role": "user", "content": "secret"}]}) + "\n")
    with Notebook.open(tmp_path / "notebook.db") as nb:
        nb.open_session("s", lab=str(tmp_path), budget_gpuh=1.0, reserve_gpuh=0.0, planner="playbook",
                        executor="local", config={})
        art = nb.add_artifact(kind="checkpoint", name="m", path=str(tmp_path), sha256="0" * 64, session="s")
        for key, suite, path, sealed_suite, ids in (("k1", "stop", items, False, [r["id"] for r in rows]),
                                                    ("k2", "confirm_stop", sealed, True, ["z/0"])):
            nb.start_job(key, session="s", kind="eval", executor="local", forecast_gpuh=0.0, resources={"args": {
                "suites": [{"name": suite, "items_path": str(path), "sealed": sealed_suite}]}})
            nb.add_eval(session="s", artifact_id=art.id, suite=suite, replicate=0, decoding={}, decoding_sha256="d",
                        served=True, metrics={"stopped": 1.0}, job_key=key,
                        items=[{"item_id": i, "label": "stopped", "reasons": [], "values": {"stopped": 1.0}}
                               for i in ids])
        probes = stop_probes(nb, stop_evals(nb, "s", art.id, "d"))
        assert stop_probes(nb, stop_evals(nb, "s", art.id, "other decoding")) == []
    by_hash = sorted((r["id"] for r in rows if r["id"] != "s/3"), key=lambda i: hashlib.sha256(i.encode()).hexdigest())
    assert probes == [next(r["messages"] for r in rows if r["id"] == i) for i in by_hash[:5]]


def test_publish_finds_the_evidences_last_decision_in_the_chain_through_the_notebook(tmp_path):
    # publish and check-bundle ask the notebook the same question (Notebook.recorded_hash), each in its own words.
    from tools.nomination.bundle import DecisionRef
    from tools.nomination.publish import _chain_problems

    with Notebook.open(tmp_path / "notebook.db") as nb:
        opened = nb.open_session("s", lab=str(tmp_path), budget_gpuh=1.0, reserve_gpuh=0.0, planner="playbook",
                                 executor="local", config={})
        head = nb.decisions(opened.name)[-1]
        problems = {}
        for name, ref in (("kept", (head.seq, head.hash)), ("edited", (head.seq, "f" * 64)), ("gone", (99, head.hash))):
            evidence = TrainingEvidence(session="s", notebook="notebook.db", nominee=1, nominee_sha256="0" * 64,
                                        lineage=[], datasets=[], bars=[], comparisons=[],
                                        last_decision=DecisionRef(seq=ref[0], hash=ref[1]))
            (tmp_path / name).mkdir()
            (tmp_path / name / "training_evidence.json").write_text(evidence.model_dump_json())
            problems[name] = _chain_problems(nb, tmp_path / name, "s")
        assert nb.recorded_hash("s", head.seq) == head.hash and nb.recorded_hash("other", head.seq) is None
    assert problems["kept"] == []
    assert problems["edited"] == [f"decision_hash: decision {head.seq} of session s is not in the notebook's chain "
                                  f"with hash {'f' * 64}; expected the evidence's last decision in the chain"]
    assert problems["gone"][0].startswith("decision_hash: decision 99 of session s is not in the notebook's chain")
