"""The package's structure, read from its source: modules in layers that import only
downward (so no import cycle), jax internals in one module, no imports hidden in
function bodies, no history (dates, sessions, commit hashes) in the code."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jax_hopper"

# From the bottom up; a module imports only from layers below its own, or from its own
# layer acyclically (the primitives build on gemm).
LAYERS = (
    ("_kernels",),
    ("_compat", "_ffi", "_plan", "_problem", "_reference", "_partitioning"),
    ("_rules",),
    ("_dispatch",),
    ("primitives", "primitives.gemm", "primitives.dense_derivative", "primitives.dense_grad", "primitives.dense",
     "primitives.mlp_tangent", "primitives.ragged_dot"),
    ("ops",),
    ("ragged", "collective"),
    ("layers",),
    ("nn", "__init__"),
)
LAYER_OF = {module: i for i, modules in enumerate(LAYERS) for module in modules}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def _modules():
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path):
    """(the package's modules this one imports, whether any import sits in a function)."""
    tree = ast.parse(path.read_text())
    found, nested = set(), False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested |= any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_hopper"):
            base = node.module[len("jax_hopper."):] if node.module != "jax_hopper" else ""
            for alias in node.names:
                name = f"{base}.{alias.name}" if base else alias.name
                found.add(name if name in LAYER_OF else base)
        elif isinstance(node, ast.Import):
            found |= {a.name[len("jax_hopper."):] for a in node.names if a.name.startswith("jax_hopper.")}
    return {m for m in found if m and m != "_jax_hopper"}, nested


def test_every_module_has_a_layer():
    assert set(_modules()) == set(LAYER_OF), set(_modules()) ^ set(LAYER_OF)


def test_imports_go_downward_and_form_no_cycle():
    graph = {name: _imports(path)[0] for name, path in _modules().items()}
    for name, deps in graph.items():
        for dep in deps:
            assert LAYER_OF[dep] <= LAYER_OF[name], f"{name} (layer {LAYER_OF[name]}) imports {dep} ({LAYER_OF[dep]})"
    # Depth-first search for a cycle (within a layer: the primitives).
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph[node]:
            if state.get(dep) == "open":
                pytest.fail(f"import cycle: {' -> '.join(stack + [node, dep])}")
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_no_imports_in_function_bodies_but_the_optional_extension():
    for name, path in _modules().items():
        nested = _imports(path)[1]
        assert not nested or name == "_ffi", f"{name} imports inside a function"


def test_jax_internals_are_imported_by_the_compat_module_only():
    for name, path in _modules().items():
        if name != "_compat":
            assert "_src" not in path.read_text(), f"{name} touches jax._src"


HISTORY = [
    (r"\b20\d\d-\d\d-\d\d\b", "a date"),
    (r"\bsession\b", "a session"),
    (r"BENCHMARKS\.md", "the removed session log"),
    # seven or more hex digits with two letters among them, not part of a number or name
    (r"(?<![\w.])(?=[0-9a-f]*[a-f][0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?!\w)", "a commit hash"),
]


@pytest.mark.parametrize("folder", ["jax_hopper", "cuda"])
def test_code_holds_no_history(folder):
    """Comments say what and why; when and in which session is git's story."""
    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix not in (".py", ".cc", ".cu", ".cuh", ".h", ".in") or not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, what in HISTORY:
                assert not re.search(pattern, line), f"{path.relative_to(ROOT)}:{lineno} holds {what}: {line.strip()}"
