"""Loading a model, tokenizer or config from a local path as data, never as code.

    from core.loading import load_causal_lm, load_config, load_tokenizer
    model = load_causal_lm(path, dtype=torch.float32)

Every directory the lab loads (a base model, a checkpoint, an adapter, a bundle, a reward model) may
come from someone else. transformers runs Python found beside the weights when a config names it
(`auto_map`) and the caller trusts remote code, and asks on stdin otherwise ("[y/N]", so `yes y | ...`
ran a bundle's code); `pytorch_model.bin` / `adapter_model.bin` are pickles, which run code when
unpickled. So every load here pins `trust_remote_code=False` and reads safetensors only, and first
refuses (UnsafeModelError, naming the file) a directory that carries code, an `auto_map`, or pickled
weights, or whose tokenizer files are beyond `TOKENIZER_FILE_LIMIT`.

Nor is code fetched from the Hub: transformers (5.25 on) turns Hub kernels on by default when the `kernels`
package is installed, which downloads kernel code from the Hub and runs it inside the load (and fails offline). Every
load here passes `use_kernels=False`, and every job runs with USE_HUB_KERNELS=0 (tools/jobs/jobrun.py), which also
turns off the lazy per-function Hub lookups that `use_kernels` does not reach. The fused Mamba kernels come from the
`mamba-ssm` and `causal-conv1d` packages the user installed, as transformers' fallback order has it.
"""

from __future__ import annotations

import contextlib
import json
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

from core.display import shown

# The JSON files whose `auto_map` makes transformers import a module from the directory.
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json", "adapter_config.json", "processor_config.json",
                  "preprocessor_config.json")
# Weight formats that are pickles (torch.load): code on load, so refused rather than read.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# The largest tokenizer file read. Real ones are far below (Gemma 3's tokenizer.json is 33 MB, Llama 3's 9 MB);
# a hostile 200 MB one would otherwise be parsed whole, unbounded.
TOKENIZER_FILE_LIMIT = 64 * 1024**2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
# A config file is small; one past this is not a config (and is not parsed to find out).
CONFIG_FILE_LIMIT = 16 * 1024**2
# safetensors refuses headers past 100 MB itself; a header is read whole to be checked, so the same bound.
HEADER_LIMIT = 100 * 1024**2


class UnsafeModelError(ValueError):
    """A model directory that would run code or unpickle data when loaded, or is out of bounds."""


def model_problems(path: str | Path) -> list[str]:
    """Why loading the directory at `path` would not be data only (empty when it would be)."""
    path = Path(path)
    if not path.is_dir():
        return []  # not a directory: the loader's own message says so
    problems = []
    where = shown(str(path))
    for entry in sorted(path.iterdir()):
        name = shown(entry.name)  # a file name is someone else's text
        if entry.suffix == ".py":
            problems.append(f"{where}/{name}: Python code in a model directory; expected weights and configs only "
                            "(code beside weights is never run)")
        elif entry.suffix in PICKLE_SUFFIXES:
            problems.append(f"{where}/{name}: pickled weights (run code when unpickled); expected safetensors")
        elif entry.name in TOKENIZER_FILES and entry.is_file() and entry.stat().st_size > TOKENIZER_FILE_LIMIT:
            problems.append(f"{where}/{name}: {entry.stat().st_size} bytes; expected a tokenizer file of at most "
                            f"{TOKENIZER_FILE_LIMIT} bytes")
        elif entry.suffix == ".safetensors" and entry.is_file():
            problems += [f"{where}/{name}: {why}; expected a safetensors file" for why in header_problems(entry)]
    for file in AUTO_MAP_FILES:
        if _has_auto_map(path / file):
            problems.append(f"{where}/{file}: names custom code (auto_map); expected a model transformers "
                            "implements itself (remote code is never trusted)")
    return problems


def header_problems(path: Path) -> list[str]:
    """What is wrong with a safetensors file's header (its length, JSON and entry types), read alone and bounded:
    the library would otherwise fail on it with a traceback of its own."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = path.stat().st_size
        if len(head) < 8:
            return [f"{size} bytes, shorter than a header"]
        (length,) = struct.unpack("<Q", head)
        if length > min(HEADER_LIMIT, size - 8):
            return [f"a header of {length} bytes in a file of {size} (at most {HEADER_LIMIT})"]
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError):
            return ["a header that is not JSON"]
    if not isinstance(header, dict):
        return [f"a header that is a JSON {type(header).__name__}, not an object"]
    # Types only: whether the data is all there (a truncated file) is for the weights' sizes and hashes to say.
    bad = [k for k, v in header.items() if k != "__metadata__" and not _is_entry(v)]
    if bad:
        return [f"{len(bad)} header entries (e.g. {shown(bad[0], limit=80)}) that are not a tensor's dtype, shape and "
                "data_offsets"]
    return []


def _is_entry(v) -> bool:
    offsets = v.get("data_offsets") if isinstance(v, dict) else None
    return (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] and isinstance(v.get("dtype"), str)
            and isinstance(v.get("shape"), list) and all(type(d) is int and d >= 0 for d in v["shape"]))


def _has_auto_map(path: Path) -> bool:
    if not path.is_file():
        return False
    if path.stat().st_size > CONFIG_FILE_LIMIT:
        raise UnsafeModelError(f"{shown(str(path))}: {path.stat().st_size} bytes; expected a config file of at most "
                               f"{CONFIG_FILE_LIMIT} bytes")
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return False  # not JSON: the loader names it; nothing here can name code
    return isinstance(data, dict) and "auto_map" in data


def refuse_unsafe(path: str | Path) -> None:
    """Raise UnsafeModelError (the first problem, and how many more) unless the directory is data only."""
    problems = model_problems(path)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UnsafeModelError(problems[0] + more)


def load_config(path: str | Path, **kwargs):
    from transformers import AutoConfig

    refuse_unsafe(path)
    return AutoConfig.from_pretrained(path, trust_remote_code=False, **kwargs)


def load_tokenizer(path: str | Path, **kwargs):
    from transformers import AutoTokenizer

    refuse_unsafe(path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **kwargs)


def load_causal_lm(path: str | Path, **kwargs):
    from transformers import AutoModelForCausalLM

    refuse_unsafe(path)
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False, use_safetensors=True, use_kernels=False,
                                                **kwargs)


def load_sequence_classifier(path: str | Path, **kwargs):
    from transformers import AutoModelForSequenceClassification

    refuse_unsafe(path)
    return AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=False, use_safetensors=True,
                                                              use_kernels=False, **kwargs)


def model_from_config(config, **kwargs):
    """An uninitialised model of a config loaded by load_config (which refused any auto_map)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, trust_remote_code=False, **kwargs)


@contextlib.contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around every PeftModel construction (a load, `get_peft_model`): peft 0.21 reads transformers' deprecated
    `is_gradient_checkpointing` there, which warns on 5.25 (a FutureWarning in every LoRA job's log) and is removed
    in v6. The call is peft's, not ours; only that one warning is silenced, and only while peft wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def load_adapter(base, path: str | Path, **kwargs):
    """A PEFT adapter directory over a loaded base model: safetensors only (peft would torch.load a .bin)."""
    from peft import PeftModel

    refuse_unsafe(path)
    if not (Path(path) / "adapter_model.safetensors").is_file():
        raise UnsafeModelError(f"{shown(str(path))}: no adapter_model.safetensors; expected the adapter's weights as safetensors")
    with peft_wrapping():
        return PeftModel.from_pretrained(base, path, **kwargs)
