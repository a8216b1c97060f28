"""Every chat-template family end to end on a tiny model: taught in its own template, it stops on the stop ids
derived from that template, and its bundle ships that template and passes check-bundle; a bundle whose template was
swapped for another family's fails it.

Per family (core/templates.py), built once for the module: the family's offline tokenizer, a tiny Llama taught with
the project's SFT trainer (in-process) to answer briefly and end its turn, a notebook session that records it and a
served evaluation of it (a real eval job, in-process), and its bundle (tools/nomination/bundle.py).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core import chat, tiny
from core.templates import FAMILIES, FAMILY
from evals import synthetic
from evals.decoding import Decoding
from evals.generate import generate, load
from evals.job import EvalJobConfig, SuiteSpec
from evals.job import run as run_eval
from evals.records import record_result
from memory.notebook import Notebook
from tools.nomination.bundle import ServingConfig, write_bundle
from tools.nomination.check_bundle import check_bundle
from trainers import sft
from trainers.common import weights_sha256

pytestmark = pytest.mark.slow

SESSION = "fam"
SYSTEM = "You are a careful assistant."


@dataclass
class Taught:
    family: str
    model: Path
    items: list
    decoding: Decoding
    bundle: Path
    notebook: Path


def _teach(root: Path, family: str) -> Path:
    """A tiny Llama of the family's tokenizer, taught (40 SFT steps) to answer digit sums briefly and stop."""
    tok = tiny.build_tokenizer(root / "tokenizer", template=family)
    raw = tiny.build_model("llama", tok, root / "init", seed=0)
    tasks = synthetic.generate("digit_sum", 48, seed=77)
    rows = [{"messages": [*(m.model_dump() for m in t.item.messages),
                          {"role": "assistant", "content": f"Answer: {t.item.gold}"}]} for t in tasks]
    (root / "stage1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = sft.train(sft.SFTConfig(model_path=raw, data_path=root / "stage1.jsonl", output_dir=root / "stage1",
                                     system_prompt=SYSTEM, steps=40, lr=3e-3, batch_size=16, micro_batch_size=16))
    return result.model_dir


def _bundle(root: Path, model: Path, items_path: Path, decoding: Decoding) -> tuple[Path, Path]:
    """The taught model recorded in a notebook with one served evaluation, and its bundle."""
    nb = Notebook.open(root / "notebook.db")
    try:
        nb.open_session(SESSION, lab=str(root), budget_gpuh=1.0, reserve_gpuh=0.05, planner="playbook",
                        executor="local", config={"world": "families"})
        art = nb.add_artifact(kind="checkpoint", name="taught", path=str(model), sha256=weights_sha256(model),
                              parents=[], recipe={"role": "parent"}, job_key=None, session=SESSION).id
        cfg = EvalJobConfig(checkpoint=model, decoding=decoding, served=True, output_dir=root / "eval",
                            suites=(SuiteSpec(name="stop", scorer="length_stop", items_path=items_path),),
                            replicates=1, batch_size=16)
        record_result(nb, SESSION, art, run_eval(cfg))
        return write_bundle(nb, SESSION, art, root / "bundle").path, nb.path
    finally:
        nb.close()


@pytest.fixture(scope="module")
def taught(tmp_path_factory) -> dict[str, Taught]:
    torch.set_num_threads(1)
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(f"family-{family}")
        model = _teach(root, family)
        items = [t.item for t in synthetic.generate("digit_sum", 6, seed=11)]
        items_path = root / "items.jsonl"
        items_path.write_text("".join(i.model_dump_json() + "\n" for i in items))
        decoding = Decoding(system_prompt=SYSTEM, max_new_tokens=24,
                            stop_token_ids=tuple(chat.stop_ids(load(model).tokenizer)))
        bundle, notebook = _bundle(root, model, items_path, decoding)
        out[family] = Taught(family, model, items, decoding, bundle, notebook)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_derived_stop_ids_end_generation(taught, family):
    t = taught[family]
    loaded = load(t.model)
    answers = generate(loaded, t.items, t.decoding, seed=0)
    assert all(a.stopped and not a.truncated for a in answers), [a.text for a in answers]
    assert all(a.n_tokens < t.decoding.max_new_tokens for a in answers)
    # Without them (stopping on padding only) the same model runs on to the token limit: the stop came from them.
    unstoppable = t.decoding.model_copy(update={"stop_token_ids": (loaded.tokenizer.pad_token_id,)})
    assert not any(a.stopped for a in generate(loaded, t.items, unstoppable, seed=0))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bundle_of_each_family_ships_its_template_and_passes_check_bundle(taught, family):
    t = taught[family]
    own = chat.chat_format(load(t.model).tokenizer)
    assert own.source == "model" and own.template == FAMILY[family].template  # trained, still in its own template
    assert (t.bundle / "training_chat_template.jinja").read_text() == own.template
    shipped = (t.bundle / "chat_template.jinja").read_text()
    # the model's own template, behind the served system prompt; transformers' training-only {% generation %}
    # markers (Nemotron's) written as plain blocks, which servers' Jinja engines (minijinja) also know
    assert shipped.endswith(chat.without_generation_markers(own.template))
    assert not re.search(r"{%-?\s*(end)?generation\s*-?%}", shipped)
    report = check_bundle(t.bundle, notebook_path=t.notebook)
    assert report.ok, report.failures()
    statuses = {r.name: r.status for r in report.results}
    assert statuses["template_matches_renderer"] == statuses["template_minijinja"] == "passed"
    serving = ServingConfig.model_validate_json((t.bundle / "serving_config.json").read_text())
    assert list(serving.decoding.stop_token_ids) == own.stop_token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bundle_whose_template_was_swapped_fails_check_bundle(taught, family, tmp_path):
    t = taught[family]
    other = taught[FAMILIES[(FAMILIES.index(family) + 1) % len(FAMILIES)]]
    swapped = shutil.copytree(t.bundle, tmp_path / "swapped")
    template = (other.bundle / "chat_template.jinja").read_text()
    (swapped / "chat_template.jinja").write_text(template)
    config = json.loads((swapped / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (swapped / "tokenizer_config.json").write_text(json.dumps(config))
    report = check_bundle(swapped, notebook_path=t.notebook)
    assert not report.ok
    [message] = report.failures()["template_matches_renderer"]
    assert "differs from the training renderer" in message and "training_chat_template.jinja" in message
