"""Nomination bundles from a real small session: written, checked, planted defects caught, card verified.

The session (built once for the module) is a toy lab recorded through the notebook API: a tiny Llama
base, an audited replay dataset, bars registered before scoring, the parent evaluated K=3 times (noise
floors), an SFT nominee that learned to answer briefly and stop, a runner-up that did not (rejected
by a bar), a run that diverged (a real nan_loss failure), a LoRA arm merged into a model, the sealed
confirmation of the nominee and a ground-truth suite. Trainers and eval jobs run in-process; each is
recorded as a job attempt with its measured wall time.
"""

from __future__ import annotations

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
from core import tiny
from core.chat import chat_template
from evals import bars, noise, synthetic
from evals.compare import compare
from evals.decoding import Decoding
from evals.job import EvalJobConfig, SuiteSpec
from evals.job import run as run_eval
from evals.records import record_result
from evals.sealed import open_sealed
from evals.types import Item
from memory.notebook import Notebook
from tools.bundle import BundleError, ServingConfig, TrainingEvidence, write_bundle
from tools.check_bundle import check_bundle
from tools.datasets import ReplayMixConfig, ReplaySource, build_replay_mix, record_dataset
from tools.splits import SplitConfig, ingest_feedback
from trainers import merge, sft
from trainers.common import LoRASettings, NonFiniteLoss, weights_sha256

pytestmark = pytest.mark.slow

SESSION = "s1"
SYSTEM = "You are a brief assistant."
_WORDS = "apple river stone cloud garden window pencil orange cat dog bird fish tree".split()


@dataclass
class Toy:
    root: Path
    nb: Notebook
    base: int
    nominee: int
    runner_up: int
    merged: int
    dataset: int
    full: Path      # the nominee's bundle
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


