"""A serving bundle of a tiny random Llama, assembled by the bundle writer's own steps (no session needed), for the
hostile-bundle cases to break. It passes every check up to the reload (a random model does not stop)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from core import tiny
from core.chat import stop_ids
from core.loading import load_tokenizer
from evals.decoding import Decoding
from tools.nomination import bundle

SYSTEM = "You are a brief assistant."


def build_model(root: Path) -> Path:
    """A tiny Llama checkpoint (safetensors, tokenizer, generation config) under root/model."""
    tok = tiny.build_tokenizer(root / "tokenizer")
    return tiny.build_model("llama", tok, root / "model")


def make_bundle(model: Path, out: Path, max_new_tokens: int = 16) -> Path:
    """The bundle of `model` at `out`, as tools.nomination.bundle writes one (evidence without a notebook)."""
    out.mkdir(parents=True)
    weights = bundle._write_weights(model, out, bundle.DEFAULT_SHARD_BYTES)
    pad_id = bundle._write_tokenizer(model, out, SYSTEM)
    decoding = Decoding(system_prompt=SYSTEM, max_new_tokens=max_new_tokens,
                        stop_token_ids=tuple(stop_ids(load_tokenizer(model))))
    bundle._write_generation_config(out, decoding, pad_id)
    (out / "system_prompt.txt").write_text(SYSTEM, encoding="utf-8")
    evidence = bundle.TrainingEvidence(
        session="s1", notebook="", nominee=1, nominee_sha256="0" * 64, lineage=[], datasets=[], bars=[],
        comparisons=[], last_decision=bundle.DecisionRef(seq=1, hash="0" * 64), stops=None)
    (out / "training_evidence.json").write_text(evidence.model_dump_json(indent=2), encoding="utf-8")
    (out / "README.md").write_text("# card\n", encoding="utf-8")
    serving = bundle.ServingConfig(
        format_version=bundle.FORMAT_VERSION, weights=weights, add_generation_prompt=True, decoding=decoding,
        max_input_tokens=1024, decoding_sha256=decoding.fingerprint(), system_prompt_file="system_prompt.txt",
        chat_template_file="chat_template.jinja", files=bundle.served_files(out, weights))
    (out / "serving_config.json").write_text(serving.model_dump_json(indent=2), encoding="utf-8")
    return out


def copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def reseal(b: Path) -> None:
    """Re-record the digests of the served files after an edit, as a forger who rewrote serving_config.json would:
    the case then tests the check the edit is for, not the manifest."""
    serving = bundle.ServingConfig.model_validate_json((b / "serving_config.json").read_text(encoding="utf-8"))
    serving = serving.model_copy(update={"files": bundle.served_files(b, serving.weights)})
    (b / "serving_config.json").write_text(serving.model_dump_json(indent=2), encoding="utf-8")
