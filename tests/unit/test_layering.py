"""The rooms' dependency direction is fixed (specs/__init__.py): specs at the bottom imports no other room;
cost_models and runners stand on it and never import each other; profilers reach the engine only
through its public launcher (runners.launch) and its communication layer (runners.comm, so a profiled
collective is issued exactly as the engine issues it); planner/ is the application and the only room that
combines them. Every import counts, also those inside functions; and no two modules import each other,
directly or around a longer loop."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("specs", "cost_models", "runners", "profilers", "planner")
# room -> the rooms (or, for one public entry point, the modules) it may import
ALLOWED = {
    "specs": set(),
    "cost_models": {"specs"},
    "runners": {"specs"},
    "profilers": {"specs", "runners.launch", "runners.comm", "runners.context_parallel"},
    "planner": {"specs", "cost_models", "runners", "profilers"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every project module `path` imports (absolute imports; `from a import b` counts a.b when b is a
    module, else a)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in ROOMS)
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for room in ROOMS for p in (ROOT / room).rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        # Keep the deepest name that is a module: `from specs.plan import Plan` is specs.plan.
        targets = set()
        for imported in _imports(path):
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def test_no_import_runs_against_the_layering():
    bad = []
    for module, targets in _graph().items():
        room = module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other == room:
                continue
            allowed = ALLOWED[room]
            if other not in allowed and not any(target == a or target.startswith(a + ".") for a in allowed):
                bad.append(f"{module} -> {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_import_cycles_between_modules():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The graph really reads imports inside functions (what a lazy upward import would hide in)."""
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from cost_models.estimate import estimate\n    import runners.train\n")
    assert _imports(source) >= {"cost_models.estimate", "runners.train"}


# issue 12: a unit of code a reader holds in one view. The engine's techniques each have their own file
# (runners/sharding/), so a class over this has grown a second job.
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 300


def _oversized(paths, root: Path = ROOT) -> list[str]:
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
                     else MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} "
                           f"({node.end_lineno - node.lineno + 1} lines > {limit})")
    return out


def test_no_function_or_class_in_the_rooms_outgrows_one_view():
    assert _oversized(p for room in ROOMS for p in (ROOT / room).rglob("*.py")) == []


def test_the_size_check_sees_a_long_function(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "class C:\n    pass\n")
    assert _oversized([long], tmp_path) == [f"long.py:1 f ({MAX_FUNCTION_LINES + 1} lines > {MAX_FUNCTION_LINES})"]
