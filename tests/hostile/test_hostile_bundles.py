"""Hostile bundles and checkpoints are data, never code (issue 34, section 1).

`check-bundle` and `world truth` run as real subprocesses on a real bundle of a tiny Llama (tests/hostile/
bundle_kit.py) that each case breaks one way. Every case asserts the exit status, no traceback, the message
naming the place, nothing written or changed, no process left running, and, where the bundle plants code,
that the marker file the code would write does not exist (with `yes y` on stdin, which once answered
transformers' "run the custom code? [y/N]").
"""

from __future__ import annotations

import json
import math
import os
import pickle
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import loading
from core.util import file_sha256
from tools.nomination.check_bundle import _tensor_problems

sys.path.insert(0, str(Path(__file__).parent))
import bundle_kit  # noqa: E402
from hostile_kit import REPO  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hostile-bundles")
    model = bundle_kit.build_model(root)
    return model, bundle_kit.make_bundle(model, root / "bundle")


def _cli(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """`run_agent.py ARGV` with `yes y` on stdin: an interactive "[y/N]" would be answered yes."""
    return subprocess.run([sys.executable, str(REPO / "run_agent.py"), *argv], cwd=REPO, text=True,
                          input="y\n" * 10_000, capture_output=True, timeout=timeout)


def files(root: Path) -> dict[str, tuple[int, int, bool]]:
    """Every path under root with its size, mtime and whether it is a link (a sparse 200 MB file is not read)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(Path(dirpath) / name)
            out[str(Path(dirpath, name).relative_to(root))] = (st.st_size, st.st_mtime_ns, os.path.islink(Path(dirpath) / name))
    return out


def _processes_naming(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (a bundle's unique path): none may outlive the check."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(cmdline)
    return found


def _check(bundle: Path, *where: str, status: int = 1, timeout: int = 600) -> str:
    """check-bundle on `bundle`: the status, no traceback, each of `where` in the output, nothing changed under
    the bundle's parent, no process left; returns the output."""
    before = files(bundle.parent)
    done = _cli("check-bundle", str(bundle), timeout=timeout)
    out = done.stdout + done.stderr
    assert done.returncode == status, out
    assert "Traceback" not in out, out
    for place in where:
        assert place in out, (place, out)
    assert files(bundle.parent) == before
    assert _processes_naming(str(bundle)) == []
    return out


def _copy(made, tmp_path: Path, name: str = "b") -> Path:
    return bundle_kit.copy_bundle(made[1], tmp_path / name / "bundle")


# ---- code: auto_map, .py files, pickles ------------------------------------------------------------


def _plant_custom_code(d: Path, marker: Path) -> None:
    code = f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py"):
        (d / name).write_text(code)
    bundle_kit.edit_json(d / "config.json", lambda c: c.update(auto_map={
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}))
    bundle_kit.edit_json(d / "tokenizer_config.json", lambda c: c.update(auto_map={
        "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}))


class _Evil:
    """Pickled, it runs a command when unpickled: the marker proves whether anything unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_bundle_carrying_custom_code_is_refused_and_its_code_never_runs(made, tmp_path):
    marker = tmp_path / "ran.marker"
    b = _copy(made, tmp_path)
    _plant_custom_code(b, marker)
    out = _check(b, "modeling_evil.py: Python code in a model directory", "config.json: names custom code (auto_map)",
                 "tokenizer_config.json: names custom code (auto_map)")
    assert "FAILED  files" in out and "reload" not in out  # refused before anything is loaded
    assert not marker.exists()


def test_pickled_weights_are_refused_never_unpickled(made, tmp_path):
    marker = tmp_path / "unpickled.marker"
    full = _copy(made, tmp_path, "full")
    (full / "pytorch_model.bin").write_bytes(pickle.dumps(_Evil(marker)))
    adapter = _copy(made, tmp_path, "adapter")
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_Evil(marker)))
    _check(full, "pytorch_model.bin: pickled weights (run code when unpickled); expected safetensors")
    _check(adapter, "adapter_model.bin: pickled weights")
    assert not marker.exists()


def test_world_truth_refuses_a_checkpoint_with_code_or_pickles_and_runs_none_of_it(made, tmp_path):
    marker = tmp_path / "ran.marker"
    coded = bundle_kit.copy_bundle(made[0], tmp_path / "coded")
    _plant_custom_code(coded, marker)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((made[0] / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(_Evil(marker)))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    lab = tmp_path / "no-lab"  # refused before the lab is read
    for path, where in [(coded, "configuration_evil.py: Python code in a model directory"),
                        (pickled, "no safetensors weights"), (adapter, "a PEFT adapter (no config.json)")]:
        before = files(tmp_path)
        done = _cli("world", "truth", str(path), "--lab", str(lab), "--n", "20")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert where in done.stderr and str(path) in done.stderr, done.stderr
        assert files(tmp_path) == before
    assert not marker.exists()


def test_every_loader_refuses_code_and_pins_remote_code_off(made, tmp_path):
    """The shared loader refuses before transformers sees the directory, and no product file calls a transformers
    Auto* loader except through it or with trust_remote_code=False."""
    marker = tmp_path / "ran.marker"
    coded = bundle_kit.copy_bundle(made[0], tmp_path / "coded")
    _plant_custom_code(coded, marker)
    for load in (loading.load_config, loading.load_tokenizer, loading.load_causal_lm):
        with pytest.raises(loading.UnsafeModelError, match="Python code in a model directory"):
            load(coded)
    assert not marker.exists()
    unpinned = []
    for path in REPO.glob("*/**/*.py"):
        if path.parts[len(REPO.parts)] in (".venv", "tests") or path.name == "loading.py":
            continue
        for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ("Auto" in line and ".from_pretrained(" in line or "PeftModel.from_pretrained(" in line) \
                    and "trust_remote_code=False" not in line and not line.lstrip().startswith(("#", '"')):
                unpinned.append(f"{path.relative_to(REPO)}:{k}: {line.strip()}")
    assert unpinned == []


# ---- confinement ---------------------------------------------------------------------------------


def test_no_file_of_a_bundle_may_lead_out_of_it_and_outside_content_is_never_printed(made, tmp_path):
    linked = _copy(made, tmp_path, "linked")
    shard = next(linked.glob("model-*.safetensors"))
    shard.unlink()
    shard.symlink_to(next(made[0].glob("*.safetensors")))  # the same weights, kept elsewhere
    passwd = _copy(made, tmp_path, "passwd")
    (passwd / "system_prompt.txt").unlink()
    (passwd / "system_prompt.txt").symlink_to("/etc/passwd")
    out = _check(linked, f"{shard.name} is a symbolic link leading out of the bundle")
    out += _check(passwd, "system_prompt.txt is a symbolic link leading out of the bundle")
    assert "root:" not in out


def test_a_fifo_or_a_hard_link_in_a_bundle_is_refused_unread(made, tmp_path):
    """A FIFO in serving_config.json's place waited for a writer forever; a hard link to a file outside the bundle
    was read, and its first characters printed. Each is refused from its own stats, never opened."""
    fifo = _copy(made, tmp_path, "fifo")
    (fifo / "serving_config.json").unlink()
    os.mkfifo(fifo / "serving_config.json")
    linked = _copy(made, tmp_path, "hardlink")
    outside = tmp_path / "outside-secret.txt"
    outside.write_text("OUTSIDE-SECRET root:x:0:0")
    (linked / "system_prompt.txt").unlink()
    os.link(outside, linked / "system_prompt.txt")
    t0 = time.monotonic()
    out = _check(fifo, "serving_config.json: a named pipe (FIFO), not a regular file", timeout=120)
    assert time.monotonic() - t0 < 60
    out += _check(linked, "system_prompt.txt: a hard link (2 names of one file), not a file of its own", timeout=120)
    assert "OUTSIDE-SECRET" not in out and "skipped reload" not in out  # refused before anything is read


def test_a_device_in_a_bundle_is_refused_unopened(made, tmp_path):
    """A character device (/dev/zero's numbers) as a tokenizer file the tokenizer's load reads was read without bound
    (2.5 GB in 9 s, then a traceback)."""
    dev = _copy(made, tmp_path, "device")
    try:
        os.mknod(dev / "special_tokens_map.json", 0o644 | stat.S_IFCHR, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD")
    t0 = time.monotonic()
    _check(dev, "special_tokens_map.json: a character device, not a regular file", timeout=120)
    assert time.monotonic() - t0 < 60


def test_an_adapters_base_holding_a_fifo_is_refused_unread(made, tmp_path):
    """An adapter bundle names its base, a directory outside it: a FIFO as the base's weights stopped the base's
    hash forever. Its entries are checked from their stats before anything of it is read."""
    b = _copy(made, tmp_path, "adapter")
    base = tmp_path / "adapter" / "base"
    base.mkdir()
    (base / "config.json").write_text((made[0] / "config.json").read_text())
    os.mkfifo(base / "model.safetensors")
    adapter = b / "adapter_model.safetensors"
    adapter.write_bytes(next(b.glob("model-*.safetensors")).read_bytes())
    (b / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "peft_type": "LORA"}))
    digest = {"bytes": adapter.stat().st_size, "sha256": file_sha256(adapter)}
    bundle_kit.edit_json(b / "serving_config.json", lambda s: s.update(weights={
        "kind": "adapter", "files": {adapter.name: digest}, "index": None,
        "base": {"path": str(base), "revision": "0" * 64}}))
    t0 = time.monotonic()
    _check(b, f"FAILED  adapter_base: the recorded base {base} holds model.safetensors: a named pipe (FIFO), not a "
              "regular file", timeout=120)
    assert time.monotonic() - t0 < 90


def test_a_shard_is_hashed_only_once_its_header_describes_its_size(made, tmp_path):
    """A sparse terabyte in a shard's place, its size recorded in serving_config.json, was hashed in full (about 15
    minutes of I/O): its header describes a few kB, so it is refused unread. A header whose tensors span other than
    their shape says is refused before hashing too."""
    sparse = _copy(made, tmp_path, "sparse")
    shard = next(sparse.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(1024**4)
    bundle_kit.edit_json(sparse / "serving_config.json", lambda s: s["weights"]["files"][shard.name].update(bytes=1024**4))
    t0 = time.monotonic()
    out = _check(sparse, f"{shard.name}: {1024**4} bytes, but its header describes", timeout=120)
    assert time.monotonic() - t0 < 90 and "skipped reload" in out
    shaped = _copy(made, tmp_path, "shaped")
    shard = next(shaped.glob("model-*.safetensors"))
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    name = next(k for k, v in header.items() if k != "__metadata__" and math.prod(v["shape"]) > 1)
    header[name]["shape"] = [1]  # one element, whatever its data_offsets span
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)  # the same length: sizes stay recorded
    assert len(text) == length
    shard.write_bytes(data[:8] + text + data[8 + length:])
    assert _tensor_problems(shard) == [f"{shard.name}: 1 tensors (e.g. {name}) span other than their shape times "
                                       "their dtype's size; expected a safetensors header that describes its tensors "
                                       "(not hashed)"]


def test_no_name_in_the_serving_config_or_the_index_may_leave_the_bundle(made, tmp_path):
    traversal = _copy(made, tmp_path, "traversal")
    (traversal.parent / "outside.jinja").write_text("{{ 'outside' }}")
    bundle_kit.edit_json(traversal / "serving_config.json", lambda s: s.update(chat_template_file="../outside.jinja"))
    absolute = _copy(made, tmp_path, "absolute")
    outside_shard = str(next(made[0].glob("*.safetensors")))
    bundle_kit.edit_json(absolute / "serving_config.json",  # a bundle holding no weights of its own
                         lambda s: s["weights"].update(files={outside_shard: next(iter(s["weights"]["files"].values()))}))
    for shard in absolute.glob("model-*.safetensors"):
        shard.unlink()
    index = _copy(made, tmp_path, "index")
    bundle_kit.edit_json(index / "model.safetensors.index.json",
                         lambda i: i.update(weight_map=dict.fromkeys(i["weight_map"], "../../" + Path(outside_shard).name)))
    bundle_kit.reseal(index)  # the forger re-recorded the manifest: the index check itself must catch it
    _check(traversal, "serving_config.json names ../outside.jinja; expected a plain file name of the bundle")
    _check(absolute, f"serving_config.json names {outside_shard}; expected a plain file name")
    out = _check(index, "model.safetensors.index.json maps tensors to ../../model.safetensors, a name outside the bundle")
    assert "ok      weights" not in out and "skipped reload" in out


# ---- bounds --------------------------------------------------------------------------------------


def _set_template(b: Path, template: str) -> None:
    (b / "chat_template.jinja").write_text(template, encoding="utf-8")
    bundle_kit.edit_json(b / "tokenizer_config.json", lambda c: c.update(chat_template=template))
    bundle_kit.reseal(b)


def test_a_template_that_never_ends_or_explodes_is_stopped_by_the_checks_bounds(made, tmp_path):
    loop = _copy(made, tmp_path, "loop")
    _set_template(loop, "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'xxxxxxxxxxxxxxxx' }}"
                        "{% endfor %}{% endfor %}")
    huge = _copy(made, tmp_path, "huge")
    _set_template(huge, "{{ 'x' * 10**12 }}")
    for b in (loop, huge):
        t0 = time.monotonic()
        out = _check(b, "FAILED  template_bounds: chat_template.jinja renders more than 1048576 characters",
                     "skipped template_compiles", "skipped reload")
        assert "MemoryError" not in out
        assert time.monotonic() - t0 < 200
    idle = _copy(made, tmp_path, "idle")  # loops without printing: the child's time limit stops it
    _set_template(idle, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    t0 = time.monotonic()
    _check(idle, "FAILED  template_bounds: the template checks did not finish in bounds: stopped", "skipped reload")
    assert time.monotonic() - t0 < 200


def test_generation_is_capped_by_the_checks_own_limit_not_the_files(made, tmp_path):
    b = bundle_kit.copy_bundle(made[1], tmp_path / "long" / "bundle")
    def long(s):
        s["decoding"]["max_new_tokens"] = 200_000
    bundle_kit.edit_json(b / "serving_config.json", long)
    from evals.decoding import Decoding
    serving = json.loads((b / "serving_config.json").read_text())
    serving["decoding_sha256"] = Decoding.model_validate(serving["decoding"]).fingerprint()
    (b / "serving_config.json").write_text(json.dumps(serving))
    bundle_kit.edit_json(b / "generation_config.json", lambda g: g.update(max_new_tokens=200_000))
    bundle_kit.reseal(b)
    t0 = time.monotonic()
    out = _check(b, "did not end on a stop id within 256 tokens")
    assert time.monotonic() - t0 < 300
    beams = _copy(made, tmp_path, "beams")
    bundle_kit.edit_json(beams / "generation_config.json", lambda g: g.update(num_beams=64, min_new_tokens=10_000))
    bundle_kit.reseal(beams)
    out = _check(beams, "generation_config.json sets min_new_tokens, num_beams; expected only the served decoding",
                 "skipped reload")
    assert "within" not in out


def test_tokenizer_files_are_bounded_and_covered_by_the_manifest(made, tmp_path):
    big = _copy(made, tmp_path, "big")
    with open(big / "tokenizer.json", "r+b") as f:  # sparse: 200 MB that take no disk
        f.truncate(200 * 1024**2)
    edited = _copy(made, tmp_path, "normalizer")
    bundle_kit.edit_json(edited / "tokenizer.json", lambda t: t.update(normalizer={"type": "Lowercase"}))
    old = _copy(made, tmp_path, "format1")
    bundle_kit.edit_json(old / "serving_config.json", lambda s: s.update(format_version=1, files=None))
    _check(big, f"tokenizer.json: {200 * 1024**2} bytes; expected a tokenizer file of at most")
    _check(edited, "tokenizer.json is", "(edited since it was written)")
    _check(old, "serving_config.json records no digests of the served files (format_version 1)")


# ---- no tracebacks -------------------------------------------------------------------------------


def test_broken_weights_metadata_gives_one_clean_message(made, tmp_path):
    no_base = _copy(made, tmp_path, "no-base")
    bundle_kit.edit_json(no_base / "serving_config.json", lambda s: s["weights"].update(kind="adapter", index=None))
    listed = _copy(made, tmp_path, "list-header")
    shard = next(listed.glob("model-*.safetensors"))
    header = json.dumps([1, 2, 3]).encode()
    shard.write_bytes(len(header).to_bytes(8, "little") + header)
    typed = _copy(made, tmp_path, "typed-header")
    shard2 = next(typed.glob("model-*.safetensors"))
    header = json.dumps({"w": {"dtype": "F32", "shape": "big", "data_offsets": ["a", 1]}}).encode()
    shard2.write_bytes(len(header).to_bytes(8, "little") + header)
    _check(no_base, "serving_config.json: weights.base", "an adapter needs the base it applies to")
    _check(listed, f"{shard.name}: a header that is a JSON list, not an object; expected a safetensors file")
    _check(typed, f"{shard2.name}: 1 header entries (e.g. w) that are not a tensor's dtype, shape and data_offsets")
