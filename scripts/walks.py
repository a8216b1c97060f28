"""How far a job's config walks below its entry point (issue 42, item 3: configs stop at the builder).

A walk starts at an entry point's config parameter (`evals/job.py:run:cfg`) and follows the config object wherever
it is passed on unchanged, as a bare argument, into another function of the project, and from there on. It counts

- stays: the functions the config reaches below the entry point (each once), and
- returns: the reads `config.<field>` in those functions (every read site; a read of a property or a method of
  the config counts too): the values pulled out of it below the entry point.

The entry point's own reads are its building, printed beside the walk. A config that stops at the builder stays
in few functions below it and few values are pulled out of it there. The `[train]` lr's path is
measured apart: the files of the lab's path (agent/, tools/ but the toy world's builder and the nomination's
card, trainers/, run_agent.py) that read or write an lr (`.lr`, `lr=`, a key "lr").

    .venv/bin/python scripts/walks.py               # the working tree
    .venv/bin/python scripts/walks.py --rev 8f09ceb # a commit (8f09ceb: the code of Dec 3)

tests/test_walks.py holds the working tree's walks to their current lengths.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "tools", "trainers", "evals", "memory", "core")
# The walks the issue names: (file, function, config parameter).
WALKS = (("evals/job.py", "run", "cfg"), ("trainers/dpo.py", "train", "config"), ("trainers/sft.py", "train", "config"),
         ("trainers/klce.py", "train", "config"), ("trainers/rft.py", "train", "config"))
LR_PATH_LEFT_OUT = ("tools/world/", "tools/nomination/")


@dataclass
class Module:
    """One parsed source file: its functions (`f`, `Class.f`) and what its names import."""

    name: str
    path: str
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    classes: set[str] = field(default_factory=set)
    modules: dict[str, str] = field(default_factory=dict)  # local name -> project module
    names: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)


def sources(rev: str | None) -> dict[str, str]:
    """Path -> text of the project's Python files, in the working tree or at `rev`."""
    if rev is None:
        files = [REPO / "run_agent.py"] + [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
        return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in files}
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "--", "run_agent.py", *PACKAGES], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    return {p: subprocess.run(["git", "show", f"{rev}:{p}"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout for p in listed if p.endswith(".py")}


def module_name(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(texts: dict[str, str]) -> dict[str, Module]:
    known = {module_name(p) for p in texts}
    out = {}
    for path, text in texts.items():
        mod = Module(module_name(path), path)
        tree = ast.parse(text, filename=path)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                mod.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                mod.classes.add(node.name)
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        mod.functions[f"{node.name}.{item.name}"] = item
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known:
                        mod.modules[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in known:
                        mod.modules[a.asname or a.name] = sub
                    elif node.module in known:
                        mod.names[a.asname or a.name] = (node.module, a.name)
        out[mod.name] = mod
    return out


def resolve(mods: dict[str, Module], mod: Module, qual: str, call: ast.Call) -> tuple[Module, str] | None:
    """The project function a call lands in: a function of this module or one imported, a module's function, a
    class's __init__, or a method called on `self`."""
    def lookup(m: Module, name: str, depth: int = 0) -> tuple[Module, str] | None:
        if name in m.functions:
            return m, name
        if name in m.classes:
            return (m, f"{name}.__init__") if f"{name}.__init__" in m.functions else None
        if name in m.names and depth < 3:
            owner, real = m.names[name]
            return lookup(mods[owner], real, depth + 1)
        return None

    f = call.func
    if isinstance(f, ast.Name):
        return lookup(mod, f.id)
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        if f.value.id in mod.modules:
            return lookup(mods[mod.modules[f.value.id]], f.attr)
        if f.value.id == "self" and "." in qual:
            name = f"{qual.split('.')[0]}.{f.attr}"
            return (mod, name) if name in mod.functions else None
    return None


def parameter_for(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool, call: ast.Call, var: str) -> str | None:
    """The callee's parameter that receives `var` when it is passed as a bare argument."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args][1 if method else 0:]
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Name) and arg.id == var and i < len(params):
            return params[i]
    for kw in call.keywords:
        if kw.arg and isinstance(kw.value, ast.Name) and kw.value.id == var:
            return kw.arg
    return None


def walk(mods: dict[str, Module], path: str, function: str, var: str) -> tuple[int, int, int, list[str]]:
    """(stays, returns, the entry point's own reads, the functions reached) of one config parameter."""
    start = mods[module_name(path)]
    seen: set[tuple[str, str, str]] = set()
    todo = [(start, function, var)]
    reads = {True: 0, False: 0}  # below the entry point, in it
    while todo:
        mod, qual, name = todo.pop()
        below = (mod.name, qual) != (start.name, function)
        if (mod.name, qual, name) in seen:
            continue
        seen.add((mod.name, qual, name))
        fn = mod.functions[qual]
        for node in ast.walk(fn):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name
                    and isinstance(node.ctx, ast.Load)):
                reads[below] += 1
            elif isinstance(node, ast.Call):
                target = resolve(mods, mod, qual, node)
                if target is None:
                    continue
                callee_mod, callee = target
                method = "." in callee and not any(isinstance(d, ast.Name) and d.id == "staticmethod"
                                                   for d in callee_mod.functions[callee].decorator_list)
                param = parameter_for(callee_mod.functions[callee], method, node, name)
                if param is not None:
                    todo.append((callee_mod, callee, param))
    reached = sorted({f"{m}:{q}" for m, q, _ in seen} - {f"{start.name}:{function}"})
    return len(reached), reads[True], reads[False], reached


def lr_files(texts: dict[str, str]) -> list[str]:
    """The files of the lab's path that read or write an lr."""
    found = []
    for path, text in texts.items():
        if path.startswith(LR_PATH_LEFT_OUT) or path.startswith(("memory/", "evals/", "core/")):
            continue
        for node in ast.walk(ast.parse(text, filename=path)):
            if ((isinstance(node, ast.Attribute) and node.attr == "lr")
                    or (isinstance(node, ast.keyword) and node.arg == "lr")
                    or (isinstance(node, ast.Constant) and node.value == "lr")):
                found.append(path)
                break
    return sorted(found)


def measure(rev: str | None = None) -> dict[str, tuple[int, int]]:
    """Walk name -> (stays, returns), and "lr" -> (files, 0)."""
    texts = sources(rev)
    mods = parse(texts)
    out = {}
    for path, function, var in WALKS:
        if path in texts and function in mods[module_name(path)].functions:
            stays, reads, _, _ = walk(mods, path, function, var)
            out[f"{path}:{function}:{var}"] = (stays, reads)
    out["[train] lr"] = (len(lr_files(texts)), 0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", help="measure the code of this commit instead of the working tree")
    parser.add_argument("--verbose", action="store_true", help="name the functions each walk reaches")
    args = parser.parse_args(argv)
    texts = sources(args.rev)
    mods = parse(texts)
    for path, function, var in WALKS:
        if path not in texts or function not in mods[module_name(path)].functions:
            continue
        stays, reads, own, reached = walk(mods, path, function, var)
        print(f"{path}:{function}:{var}: {stays} stays / {reads} returns ({own} reads in the entry point)")
        if args.verbose:
            print("".join(f"    {r}\n" for r in reached), end="")
    files = lr_files(texts)
    print(f"[train] lr: {len(files)} files" + (": " + ", ".join(files) if args.verbose else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
