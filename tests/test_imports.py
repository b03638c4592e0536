"""The import graph of ``ds_core`` and the backends: no cycles, imports at the top of modules.

The graph is read from the source with :mod:`ast` (nothing is imported). An edge ``a -> b``
means running module ``a`` imports module ``b`` of ``ds_core`` or of a backend package
(``backends/<name>/ds_backend_<name>``, one graph with the core), from anywhere in ``a`` (a
function-local import is still an edge: hiding a cycle inside a function is what this test is
for), except under ``if TYPE_CHECKING:``. Importing ``ds_core.x.y`` also runs the package
``ds_core.x`` first, so that package is an edge too, unless the importer is inside it already
(a package's own modules may import each other while it initialises). The root package
``ds_core`` is an edge only where a module imports a name from it (``from ds_core import
hookimpl``): the root runs before any submodule, so reaching it implicitly closes nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ds_core"
#: every package in the graph: the core and each backend's
PACKAGES = [PACKAGE, *sorted(ROOT.glob("backends/*/ds_backend_*"))]

#: Files allowed to import ds_core modules inside functions, and why. Shrink it, never grow it:
#: an import that would close a cycle at the top of a module means the modules are cut wrong.
LOCAL_IMPORT_EXCEPTIONS: dict[str, str] = {}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p, pkg): p for pkg in PACKAGES for p in sorted(pkg.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement outside ``if TYPE_CHECKING:``, with whether it is in a function."""

    def walk(
        node: ast.AST, in_function: bool
    ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    yield from walk(other, in_function)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, in_function
            nested = in_function or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            yield from walk(child, nested)

    yield from walk(tree, False)


def _targets(
    node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]
) -> set[str]:
    """The graph's modules a statement imports by name (before adding parent packages)."""
    names: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                names.add(name)
        return names
    base = node.module or ""
    if node.level:
        anchor = importer if is_package else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            anchor = anchor.rpartition(".")[0]
        base = f"{anchor}.{base}" if base else anchor
    if base not in modules:
        return names
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        names.add(sub if sub in modules else base)
    return names


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """``(edges, local)``: the graph, and each module's function-local imports of its modules."""
    modules = all_modules()
    names = set(modules)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    local: dict[str, list[str]] = {}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        own_packages = {mod.rsplit(".", k)[0] for k in range(mod.count(".") + 1)}
        if not is_package:
            own_packages.discard(mod)
        for node, in_function in _imports(tree):
            targets = _targets(node, mod, is_package, names)
            if in_function and targets:
                local.setdefault(mod, []).append(f"line {node.lineno}: {ast.unparse(node)}")
            for target in targets:
                edges[mod].add(target)
                # The packages a target sits in run first (the root aside; see the docstring).
                parent = target.rpartition(".")[0]
                while "." in parent:
                    if parent not in own_packages:
                        edges[mod].add(parent)
                    parent = parent.rpartition(".")[0]
        edges[mod].discard(mod)
    return edges, local


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_one_cycle(c, edges) for c in components]


def _one_cycle(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A concrete path ``a -> ... -> a`` inside a strongly connected component."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return component  # pragma: no cover - a component always has a cycle through start


def test_ds_core_and_the_backends_have_no_import_cycle() -> None:
    edges, _ = import_graph()
    cycles = find_cycles(edges)
    assert not cycles, "import cycles among ds_core and backend modules:\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_every_backend_package_is_in_the_graph() -> None:
    modules = all_modules()
    for backend in sorted(ROOT.glob("backends/*/pyproject.toml")):
        name = f"ds_backend_{backend.parent.name}"
        assert f"{name}.plugin" in modules, f"{name}.plugin is missing from the import graph"


def test_ds_core_and_the_backends_import_their_own_modules_at_the_top() -> None:
    _, local = import_graph()
    offenders = {
        mod: lines
        for mod, lines in local.items()
        if str(all_modules()[mod].relative_to(ROOT)) not in LOCAL_IMPORT_EXCEPTIONS
    }
    assert not offenders, "function-local imports of ds_core or backend modules:\n" + "\n".join(
        f"{mod}: {line}" for mod, lines in sorted(offenders.items()) for line in lines
    )


def test_the_graph_sees_the_old_cycle_and_function_local_imports(tmp_path: Path) -> None:
    """The checker itself: the cycle this layout replaced is found, through a package."""
    edges = {
        "ds_core.accelerator": {"ds_core.comm"},
        "ds_core.comm": {"ds_core.parallel.expert.moe"},
        "ds_core.parallel.expert.moe": {"ds_core.accelerator"},
        "ds_core.errors": set(),
    }
    (cycle,) = find_cycles(edges)
    assert cycle[0] == cycle[-1] and set(cycle) == {
        "ds_core.accelerator",
        "ds_core.comm",
        "ds_core.parallel.expert.moe",
    }
    source = "def f():\n    from ds_core.accelerator import get_accelerator\n"
    ((node, in_function),) = list(_imports(ast.parse(source)))
    assert in_function
    assert _targets(node, "ds_core.parallel.expert.moe", False, {"ds_core.accelerator"}) == {
        "ds_core.accelerator"
    }


@pytest.mark.parametrize(
    ("statement", "importer", "expected"),
    [
        ("from ds_core import comm", "ds_core.parallel.expert.moe", {"ds_core.comm"}),
        ("from ds_core import hookimpl", "ds_core.scaffold", {"ds_core"}),
        ("import ds_core.comm.groups", "ds_core.parallel.expert.moe", {"ds_core.comm.groups"}),
        ("from .groups import new_group", "ds_core.comm", {"ds_core.comm.groups"}),
        ("from . import groups", "ds_core.comm.counting", {"ds_core.comm.groups"}),
        ("import torch.distributed", "ds_core.parallel.expert.moe", set()),
    ],
)
def test_import_targets_resolve_to_modules(
    statement: str, importer: str, expected: set[str]
) -> None:
    modules = {"ds_core", "ds_core.comm", "ds_core.comm.groups", "ds_core.comm.counting"}
    node = ast.parse(statement).body[0]
    assert isinstance(node, ast.Import | ast.ImportFrom)
    assert _targets(node, importer, importer == "ds_core.comm", modules) == expected


def test_parent_packages_are_edges_from_outside_only() -> None:
    edges, _ = import_graph()
    # moe imports ds_core.comm.groups, which runs the package ds_core.comm first.
    assert {"ds_core.comm.groups", "ds_core.comm"} <= edges["ds_core.parallel.expert.moe"]
    # the package's own modules do not depend on the package they are part of.
    assert "ds_core.comm" not in edges["ds_core.comm.groups"]
