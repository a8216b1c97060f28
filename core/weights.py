"""A checkpoint's weights identity: the sha256 over its safetensors files, and the manifest beside them that spares
re-reading tens of gigabytes on every use. Standard library only: the agent process hashes artifacts without importing
torch (trainers/common.py re-exports these for the trainers)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from core.util import file_sha256, write_json_atomic

WEIGHTS_MANIFEST = "weights_manifest.json"


def weights_sha256(model_dir: Path) -> str:
    """sha256 over the model's safetensors files (names and bytes), in name order.

    Read from the directory's weights manifest (written when the weights were saved) when every listed file is
    still there with the recorded size and modification time and no other weight file appeared: a 30B checkpoint
    is ~60 GB, which cache keys and artifact hashes must not re-read on every use. Otherwise hashed from the bytes.
    """
    manifest = model_dir / WEIGHTS_MANIFEST
    if manifest.is_file():
        blob = json.loads(manifest.read_text())
        if blob["files"] == _file_stats(model_dir):
            return blob["weights_sha256"]
    return _digest({f.name: file_sha256(f) for f in model_dir.glob("*.safetensors")})


def write_weights_manifest(model_dir: Path, shard_sha256: dict[str, str] | None = None) -> str:
    """Records each weight file's sha256, size and mtime, and the combined weights_sha256, beside the weights.
    `shard_sha256` (file name -> sha256) comes from a writer that hashed while writing; else the files are read
    once, now. Returns the weights_sha256."""
    shas = shard_sha256 or {f.name: file_sha256(f) for f in model_dir.glob("*.safetensors")}
    digest = _digest(shas)
    write_json_atomic(model_dir / WEIGHTS_MANIFEST, {
        "weights_sha256": digest, "files": _file_stats(model_dir),
        "sha256": dict(sorted(shas.items()))})
    return digest


def _digest(shas: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(shas):
        digest.update(name.encode())
        digest.update(shas[name].encode())
    return digest.hexdigest()


def _file_stats(model_dir: Path) -> dict[str, list[int]]:
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(model_dir.glob("*.safetensors"))}
