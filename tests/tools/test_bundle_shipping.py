"""What a team ships from its own lab (issue 43, items 5, 8 and 9): a bundle a server running as another user can read,
a card that states the recipe and names no path of the lab's machine, a template other servers' Jinja loads.

The lab (built once for the module, under a umask of 077 as a careful lab host sets it) is not the toy world: a tiny
Llama with a Llama-3-Instruct-style tokenizer (`<|eot_id|>` ends a turn and is the tokenizer's EOS; the model's own
config.json and generation_config.json name `<|end_of_text|>` beside it, as Meta's do), a `[model] parent` that is a
checkpoint of another `[model] base`, a served system prompt with punctuation, quotes, braces and newlines, its own
chat rows and stop items. A LoRA SFT arm is trained on the parent (in-process, 2 steps), merged into it, souped with
the parent, and the soup is evaluated as served and bundled by tools.nomination.bundle.write_bundle.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from jinja2 import Environment

from core import tiny
from core.chat import stop_ids
from core.loading import load_tokenizer
from evals.decoding import Decoding
from evals.job import EvalJobConfig, SuiteSpec
from evals.job import run as run_eval
from evals.records import record_result
from evals.types import Item
from memory.notebook import Notebook
from memory.report import write_report
from tests.hostile.bundle_kit import edit_json, reseal
from tools.nomination import card
from tools.nomination.bundle import ServingConfig, write_bundle
from tools.nomination.check_bundle import (
    _parse,
    _run,
    check_bundle,
    check_generation_config,
    check_permissions,
    template_checks,
)
from trainers import merge, sft
from trainers.common import LoRASettings, weights_sha256
from trainers.dpo import DPOConfig

pytestmark = pytest.mark.slow

SESSION = "own1"
SYSTEM = 'You are Ada\'s helper: answer in one line.\nNo "quotes", {braces}, {{ markers }} or 100% claims!\n\n- Be brief.'


@dataclass
class Lab:
    root: Path
    nb: Notebook
    bundle: Path
    tokenizer: Path


def _job(nb: Notebook, key: str, kind: str, fn, cfg):
    """A job function run in-process, recorded as one completed attempt with the config it ran with."""
    nb.start_job(key, session=SESSION, kind=kind, executor="local",
                 resources={"args": json.loads(cfg.model_dump_json())}, forecast_gpuh=0.01)
    start = time.monotonic()
    result = fn(cfg)
    nb.update_job(key, 1, state="completed", external_id=f"inproc-{key}", result=json.loads(result.model_dump_json()),
                  gpu_hours=(time.monotonic() - start) / 3600)
    return result


def _llama3_instruct_stops(model: Path, tokenizer) -> list[int]:
    """The model's own configs name <|end_of_text|> beside <|eot_id|>, as Meta-Llama-3-Instruct's do."""
    ids = [tokenizer.convert_tokens_to_ids("<|end_of_text|>"), tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    for name in ("config.json", "generation_config.json"):
        data = json.loads((model / name).read_text())
        data["eos_token_id"] = ids
        (model / name).write_text(json.dumps(data, indent=2))
    return ids


def _lab(root: Path) -> Lab:
    tok_dir = tiny.build_tokenizer(root / "tokenizer", template="llama3")
    tokenizer = load_tokenizer(tok_dir)
    base = tiny.build_model("llama", tok_dir, root / "models" / "base-llama", seed=0)
    parent = tiny.build_model("llama", tok_dir, root / "models" / "parent-chat", seed=1)
    for model in (base, parent):
        _llama3_instruct_stops(model, tokenizer)
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(8)]
    (root / "data").mkdir()
    (root / "data" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = [Item(id=f"s{i}", messages=({"role": "user", "content": f"Name a colour, {i}."},)) for i in range(3)]
    (root / "data" / "stop.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in items))

    nb = Notebook.open(root / "notebook.db")
    config = {"lab": {"model": {"base": str(base), "parent": str(parent), "tokenizer": None, "license": None}}}
    nb.open_session(SESSION, lab=str(root), budget_gpuh=1.0, reserve_gpuh=0.05, planner="playbook", executor="local",
                    config=config)
    parent_id = nb.add_artifact(kind="checkpoint", name="parent", path=str(parent), sha256=weights_sha256(parent),
                                parents=[], recipe={"role": "parent"}, job_key=None, session=SESSION).id
    data_id = nb.add_artifact(kind="dataset", name="chat-rows", path=str(root / "data" / "rows.jsonl"), sha256="d" * 64,
                              parents=[], recipe={"rows": len(rows), "builder": "chat"}, job_key=None, session=SESSION).id
    cfg = sft.SFTConfig(model_path=parent, data_path=root / "data" / "rows.jsonl", output_dir=root / "runs" / "sft-lora",
                        system_prompt=SYSTEM, steps=2, lr=2e-3, schedule="cosine", warmup_steps=1, batch_size=4,
                        micro_batch_size=2, lora=LoRASettings(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    trained = _job(nb, "sft-lora", "sft", sft.train, cfg)
    adapter_id = nb.add_artifact(kind="adapter", name="sft-lora", path=str(trained.model_dir),
                                 sha256=weights_sha256(trained.model_dir), parents=[parent_id, data_id],
                                 recipe={}, job_key="sft-lora", session=SESSION).id
    merged = _job(nb, "merge-lora", "merge", merge.merge_lora, merge.LoRAMergeConfig(
        base=parent, adapter=trained.model_dir, output_dir=root / "merged" / "sft-lora-merged"))
    merged_id = nb.add_artifact(kind="checkpoint", name="sft-lora-merged", path=str(merged.output_dir),
                                sha256=merged.weights_sha256, parents=[parent_id, data_id, adapter_id],
                                recipe={"merge": "lora", "adapter": adapter_id}, job_key="merge-lora", session=SESSION).id
    soup = _job(nb, "soup", "merge", merge.soup, merge.SoupConfig(
        models=[merged.output_dir, parent], weights=[0.75, 0.25], output_dir=root / "merged" / "soup"))
    soup_id = nb.add_artifact(kind="checkpoint", name="soup", path=str(soup.output_dir), sha256=soup.weights_sha256,
                              parents=[merged_id, parent_id], job_key="soup", session=SESSION,
                              recipe={"merge": "soup", "models": [merged_id, parent_id], "weights": [0.75, 0.25]}).id
    decoding = Decoding(system_prompt=SYSTEM, max_new_tokens=4, stop_token_ids=tuple(stop_ids(tokenizer)))
    record_result(nb, SESSION, soup_id, run_eval(EvalJobConfig(
        checkpoint=soup.output_dir, decoding=decoding, served=True, output_dir=root / "evals" / "soup", replicates=1,
        batch_size=4, suites=(SuiteSpec(name="stop", scorer="length_stop", items_path=root / "data" / "stop.jsonl"),))))
    out = write_bundle(nb, SESSION, soup_id, root / "bundles" / f"{SESSION}-soup", parent_id=parent_id).path
    return Lab(root=root, nb=nb, bundle=out, tokenizer=tok_dir)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    old = os.umask(0o077)  # a careful host: nothing is shared unless it is made so on purpose
    try:
        made = _lab(tmp_path_factory.mktemp("ownlab"))
    finally:
        os.umask(old)
    yield made
    made.nb.close()


@pytest.fixture(scope="module")
def checked(lab):
    """check-bundle's checks of the bundle by name, in-process and without the reload (which loads the model: the
    refusal test runs the whole of check_bundle)."""
    _, b = _parse(lab.bundle)
    results = [*template_checks(b), _run("permissions", check_permissions, b, lab.nb.path),
               _run("generation_config", check_generation_config, b)]
    return {r.name: r for r in results}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ---- item 5: modes --------------------------------------------------------------------------------------


def test_every_file_of_the_bundle_is_readable_by_others_and_the_directory_searchable(lab):
    assert _mode(lab.bundle) == 0o755
    modes = {p.name: _mode(p) for p in lab.bundle.iterdir()}
    assert {"chat_template.jinja", "tokenizer.json", "serving_config.json", "generation_config.json", "README.md",
            "model.safetensors.index.json", "config.json"} <= set(modes)
    assert {name: oct(m) for name, m in modes.items() if m != 0o644} == {}


def test_check_bundle_refuses_a_bundle_only_its_owner_can_read(lab, checked, tmp_path):
    copy = Path(shutil.copytree(lab.bundle, tmp_path / "b"))
    (copy / "tokenizer.json").chmod(0o600)  # what the atomic writes used to leave
    report = check_bundle(copy, lab.nb.path)
    [message] = report.failures()["permissions"]
    assert "tokenizer.json has mode 0600" in message and "0644" in message
    assert checked["permissions"].status == "passed"


def test_the_report_is_readable_by_others_unless_the_lab_says_otherwise(lab, tmp_path):
    old = os.umask(0o077)
    try:
        _, out = write_report(lab.nb.path, SESSION, tmp_path / "report.html")
        assert _mode(out) == 0o644
        lab.nb.open_session("own2", lab=str(lab.root), budget_gpuh=1.0, reserve_gpuh=0.05, planner="playbook",
                            executor="local", config={"lab": {"nomination": {"file_mode": "0640"}}})
        lab.nb.start_job("own2-job", session="own2", kind="sft", executor="local", resources={}, forecast_gpuh=0.01)
        _, out = write_report(lab.nb.path, "own2", tmp_path / "report2.html")
        assert _mode(out) == 0o640
    finally:
        os.umask(old)


# ---- item 8: the card -----------------------------------------------------------------------------------


def test_the_card_states_the_recipe_along_the_lineage(lab):
    card = (lab.bundle / "README.md").read_text()
    recipe = card.split("## Recipe", 1)[1].split("\n## ", 1)[0]
    sft_line = next(line for line in recipe.splitlines() if line.startswith("- `sft-lora`:"))
    for said in ("`sft`: LoRA (rank 4<!--", "alpha 8<!--", "target modules `q_proj`, `v_proj`", "peak learning rate 0.002",
                 "schedule `cosine`", "warm-up steps 1<!--", "rows per step 4<!--", "rows per forward pass 2<!--",
                 "steps 2<!--"):
        assert said in sft_line, said
    assert "resources.args.lora.r -->" in sft_line
    assert "the LoRA adapter `sft-lora` merged into `parent`'s weights" in recipe
    assert "weight soup of `sft-lora-merged` (weight 0.75<!--" in recipe and "`parent` (weight 0.25<!--" in recipe
    assert "- `parent`: the session's starting point; not trained in this session" in recipe


def test_the_card_names_the_labs_own_base_and_parent(lab):
    card = (lab.bundle / "README.md").read_text()
    assert ("Its lineage starts at the session's parent `parent` (`models/parent-chat`, hash" in card
            and "a checkpoint derived from the lab's base model `models/base-llama` (`[model] base`)" in card)
    assert "starts at the base" not in card


def test_nothing_in_the_bundle_names_the_labs_absolute_path(lab):
    spellings = {str(lab.root), str(lab.root.resolve())}
    for path in lab.bundle.iterdir():
        data = path.read_bytes()
        for spelled in spellings:
            assert spelled.encode() not in data, f"{path.name} names {spelled}"
    evidence = json.loads((lab.bundle / "training_evidence.json").read_text())
    assert evidence["notebook"] == "notebook.db"


# ---- item 9: the template and the stop ids --------------------------------------------------------------


def test_the_template_renders_alike_in_minijinja_and_jinja2(lab, checked):
    import minijinja

    template = (lab.bundle / "chat_template.jinja").read_text()
    assert "\\U" not in template  # Python-only escapes: minijinja leaves them as text
    conversation = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Again?"}]
    specials = load_tokenizer(lab.bundle).special_tokens_map
    env = minijinja.Environment()
    env.trim_blocks, env.lstrip_blocks = True, True
    for generation in (False, True):
        ours = env.render_str(template, messages=conversation, add_generation_prompt=generation, **specials)
        jinja = Environment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
            messages=conversation, add_generation_prompt=generation, **specials)
        assert ours == jinja and SYSTEM in ours
    assert checked["template_minijinja"].status == "passed" and checked["template_matches_renderer"].status == "passed"


def test_generation_config_keeps_the_models_own_end_of_text(lab, checked):
    tokenizer = load_tokenizer(lab.tokenizer)
    eot, end_of_text = (tokenizer.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|end_of_text|>"))
    generation = json.loads((lab.bundle / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [eot, end_of_text]  # the template's end of turn first
    serving = ServingConfig.model_validate_json((lab.bundle / "serving_config.json").read_text())
    assert list(serving.decoding.stop_token_ids) == [eot] and serving.model_stop_token_ids == [end_of_text]
    assert checked["generation_config"].status == "passed" and checked["stop_ids"].status == "passed"


def test_a_template_only_python_jinja_reads_is_refused_by_the_minijinja_check(lab, tmp_path):
    """The escapes bundles used to ship: Jinja2 renders them, so template_matches_renderer passes; minijinja leaves
    \\U0000002e as text, and only template_minijinja catches it."""
    copy = Path(shutil.copytree(lab.bundle, tmp_path / "b"))
    template = (copy / "chat_template.jinja").read_text()
    python_only = re.sub(r"\\u([0-9a-f]{4})", lambda m: f"\\U0000{m[1]}", template)
    assert python_only != template
    (copy / "chat_template.jinja").write_text(python_only)
    edit_json(copy / "tokenizer_config.json", lambda c: c.update(chat_template=python_only))
    reseal(copy)
    _, b = _parse(copy)
    results = {r.name: r for r in template_checks(b)}
    assert results["template_matches_renderer"].status == "passed"
    [message] = results["template_minijinja"].messages
    assert results["template_minijinja"].status == "failed" and "differently in minijinja" in message
    assert "minijinja gives" in message and "\\U0000" in message


def test_a_generation_config_that_drops_the_models_own_stop_id_is_refused(lab, tmp_path):
    copy = Path(shutil.copytree(lab.bundle, tmp_path / "b"))
    edit_json(copy / "generation_config.json", lambda g: g.update(eos_token_id=g["eos_token_id"][:1]))
    reseal(copy)
    _, b = _parse(copy)
    problems = check_generation_config(b)
    assert any("eos_token_id" in p and "the model's own stop ids" in p for p in problems)
    assert any("config.json names stop ids" in p for p in problems)


def test_the_recipe_of_a_dpo_arm_names_beta_and_the_nll_weight(lab, tmp_path):
    """A DPO job as the launcher records it (its config's JSON under resources.args): the card states its objective."""
    cfg = DPOConfig(model_path=lab.root / "models" / "parent-chat", data_path=lab.root / "data" / "rows.jsonl",
                    output_dir=tmp_path / "dpo", beta=0.25, nll_weight=0.5, lr=5e-6, steps=30, batch_size=16,
                    micro_batch_size=4)
    job = lab.nb.start_job("dpo-arm", session=SESSION, kind="dpo", executor="local",
                           resources={"args": json.loads(cfg.model_dump_json())}, forecast_gpuh=0.01)
    said = card._training_recipe(job, job.resources["args"])
    assert said.startswith("full fine-tuning (every weight trained); peak learning rate 5e-06<!--")
    assert f"DPO beta 0.25<!-- nb job:{job.id} resources.args.beta -->" in said
    assert f"NLL weight 0.5<!-- nb job:{job.id} resources.args.nll_weight -->" in said
