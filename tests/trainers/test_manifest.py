"""Weights manifests: weights_sha256 from the manifest written at save time, recomputed when the files changed."""

import json
import shutil

from trainers.common import WEIGHTS_MANIFEST, weights_sha256, write_weights_manifest


def test_weights_manifest_answers_without_rereading_and_notices_changes(model_dirs, tmp_path):
    model = shutil.copytree(model_dirs["llama"], tmp_path / "m")
    plain = weights_sha256(model)
    assert write_weights_manifest(model) == plain and (model / WEIGHTS_MANIFEST).is_file()
    # A poisoned manifest is believed while the files match it: proof that the files were not read again.
    blob = json.loads((model / WEIGHTS_MANIFEST).read_text())
    (model / WEIGHTS_MANIFEST).write_text(json.dumps(blob | {"weights_sha256": "from-the-manifest"}))
    assert weights_sha256(model) == "from-the-manifest"
    # Rewritten weights (other mtime), or a new weight file, and the bytes are hashed again.
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    assert weights_sha256(model) == plain


def test_a_trained_model_carries_its_manifest(model_dirs, sft_data, tmp_path):
    from trainers.sft import SFTConfig, train

    result = train(SFTConfig(model_path=model_dirs["llama"], data_path=sft_data, output_dir=tmp_path / "run", steps=1,
                             batch_size=8, micro_batch_size=8))
    blob = json.loads((result.model_dir / WEIGHTS_MANIFEST).read_text())
    assert set(blob["files"]) == {"model.safetensors"}
    (result.model_dir / WEIGHTS_MANIFEST).unlink()
    assert blob["weights_sha256"] == weights_sha256(result.model_dir)  # the same digest as from the bytes