def _build_session(root: Path) -> Toy:
    torch.set_num_threads(2)
    tok = tiny.build_tokenizer(root / "tokenizer")
    base_dir = tiny.build_model("llama", tok, root / "base", seed=0)
    nb = Notebook.open(root / "lab" / "notebook.db")
    nb.open_session(SESSION, lab=str(root / "lab"), budget_gpuh=1.0, reserve_gpuh=0.05, planner="playbook",
                    executor="local", config={"world": "toy"})
    base = _checkpoint(nb, "base", base_dir, [], None, license="apache-2.0 (toy world)")

    battles = [{"id": f"b{i:02d}", "messages": [{"role": "user", "content": f"Which is larger, {i} or {i * 3 + 1}?"}],
                "own": str(i * 3 + 1), "other": str(i), "vote": "own" if i % 3 else "other"} for i in range(30)]
    feedback = _write_jsonl(root / "feedback.jsonl", battles)
    split_path, _ = ingest_feedback(nb, feedback, SplitConfig(dev_fraction=0.2, sealed_fraction=0.2),
                                    root / "lab" / "splits", session=SESSION)
    suites_dir = root / "suites"
    suites_dir.mkdir()
    digits = _items(suites_dir / "digits.jsonl", [t.item for t in synthetic.generate("digit_sum", 10, seed=11)])
    chat = _items(suites_dir / "chat.jsonl", [Item(id=f"c{i}", messages=({"role": "user", "content": p},))
                                                for i, p in enumerate(["Greet me, please.", "Add 40 and 2.", "Thank you!",
                                                                       "Spell dog backwards."])])
    sealed_items = _items(suites_dir / "sealed.jsonl", [t.item for t in synthetic.generate("digit_sum", 6, seed=12)])
    truth_items = _items(suites_dir / "truth.jsonl", [t.item for t in synthetic.generate("digit_sum", 6, seed=13)])
    manifest = build_replay_mix(ReplayMixConfig(
        out=root / "lab" / "data" / "short.jsonl", tokenizer=tok, feedback=feedback, split=split_path,
        eval_suites=[digits, chat, sealed_items, truth_items], system_prompt=SYSTEM,
        sources=[ReplaySource(name="short", path=_write_jsonl(root / "short-source.jsonl", _short_rows()))]))
    dataset = record_dataset(nb, manifest, session=SESSION).id
    data = Path(manifest.path)

    (root / "bars.toml").write_text('[[bar]]\nsuite = "chat"\nmetric = "stopped"\nrule = "delta >= 0.5"\n\n'
                                    '[[bar]]\nsuite = "digits"\nmetric = "correct"\nrule = "delta >= -1.0"\n')
    bars_id = bars.register(nb, SESSION, bars.load(root / "bars.toml")).id
    served = Decoding(system_prompt=SYSTEM, max_new_tokens=12, stop_token_ids=(3, 1))
    suites = (SuiteSpec(name="digits", scorer="synthetic", items_path=digits),
              SuiteSpec(name="chat", scorer="length_stop", items_path=chat),
              SuiteSpec(name="loops", scorer="loops", items_path=chat))
    parent_evals = _evaluate(nb, root, "base", base, base_dir, suites, served, replicates=3)
    for suite in ("digits", "chat", "loops"):
        noise.calibrate(nb, SESSION, [e for e in parent_evals if e.suite == suite])

    good = _train(nb, root, "good", base_dir, data, steps=16, lr=5e-3)
    nominee = _checkpoint(nb, "sft-good", good.model_dir, [base, dataset], "sft-good", trainer="sft")
    weak = _train(nb, root, "weak", base_dir, data, steps=1, lr=1e-6)
    runner_up = _checkpoint(nb, "sft-weak", weak.model_dir, [base, dataset], "sft-weak", trainer="sft")
    assert _train(nb, root, "diverged", base_dir, data, steps=4, lr=1e35, grad_clip=1e38) is None
    for name, art, path in (("good", nominee, good.model_dir), ("weak", runner_up, weak.model_dir)):
        _evaluate(nb, root, name, art, path, suites, served)
        compare(nb, SESSION, art, base, bars_id, served)

    lora = _train(nb, root, "lora", good.model_dir, data, steps=2, lr=1e-4, lora=LoRASettings(r=4, alpha=8))
    adapter = _checkpoint(nb, "lora", lora.model_dir, [nominee, dataset], "sft-lora", trainer="sft")
    merge_cfg = merge.LoRAMergeConfig(base=good.model_dir, adapter=lora.model_dir, output_dir=root / "merged")
    merged_result = _job(nb, "merge-lora", "merge", merge.merge_lora, merge_cfg)
    merged = _checkpoint(nb, "lora-merged", merged_result.output_dir, [adapter], "merge-lora", method="lora-merge")
    _evaluate(nb, root, "merged", merged, merged_result.output_dir, suites, served)

    nb.record_decision(SESSION, "nominate", "the promoted SFT arm", {"artifact_id": nominee})
    open_sealed(nb, SESSION, "sealed", nominee)
    _evaluate(nb, root, "sealed", nominee, good.model_dir,
              (SuiteSpec(name="sealed", scorer="synthetic", items_path=sealed_items, sealed=True),), served)
    _evaluate(nb, root, "truth", nominee, good.model_dir,
              (SuiteSpec(name="truth", scorer="synthetic", items_path=truth_items),), served, is_served=False)

    full = write_bundle(nb, SESSION, nominee, root / "bundles" / "full", parent_id=base, runner_up_id=runner_up,
                        shard_bytes=300_000)
    adapted = write_bundle(nb, SESSION, merged, root / "bundles" / "adapter", parent_id=nominee, ship="adapter")
    return Toy(root=root, nb=nb, base=base, nominee=nominee, runner_up=runner_up, merged=merged, dataset=dataset,
               full=full.path, adapter=adapted.path)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Toy:
    built = _build_session(tmp_path_factory.mktemp("nomination"))
    yield built
    built.nb.close()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- the good bundles --------------------------------------------------------------------------


def test_toy_bundle_passes_every_check(toy):
    report = check_bundle(toy.full, notebook_path=toy.nb.path)
    assert report.ok, report.failures()
    names = [r.name for r in report.results]
    assert {"template_compiles", "template_matches_renderer", "weights", "reload", "decision_hash"} <= set(names)
    assert all(r.status == "passed" for r in report.results)
    assert len(report.answers) >= 5 and all(a.stopped and a.text.strip() for a in report.answers)


