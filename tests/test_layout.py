"""The house's layout rules, checked on the source: no import cycle in `actors/` or `serve_app/`
(imports inside functions and under TYPE_CHECKING count), pure packages import no Ray, and every
module's docstring says what it is for."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "serve_app")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of `modules` that `name` imports, wherever the import statement stands."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_actors_or_serve_app_deferred_imports_included():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    # a package's __init__ importing its own modules is how it re-exports, not a cycle back to it
    for m in graph:
        graph[m] = {t for t in graph[m] if not (modules[m].name == "__init__.py" and t.startswith(m + "."))}
    assert _cycles(graph) == []


def test_the_wire_and_the_aggregators_registry_stay_pure():
    """What decodes SGLang's frames and the aggregator's state import neither Ray nor Serve."""
    pure = [p for m, p in _modules().items() if m.startswith("actors.wire") or m == "actors.aggregator.registry"]
    assert pure
    for p in pure:
        names = {a.name.split(".")[0] for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Import)
                 for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in ast.walk(ast.parse(p.read_text()))
                  if isinstance(n, ast.ImportFrom)}
        assert "ray" not in names, p


def test_every_module_says_what_it_is_for():
    missing = [str(p.relative_to(ROOT)) for p in _modules().values()
               if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert missing == []


def test_the_user_facing_launch_command_keeps_its_path():
    """`python -m actors.sglang_launch` is in users' docs and scripts (ARCHITECTURE.md)."""
    assert (ROOT / "actors" / "sglang_launch.py").is_file()
