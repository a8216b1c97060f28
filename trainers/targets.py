"""LoRA targets matched against a model's own module and parameter names, and the adapter's size, from the model's
shapes alone: a meta-device copy built from its config.json (no weights read, no peft run), so that lab.toml's
targets are checked, and a job's memory estimated, inside the agent process without building the adapter there.

peft's rules, as `LoraConfig(target_modules=[...], target_parameters=[...])` applies them: a suffix matches a name
equal to it or ending in "." + it; a matched module must be one peft can adapt (the trainers adapt `nn.Linear`
projections: embeddings, norms, convolutions and containers are refused here, where peft would fail inside the job
or adapt something the user did not mean); a matched parameter is a 2-D or 3-D weight (routed experts stored as one
tensor). An adapter of rank r adds r x (in + out) parameters per linear module or 2-D weight, and r x E x (in + out)
per 3-D weight of E experts (peft's ParamWrapper: lora_A [r E, in], lora_B [out, r E]).

    names = model_names(Path("models/parent"))
    target_problems(names, ["q_proj", "embed_tokens"], [], "train.lora")   # ['train.lora.target_modules: ...']
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from core import loading

MAX_LISTED = 20  # names listed in one message


class ModelNames(BaseModel):
    """A model's modules and parameters by full name, as peft matches target suffixes against them."""

    model_config = ConfigDict(frozen=True)
    linear: dict[str, tuple[int, int]] = Field(description="nn.Linear modules: name -> (in_features, out_features).")
    modules: dict[str, str] = Field(description="Every named module (the root left out): name -> its class name.")
    params: dict[str, tuple[int, ...]] = Field(description="Every parameter: full name -> shape.")


def names_of(model: torch.nn.Module) -> ModelNames:
    """The names of a (meta-device) model."""
    return ModelNames(
        linear={n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)},
        modules={n: type(m).__name__ for n, m in model.named_modules() if n},
        params={n: tuple(p.shape) for n, p in model.named_parameters()})


def model_names(model_dir: Path) -> ModelNames:
    """The names of the model in `model_dir`, built on the meta device from its config.json."""
    with torch.device("meta"):
        return names_of(loading.model_from_config(loading.load_config(model_dir)))


def _matching(names: list[str] | dict[str, object], suffix: str) -> list[str]:
    return [n for n in names if n == suffix or n.endswith("." + suffix)]


def _listed(names: set[str]) -> str:
    shown = sorted(names)[:MAX_LISTED]
    return ", ".join(shown) + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def module_choices(names: ModelNames) -> set[str]:
    """Suffixes that would match linear modules: the last part of each linear module's name (q_proj, in_proj, ...)."""
    return {n.rsplit(".", 1)[-1] for n in names.linear}


def parameter_choices(names: ModelNames) -> set[str]:
    """Suffixes that would match 3-D weights (routed experts): '<module>.<parameter>' of each."""
    return {".".join(n.split(".")[-2:]) for n, shape in names.params.items() if len(shape) == 3}


def target_problems(names: ModelNames, modules: list[str], params: list[str], where: str) -> list[str]:
    """Why LoRA targets cannot adapt this model, one line per target, naming `where` (the lab.toml table) and listing
    what would match; [] when every target matches only what peft adapts."""
    problems = []
    for i, suffix in enumerate(modules):
        key = f"{where}.target_modules[{i}] = {suffix!r}"
        found = _matching(names.modules, suffix)
        other = [n for n in found if n not in names.linear]
        if not found:
            problems.append(f"{key} matches no module of the parent; expected a suffix of a linear module's name: "
                            f"{_listed(module_choices(names))}")
        elif other:
            kinds = _listed({names.modules[n] for n in other})
            problems.append(f"{key} matches {len(other)} module(s) LoRA cannot adapt ({kinds}, e.g. {other[0]!r}); "
                            f"only linear projections are adapted: {_listed(module_choices(names))}")
    for i, suffix in enumerate(params):
        key = f"{where}.target_parameters[{i}] = {suffix!r}"
        found = _matching(names.params, suffix)
        flat = [n for n in found if len(names.params[n]) not in (2, 3)]
        choices = _listed(parameter_choices(names)) or "none (this model has no 3-D weights)"
        if not found:
            problems.append(f"{key} matches no parameter of the parent; expected a suffix of a 3-D weight's name: "
                            f"{choices}")
        elif flat:
            problems.append(f"{key} matches {len(flat)} parameter(s) that are no weight matrix (e.g. {flat[0]!r}, "
                            f"shape {list(names.params[flat[0]])}); expected a suffix of a 3-D weight's name: {choices}")
    return problems


def adapter_sizes(names: ModelNames, modules: list[str], params: list[str], r: int) -> dict[str, int]:
    """Parameters the LoRA adapter adds, by the full name of what it adapts (peft's shapes, module docstring)."""
    sizes = {}
    for suffix in modules:
        for name in _matching(names.linear, suffix):
            fan_in, fan_out = names.linear[name]
            sizes[name] = r * (fan_in + fan_out)
    for suffix in params:
        for name in _matching(names.params, suffix):
            shape = names.params[name]
            experts, dims = (shape[0], shape[1:]) if len(shape) == 3 else (1, shape)
            sizes[name] = r * experts * sum(dims)
    return sizes
