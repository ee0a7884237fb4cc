"""The package's layout rules (SPEC §7): no import circles, lazy imports
included, and at most 12 modules at the package root."""

import ast
import pathlib

import pytest

import mirrored

PACKAGE = pathlib.Path(mirrored.__file__).parent
MAX_ROOT_MODULES = 12
EXTENSION_SUFFIXES = (".so", ".pyd")


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).parts)
    parts[-1] = parts[-1].split(".")[0]  # "_core.cpython-311-x86_64-linux-gnu.so" is module _core
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(root: pathlib.Path = PACKAGE) -> dict:
    """The package's modules, extensions included (an import of one runs no Python of ours)."""
    return {_module_name(p, root): p for p in root.rglob("*")
            if p.suffix == ".py" or p.name.endswith(EXTENSION_SUFFIXES)}


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The package's modules that ``name`` imports anywhere in its source (module level or in a
    function). ``import a.b`` and ``from a.b import x`` run ``a.b`` and the packages on its way,
    except the importer's own ancestors: Python runs those first whatever the importer does.
    ``from pkg import x`` imports module ``pkg.x`` where there is one; else it reads ``x`` out of
    ``pkg``'s ``__init__``, so it counts ``pkg`` even when ``pkg`` is an ancestor (``from .. import
    X``): that is the circle through a package ``__init__`` that ends in an ImportError when the
    ``__init__`` has not yet reached ``X``."""
    if path.suffix != ".py":
        return set()
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()

    def add(target: str, read_from_init: bool = False):
        parts = target.split(".")
        for k in range(1, len(parts) + 1):  # the target and the packages it runs on the way
            prefix = ".".join(parts[:k])
            ancestor = name.startswith(prefix + ".") and not (read_from_init and k == len(parts))
            if prefix in modules and prefix != name and not ancestor:
                found.add(prefix)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                if submodule in modules:
                    add(submodule)
                else:
                    add(module, read_from_init=True)
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


def _circle_in(root: pathlib.Path):
    modules = _modules(root)
    return _cycle({name: _imports(name, path, modules) for name, path in modules.items()})


def test_no_import_circles_lazy_imports_included():
    circle = _circle_in(PACKAGE)
    assert circle is None, f"import circle: {' -> '.join(circle)}"


@pytest.mark.parametrize("graph, circle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set()}, None),
])
def test_the_circle_finder_finds_circles(graph, circle):
    assert _cycle(graph) == circle


@pytest.mark.parametrize("files, circle", [
    # ``from .. import VERSION`` reads a name out of the package's half-run __init__, at module level or lazily
    ({"__init__.py": "from .sub.b import f\nVERSION = 1\n", "sub/__init__.py": "",
      "sub/b.py": "from .. import VERSION\ndef f(): pass\n"}, ["pkg", "pkg.sub.b", "pkg"]),
    ({"__init__.py": "from .b import f\nVERSION = 1\n", "b.py": "def f():\n    from . import VERSION\n"},
     ["pkg", "pkg.b", "pkg"]),
    # so does ``from ..sub import f`` where sub/__init__ only re-exports f
    ({"__init__.py": "", "sub/__init__.py": "from .a import f\n", "sub/a.py": "from .b import g\ndef f(): pass\n",
      "sub/b.py": "from ..sub import f\ndef g(): pass\n"}, ["pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.sub"]),
    # ``from . import c`` and ``from .. import _ext`` import those modules, whatever the __init__ has reached
    ({"__init__.py": "from .b import f\n", "b.py": "from . import c, _ext\ndef f(): pass\n", "c.py": "",
      "_ext.cpython-311-x86_64-linux-gnu.so": ""}, None),
])
def test_circles_through_a_package_init(tmp_path, files, circle):
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    assert _circle_in(tmp_path / "pkg") == circle


def test_lazy_imports_count(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("def f():\n    from .b import g\n    return g\n")
    assert _imports("mirrored.a", path, {"mirrored.a": path, "mirrored.b": path}) == {"mirrored.b"}


def test_at_most_twelve_modules_at_the_package_root():
    root = [p.name for p in PACKAGE.iterdir()
            if p.is_file() and (p.suffix == ".py" or p.name.endswith(EXTENSION_SUFFIXES))]
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {sorted(root)}"