def test_adapter_bundle_passes_and_records_its_base(toy):
    report = check_bundle(toy.adapter, notebook_path=toy.nb.path)
    assert report.ok, report.failures()
    serving = ServingConfig.model_validate_json((toy.adapter / "serving_config.json").read_text())
    nominee_dir = Path(toy.nb.artifact(toy.nominee).path)
    assert serving.weights.kind == "adapter" and Path(serving.weights.base.path) == nominee_dir.resolve()
    assert serving.weights.base.revision == weights_sha256(nominee_dir)
    assert (toy.adapter / "adapter_model.safetensors").is_file() and not (toy.adapter / "config.json").exists()


def test_bundle_holds_sharded_weights_template_and_evidence(toy):
    files = {p.name for p in toy.full.iterdir()}
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) >= 2 and "model.safetensors.index.json" in files
    template = (toy.full / "chat_template.jinja").read_text()
    assert template == chat_template(SYSTEM)
    assert json.loads((toy.full / "tokenizer_config.json").read_text())["chat_template"] == template
    assert (toy.full / "system_prompt.txt").read_text() == SYSTEM
    gen = json.loads((toy.full / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [3, 1] and gen["do_sample"] is False and gen["max_new_tokens"] == 12
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


def test_the_trainers_checkpoint_carries_the_renderer_template(toy):
    nominee_dir = Path(toy.nb.artifact(toy.nominee).path)
    assert (nominee_dir / "chat_template.jinja").read_text() == chat_template(SYSTEM)


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


# ---- planted defects ---------------------------------------------------------------------------


def _rewrite_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


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
    report = check_bundle(bundle, notebook_path=toy.nb.path)
    assert list(report.failures()) == [check], report.failures()
    assert any(re.search(message, m) for m in report.failures()[check]), report.failures()


def test_adapter_pointing_at_another_base_fails(toy, tmp_path):
    bundle = _copy(toy.adapter, tmp_path / "bundle")
    other = Path(toy.nb.artifact(toy.base).path)
    _adapter_other_base(bundle, other)
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
    card = (toy.full / "README.md").read_text()
    numbers = _card_numbers(card)
    assert len(numbers) >= 40
    tables = set()
    for shown, reference in numbers:
        assert reference is not None, f"{shown} has no notebook reference"
        table, ids, expr = reference.groups()
        actual = _resolve(toy.nb, table, ids, expr)
        assert abs(float(shown) - float(actual)) <= _tolerance(shown), (shown, reference.group(), actual)
        tables.add(table)
    assert {"artifact", "job", "eval", "noise_floor", "comparison", "bars"} <= tables


def test_card_holds_every_section_the_issue_lists(toy):
    card = (toy.full / "README.md").read_text()
    for heading in ("## Model", "## How to use", "## Lineage", "## Training data", "## Evaluation",
                    "## Sealed confirmation", "## Promotion decisions and bars", "## Rejected alternatives",
                    "## Failed jobs", "## GPU-hours", "## Limitations", "## Ground truth (toy world)", "## License"):
        assert heading in card
    assert "nominee `sft-good` | parent `base` | runner-up `sft-weak`" in card
    assert re.search(r"`sft-weak` \(comparison `\d+`\) failed:\n  - `chat/stopped` `delta` `>=`", card)
    assert "`nan_loss`" in card and "nan_loss: step" in card
    assert "`apache-2.0 (toy world)`" in card and "suite `sealed`" in card and "suite `truth`" in card
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
    for bundle in (toy.full, toy.adapter):
        [snippet] = re.findall(r"```python\n(.*?)```", (bundle / "README.md").read_text(), flags=re.S)
        args += [str(bundle), snippet]
    run = subprocess.run([sys.executable, "-c", _DRIVER, *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    answers = re.split(r"^=== .*$", run.stdout, flags=re.M)[1:]
    assert len(answers) == 2 and all(a.strip() for a in answers), run.stdout
