"""Packages depend downward only (DESIGN.md section 2), and the light paths stay light.

run_agent.py -> agent -> tools -> trainers -> evals -> memory -> core. Every import statement counts,
including the ones inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What each layer may import from the project (itself always allowed).
ALLOWED = {
    "core": set(),
    "memory": {"core"},
    "evals": {"core", "memory"},
    "trainers": {"core", "memory", "evals"},
    "tools": {"core", "memory", "evals", "trainers"},
    "agent": {"core", "memory", "evals", "trainers", "tools"},
    "run_agent": {"core", "memory", "evals", "trainers", "tools", "agent"},
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _sources() -> list[tuple[str, Path]]:
    files = [("run_agent", REPO / "run_agent.py")]
    for package in ALLOWED:
        if package != "run_agent":
            files += [(package, p) for p in sorted((REPO / package).rglob("*.py"))]
    return files


def test_no_import_points_upward():
    upward = []
    for layer, path in _sources():
        for lineno, module in _imports(path):
            top = module.split(".")[0]
            if top in ALLOWED and top != layer and top not in ALLOWED[layer]:
                upward.append(f"{path.relative_to(REPO)}:{lineno}: {layer} imports {module}")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_walker_sees_function_level_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from agent.graph import build\n    import tools.jobs.launcher\n")
    assert [m for _, m in _imports(probe)] == ["agent.graph", "tools.jobs.launcher"]


def _heavy_modules_after(code: str, heavy: tuple[str, ...] = ("torch", "transformers")) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    probe = code + f"\nimport sys\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_compare_imports_neither_torch_nor_transformers():
    assert _heavy_modules_after("import evals.compare, evals.noise, evals.sealed, evals.records") == "[]"


def test_check_feedback_imports_neither_torch_nor_transformers_nor_the_notebook(tmp_path):
    feedback = tmp_path / "f.jsonl"
    feedback.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}], "own": "x", "other": "y", '
                        '"vote": "own"}\n')
    code = f"import run_agent\nrc = run_agent.main(['check-feedback', {str(feedback)!r}])\nassert rc == 0, rc"
    # pandas arrives with sqlite-utils (the notebook): a feedback check opens no notebook, so it stays out too.
    assert _heavy_modules_after(code, ("torch", "transformers", "pandas", "memory.notebook")) == "[]"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (function-level imports included; `from pkg import mod` counts as
    importing pkg.mod where that is a module)."""
    modules = {_module_name(p): p for _, p in _sources()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs or ({node.module} & modules.keys())
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_a_package():
    graph = _import_graph()
    top = {m: m.split(".")[0] for m in graph}
    # A package's own __init__ is left out: importing a submodule always runs it, which is no cycle of behaviour.
    within = {m: {d for d in deps if top.get(d, d.split(".")[0]) == top[m] and d != top[m]} for m, deps in graph.items()}
    cycles = _cycles(within)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_sees_a_function_level_cycle():
    assert _cycles({"a.x": {"a.y"}, "a.y": {"a.x"}, "a.z": set()}) == [["a.x", "a.y"]]
