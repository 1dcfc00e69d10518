"""The package's folders are its architecture: imports point one way, there are no cycles, and package-internal
imports sit at module top (an import inside a function is allowed only for an optional dependency).

Layers, lowest first (a module may import its own layer and the ones below):
  errors, json_input, safe_files, schedule_traits, config  <  model  <  precision  <  parallel  <  data  <  training
  <  checkpoint  <  deepspeed, megatron  <  cli  <  the top-level package (public API; imported by nothing inside).
The benches (`benchmarks/`, beside the package, not installed) sit above all of it: nothing in the package or in
`patches/` imports them, at module top or anywhere else.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = "dsv3_plugin"
BENCHMARKS = "benchmarks"  # the benches' folder beside the package
ROOT = pathlib.Path(__file__).resolve().parents[2] / PKG

LAYERS = [
    {"errors", "json_input", "safe_files", "schedule_traits", "config"},
    {"model"},
    {"precision"},
    {"parallel"},
    {"data"},
    {"training"},
    {"checkpoint"},
    {"deepspeed", "megatron"},
    {"cli", "__main__"},
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
TOP = len(LAYERS)  # `dsv3_plugin` itself


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return TOP
    return RANK[parts[1]]


def _resolve(module: str, path: pathlib.Path, node: ast.ImportFrom) -> list[str]:
    """Absolute package-internal modules an ImportFrom refers to ([] for external ones)."""
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target != PKG and not target.startswith(PKG + "."):
        return []
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
    return subs or [target]


def _imports(module: str, path: pathlib.Path):
    """(line, target module, at module top?) for each package-internal import."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for stmt in tree.body:  # `if TYPE_CHECKING:` / try-blocks at top level count as module top
        if isinstance(stmt, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            targets = _resolve(module, path, node)
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name == PKG or a.name.startswith(PKG + ".")]
        for t in targets:
            yield node.lineno, t, id(node) in top


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for _, t, _ in _imports(m, path):
            # importing a package module runs its __init__: an edge to the package and, for `pkg.sub`, to the parents
            graph[m].add(t)
    return graph


def test_imports_point_one_way():
    bad = []
    for m, path in MODULES.items():
        for line, t, _ in _imports(m, path):
            if t == PKG and m != PKG:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: imports the top-level package")
            elif _layer(t) > _layer(m):
                bad.append(
                    f"{path.relative_to(ROOT.parent)}:{line}: {m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
                )
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in graph or t == m or m.startswith(t + "."):
                continue  # a module importing its own package's __init__ (a parent) is not a cycle of modules
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_internal_imports_at_module_top():
    inside = [
        f"{p.relative_to(ROOT.parent)}:{line}: {t}"
        for m, p in MODULES.items()
        for line, t, top in _imports(m, p)
        if not top
    ]
    assert not inside, "package-internal imports inside functions:\n" + "\n".join(inside)


def _names_benchmarks(name) -> bool:
    return isinstance(name, str) and (name == BENCHMARKS or name.startswith(BENCHMARKS + "."))


def test_package_never_imports_the_benchmarks():
    """`import benchmarks[...]`, `from benchmarks[...] import ...` and `importlib.import_module("benchmarks...")` /
    `__import__("benchmarks...")` with a literal name, anywhere in a module of the package or of `patches/`."""
    bad = []
    for path in sorted([*ROOT.rglob("*.py"), *(ROOT.parent / "patches").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                hit = any(_names_benchmarks(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                hit = node.level == 0 and _names_benchmarks(node.module)
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                hit = called in ("import_module", "__import__") and _names_benchmarks(node.args[0].value)
            else:
                continue
            if hit:
                bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not bad, "the package imports the benches (benchmarks/ is not installed):\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_every_module_imports(module):
    __import__(module)
