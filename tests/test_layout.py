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
    function: lazy imports count), by the strict rule of SPEC §7:

    - ``from PKG import NAME`` (absolute or relative) imports ``PKG`` always, even when it is one of
      the importer's own packages (``from . import sub``, ``from .. import _core``), and also
      ``PKG.NAME`` when that is a module. A module imports the module that defines what it uses,
      never a package ``__init__`` that may be half run and may import the importer back.
    - ``import a.b.c`` imports ``a.b.c``. A check that reads the statement as written (the project's
      standing check most plausibly does, as import-graph tools do) counts ``a.b.c`` only; Python
      also runs ``a`` and ``a.b`` on the way. This walk counts those parents too: that graph holds
      every edge of the other, so a package without circles here has none under either reading.

    A target's parents that are the importer's own packages are left out: Python has started them
    before the importer runs and does not run them again (``from .._core import X`` in
    ``pkg.sub.m`` needs ``pkg`` but cannot make a circle through it)."""
    if path.suffix != ".py":
        return set()
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()

    def add(target: str):
        parts = target.split(".")
        for k in range(1, len(parts) + 1):  # the target and the packages it runs on the way
            prefix = ".".join(parts[:k])
            own_package = name.startswith(prefix + ".") and k < len(parts)
            if prefix in modules and prefix != name and not own_package:
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
            add(module)
            for alias in node.names:
                if f"{module}.{alias.name}" in modules:
                    add(f"{module}.{alias.name}")
    return found


def _circles(graph: dict) -> list:
    """The import circles of ``graph``, each a list of module names that starts and ends with the
    same module: one per edge back to a module still on the walk's stack (a graph has none exactly
    when this list is empty)."""
    state = {}  # module -> 1 while on the stack, 2 when done
    stack = []
    found = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                found.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def _circles_in(root: pathlib.Path) -> list:
    modules = _modules(root)
    return _circles({name: _imports(name, path, modules) for name, path in modules.items()})


def test_no_import_circles_lazy_imports_included():
    circles = _circles_in(PACKAGE)
    report = "\n".join(f"  ({len(c) - 1}) {' -> '.join(c)}" for c in circles)
    assert not circles, f"{len(circles)} import circles:\n{report}"


@pytest.mark.parametrize("graph, circles", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c", "a"]]),
    ({"a": {"b"}, "b": {"a", "c"}, "c": {"c"}}, [["a", "b", "a"], ["c", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(graph, circles):
    assert _circles(graph) == circles


@pytest.mark.parametrize("files, circles", [
    # ``from .. import VERSION`` reads a name out of the package's half-run __init__, at module level or lazily
    ({"__init__.py": "from .sub.b import f\nVERSION = 1\n", "sub/__init__.py": "",
      "sub/b.py": "from .. import VERSION\ndef f(): pass\n"}, [["pkg", "pkg.sub.b", "pkg"]]),
    ({"__init__.py": "from .b import f\nVERSION = 1\n", "b.py": "def f():\n    from . import VERSION\n"},
     [["pkg", "pkg.b", "pkg"]]),
    # so does ``from ..sub import f`` where sub/__init__ only re-exports f
    ({"__init__.py": "", "sub/__init__.py": "from .a import f\n", "sub/a.py": "from .b import g\ndef f(): pass\n",
      "sub/b.py": "from ..sub import f\ndef g(): pass\n"}, [["pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.sub"]]),
    # the strict rule: ``from . import c`` and ``from .. import _ext`` go through the package's __init__ even
    # though they name modules, absolute or relative, at module level or lazily
    ({"__init__.py": "from .b import f\n", "b.py": "from . import c\ndef f(): pass\n", "c.py": ""},
     [["pkg", "pkg.b", "pkg"]]),
    ({"__init__.py": "from .sub.b import f\n", "sub/__init__.py": "", "sub/b.py": "from .. import _ext\n",
      "_ext.cpython-311-x86_64-linux-gnu.so": ""}, [["pkg", "pkg.sub.b", "pkg"]]),
    ({"__init__.py": "from .b import f\n", "b.py": "def f():\n    from pkg import c\n", "c.py": ""},
     [["pkg", "pkg.b", "pkg"]]),
    ({"__init__.py": "", "sub/__init__.py": "from .a import f\n", "sub/a.py": "def f():\n    from . import b\n",
      "sub/b.py": ""}, [["pkg.sub", "pkg.sub.a", "pkg.sub"]]),
    # the defining modules instead: no circle (the importer's own packages are running already)
    ({"__init__.py": "from .b import f\n", "b.py": "from .c import g\nfrom ._ext import h\ndef f(): pass\n",
      "c.py": "def g(): pass\n", "_ext.cpython-311-x86_64-linux-gnu.so": ""}, []),
    ({"__init__.py": "from .sub.b import f\n", "sub/__init__.py": "",
      "sub/b.py": "from .._ext import h\nimport pkg.sub.c\ndef f(): pass\n", "sub/c.py": "",
      "_ext.cpython-311-x86_64-linux-gnu.so": ""}, []),
    # ``import a.b.c`` runs the packages on its way: a circle through ``a.b``'s __init__ is one
    ({"__init__.py": "", "sub/__init__.py": "from .a import f\n", "sub/a.py": "def f(): pass\n",
      "other.py": "import pkg.sub.a\n", "sub/b.py": ""}, []),
    ({"__init__.py": "", "sub/__init__.py": "from ..other import g\n", "sub/a.py": "",
      "other.py": "def g():\n    import pkg.sub.a\n"}, [["pkg.other", "pkg.sub", "pkg.other"]]),
])
def test_circles_through_a_package_init(tmp_path, files, circles):
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    assert _circles_in(tmp_path / "pkg") == circles


def test_lazy_imports_count(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("def f():\n    from .b import g\n    return g\n")
    assert _imports("mirrored.a", path, {"mirrored.a": path, "mirrored.b": path}) == {"mirrored.b"}


def test_at_most_twelve_modules_at_the_package_root():
    root = [p.name for p in PACKAGE.iterdir()
            if p.is_file() and (p.suffix == ".py" or p.name.endswith(EXTENSION_SUFFIXES))]
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {sorted(root)}"
