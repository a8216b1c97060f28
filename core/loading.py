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
import math
import os
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


# Bytes of one element of each safetensors dtype (a dtype not listed here is not size-checked: safetensors itself
# refuses one it does not know).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
# The most parameters a model's weights may hold (the largest open models hold about 10^12): a header claiming more
# describes no model the lab can train, only work (the shape estimate, a job that fails inside its load).
MAX_PARAMS = 10**13
# A config.json's sizes and counts, each with the range it may take (null: the key is left to its default). Real
# models sit far inside them (126 layers, hidden 16384, 512 experts, 262144 tokens of vocabulary, a context of
# 10M); a config past one describes no model the lab can train, and reading it would cost work in the config (50
# million layers took the shape estimate 48 s of CPU) or fail inside the first job.
MAX_LAYERS = 1024
_WIDTH, _HEADS, _EXPERTS = (1, 2**17), (1, 2**12), (0, 2**12)
CONFIG_INT_BOUNDS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers"), (1, MAX_LAYERS)),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), _WIDTH),
    **dict.fromkeys(("intermediate_size", "ffn_hidden_size", "moe_intermediate_size",
                     "moe_shared_expert_intermediate_size"), (1, 2**20)),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_key_value_heads", "mamba_num_heads", "n_groups"), _HEADS),
    **dict.fromkeys(("head_dim", "mamba_head_dim", "ssm_state_size"), (1, 2**14)),
    "vocab_size": (1, 2**23),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"),
                    (1, 2**26)),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_shared_experts",
                     "num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k"), _EXPERTS),
}
# Keys holding a list of per-layer names, or a pattern string of one character per layer.
CONFIG_LAYER_LISTS = ("layers_block_type", "layer_types")
CONFIG_LAYER_PATTERNS = ("hybrid_override_pattern",)


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


def config_problems(config: object, where: str) -> list[str]:
    """What is wrong with a config.json's contents (`where` names the file): sizes and counts that are not integers
    within CONFIG_INT_BOUNDS, per-layer lists and patterns longer than MAX_LAYERS, architectures that are not names;
    its `text_config` (a multimodal model's language model) by the same rules. Each problem names the file and key."""
    if not isinstance(config, dict):
        return [f"{where}: a JSON {type(config).__name__}; expected an object"]
    problems = []
    if not isinstance(config.get("model_type"), str) or not 0 < len(config["model_type"]) <= 100:
        problems.append(f"{where}: model_type: expected the name of a transformers model type (1-100 characters)")
    for key, (low, high) in CONFIG_INT_BOUNDS.items():
        value = config.get(key)
        if value is not None and (type(value) is not int or not low <= value <= high):
            problems.append(f"{where}: {key}: {_what(value)}; expected an integer from {low} to {high}")
    for key in CONFIG_LAYER_LISTS:
        value = config.get(key)
        if value is not None and not (isinstance(value, list) and len(value) <= MAX_LAYERS
                                      and all(isinstance(v, str) and len(v) <= 100 for v in value)):
            problems.append(f"{where}: {key}: {_what(value)}; expected a list of at most {MAX_LAYERS} layer names")
    for key in CONFIG_LAYER_PATTERNS:
        value = config.get(key)
        if value is not None and not (isinstance(value, str) and len(value) <= MAX_LAYERS):
            problems.append(f"{where}: {key}: {_what(value)}; expected a string of at most {MAX_LAYERS} characters, "
                            "one per layer")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and len(archs) <= 16
                                  and all(isinstance(a, str) and 0 < len(a) <= 100 for a in archs)):
        problems.append(f"{where}: architectures: {_what(archs)}; expected a list of class names")
    if config.get("tie_word_embeddings") not in (None, True, False):
        problems.append(f"{where}: tie_word_embeddings: {_what(config['tie_word_embeddings'])}; expected true or false")
    text = config.get("text_config")
    if text is not None:
        if isinstance(text, dict):  # its model_type may be the outer one's
            problems += config_problems({"model_type": config.get("model_type"), **text}, f"{where} text_config")
        else:
            problems.append(f"{where}: text_config: {_what(text)}; expected an object")
    return problems


def _what(value: object) -> str:
    """A config value described for a message: its type, and a number's value (never someone's text)."""
    if type(value) is int:
        return f"{value}" if len(str(value)) <= 30 else f"an integer of {len(str(value))} digits"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict, str)):
        return f"a JSON {'string' if isinstance(value, str) else type(value).__name__} of length {len(value)}"
    return f"{json.dumps(value)}"


def weights_problems(path: Path) -> tuple[list[str], int]:
    """(what is wrong with a safetensors file's tensors, its parameter count): every tensor's data lies in the file
    and spans its shape times its dtype's size, and the file holds at most MAX_PARAMS parameters. Its header is
    read alone and bounded; call after header_problems found nothing."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        data = os.fstat(f.fileno()).st_size - 8 - length
        header = json.loads(f.read(length))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    count = 0
    for name, v in tensors.items():
        n = math.prod(v["shape"])
        start, end = v["data_offsets"]
        width = DTYPE_BYTES.get(v["dtype"])
        if count + n > MAX_PARAMS:
            return [f"tensors of more than {MAX_PARAMS} parameters; expected a model's weights"], count + n
        if end > data:
            return [f"tensor {shown(name, limit=80)} ends at byte {end} of {data} bytes of data; expected its data "
                    "in the file"], count
        if width is not None and end - start != n * width:
            return [f"tensor {shown(name, limit=80)} spans {end - start} bytes, its shape and dtype {n * width}; "
                    "expected a header that describes its tensors"], count
        count += n
    return [], count


def model_dir_problems(path: Path) -> list[str]:
    """Everything the lab refuses in a model directory before a session opens (lab.toml's [model] paths): what
    model_problems refuses (code, auto_map, pickles, malformed headers), a config.json out of CONFIG_INT_BOUNDS,
    and safetensors weights whose tensors lie outside their file or hold more than MAX_PARAMS parameters in all.
    Every file is read bounded; config.json must be a regular file of at most CONFIG_FILE_LIMIT bytes."""
    where = shown(str(path))
    config = path / "config.json"
    size = config.stat().st_size
    if size > CONFIG_FILE_LIMIT:
        return [f"{where}/config.json: {size} bytes; expected a config file of at most {CONFIG_FILE_LIMIT} bytes"]
    try:
        parsed = json.loads(config.read_bytes())
    except (ValueError, RecursionError):
        return [f"{where}/config.json: not JSON; expected a transformers config"]
    problems = config_problems(parsed, f"{where}/config.json") + model_problems(path)
    if problems:
        return problems
    total = 0
    for shard in sorted(path.glob("*.safetensors")):
        wrong, count = weights_problems(shard)
        total += count
        if wrong:
            return [f"{where}/{shown(shard.name)}: {wrong[0]}"]
        if total > MAX_PARAMS:
            return [f"{where}: safetensors files of more than {MAX_PARAMS} parameters in all; expected a model's "
                    "weights"]
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
