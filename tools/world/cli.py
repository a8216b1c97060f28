"""`python run_agent.py world ...`: build the toy world, or measure a checkpoint's ground truth in it.

    python run_agent.py world build [--lab DIR] [--seed N] [--size demo|test|gpu|gpu-test] [--template chatml|llama3|gemma]
                                    [--variant default|noisy-judge|small-holdout|harmful-arms|strong-parent|misleading-screens]
    python run_agent.py world truth CHECKPOINT [--lab DIR] [--vs OTHER|opponent] [--n 2000] [--seed S] [--json FILE]
                                               [--device cpu|cuda]

Exit status: 0 on success, 2 on bad input (nothing written).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from core.display import shown
from core.loading import UnsafeModelError, model_problems
from core.util import write_json_atomic
from memory.records import TRUTH_N_MAX, TRUTH_N_MIN
from tools.world import variants


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="world_command", metavar="WORLD_COMMAND", required=True)
    b = sub.add_parser("build", help="build (or find cached) the toy world in a lab directory")
    b.add_argument("--lab", type=Path, default=Path("lab"), help="lab directory to build into")
    b.add_argument("--seed", type=int, default=0, help="world seed (same seed, same files)")
    b.add_argument("--size", choices=["demo", "test", "gpu", "gpu-test"], default="demo",
                   help="demo (the default lab), test (fast), gpu (a 332M-parameter hybrid parent and a LoRA lab for "
                        "one GPU; built on the GPU) or gpu-test (the gpu world's code at the test's size)")
    b.add_argument("--template", choices=["chatml", "llama3", "gemma"], default="chatml",
                   help="chat-template family of the world's tokenizer and models (a session on it trains, evaluates "
                        "and ships in that template)")
    b.add_argument("--variant", default="default", metavar="NAME",
                   help="world variant (tools/world/variants.py): " + ", ".join(variants.VARIANT_NAMES) + " (default: the world "
                        "as it is)")
    t = sub.add_parser("truth", help="true win rate of a checkpoint on a fresh sample (noise-free oracle)")
    t.add_argument("checkpoint", type=Path, help="checkpoint directory to measure")
    t.add_argument("--lab", type=Path, default=Path("lab"), help="the toy world's lab directory")
    t.add_argument("--vs", help="checkpoint to measure against, or 'opponent' (default: the lab's parent)")
    t.add_argument("--n", type=int, default=2000, help="prompts in the fresh sample")
    t.add_argument("--seed", type=int, default=0, help="truth sample seed (kept apart from every pool of the build)")
    t.add_argument("--json", type=Path, help="also write the result as JSON to this file")
    t.add_argument("--device", default="cpu", help="torch device that generates the answers (cpu, cuda)")


def _build(args: argparse.Namespace) -> int:
    from tools.paths import LabPaths
    from tools.world.build import build, check_build

    t0 = time.perf_counter()
    try:  # before anything is written
        variants.variant(args.variant)
    except variants.UnknownVariant:
        print(f"error: --variant {shown(args.variant)}: unknown world variant; expected one of "
              f"{', '.join(variants.VARIANT_NAMES)}", file=sys.stderr)
        return 2
    check_build(args.lab, args.seed, args.size, args.template, args.variant)  # before the lock file: a refused build leaves nothing behind
    with LabPaths(root=args.lab).writer("world build"):  # never under a running session, nor two builds at once
        manifest, rebuilt = build(args.lab, seed=args.seed, size=args.size, template=args.template, variant=args.variant)
    what = "built" if rebuilt else "cached (manifest sha256 matches; nothing rebuilt)"
    variant = "" if args.variant == "default" else f" variant {args.variant}"
    print(f"toy world {args.size} seed {args.seed} template {args.template}{variant} in {shown(str(args.lab))}: {what}, "
          f"{len(manifest.files)} files, {time.perf_counter() - t0:.1f} s")
    return 0


def _truth(args: argparse.Namespace) -> int:
    from tools.world.truth import OPPONENT, render, truth

    if not TRUTH_N_MIN <= args.n <= TRUTH_N_MAX:  # the bound of lab.toml's [truth] n
        print(f"error: --n {args.n}: expected {TRUTH_N_MIN} to {TRUTH_N_MAX} prompts (as lab.toml's [truth] n)",
              file=sys.stderr)
        return 2
    for path in [args.checkpoint] + ([Path(args.vs)] if args.vs and args.vs != OPPONENT else []):
        problem = _checkpoint_problem(path)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    result = truth(args.lab, args.checkpoint, args.vs, n=args.n, seed=args.seed, device=args.device)
    print(shown(render(result), keep_newlines=True))  # checkpoint paths are a user's choice: escaped
    if args.json:
        write_json_atomic(args.json, result.model_dump(mode="json"))
    return 0


def _checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be measured as data (None when it can): not a full checkpoint with safetensors weights,
    or one carrying code, pickles or a malformed header (core.loading)."""
    where = shown(str(path))
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            return f"{where}: a PEFT adapter (no config.json); expected a full checkpoint (merge the adapter first)"
        return f"{where}: not a checkpoint directory (no config.json)"
    if not any(path.glob("*.safetensors")):
        return f"{where}: no safetensors weights; expected model*.safetensors (pickled weights are never read)"
    try:
        problems = model_problems(path)
    except UnsafeModelError as err:
        problems = [str(err)]
    if problems:
        return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
    return None


def main(args: argparse.Namespace) -> int:
    """Dispatch `world build` / `world truth`; bad input exits 2 with one message."""
    from tools.paths import LabLockError
    from tools.world.build import WorldError

    try:
        return _build(args) if args.world_command == "build" else _truth(args)
    except (WorldError, LabLockError) as exc:
        print(f"error: {shown(str(exc), keep_newlines=True)}", file=sys.stderr)
        return 2
