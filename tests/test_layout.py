"""The package's layout rules (SPEC §7): no import circles, lazy imports
included, and at most 12 modules at the package root."""

import ast
import pathlib

import pytest

import mirrored

PACKAGE = pathlib.Path(mirrored.__file__).parent
MAX_ROOT_MODULES = 12
EXTENSION_SUFFIXES = (".so", ".pyd")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The package's modules that ``name`` imports anywhere in its source (module level or in a
    function): ``from pkg import x`` names module ``pkg.x`` where there is one, else ``pkg``. A
    package's ``__init__`` counts too, except the importer's own ancestors (Python runs those first
    whatever the importer does)."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for k in range(1, len(parts) + 1):  # the target and the packages it runs on the way
                prefix = ".".join(parts[:k])
                if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    found.add(prefix)
    return found


def _cycle(graph: dict):
    """One import circle of ``graph`` as a list of module names, or None."""
    state = {}  # module -> 1 while on the stack, 2 when done
    stack = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_circles_lazy_imports_included():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


@pytest.mark.parametrize("graph, circle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set()}, None),
])
def test_the_circle_finder_finds_circles(graph, circle):
    assert _cycle(graph) == circle


def test_lazy_imports_count(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("def f():\n    from .b import g\n    return g\n")
    assert _imports("mirrored.a", path, {"mirrored.a": path, "mirrored.b": path}) == {"mirrored.b"}


def test_at_most_twelve_modules_at_the_package_root():
    root = [p.name for p in PACKAGE.iterdir()
            if p.is_file() and (p.suffix == ".py" or p.name.endswith(EXTENSION_SUFFIXES))]
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {sorted(root)}"
