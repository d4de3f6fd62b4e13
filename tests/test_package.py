"""The package as shipped and as wired.

- The wheel: ``pip wheel`` builds chunkstate; the wheel holds every module of ``chunkstate/``
  (exercises, figures, bench included) and nothing else of the repository; installed into an
  empty folder and imported from there (the checkout off ``sys.path``), the exercises run and the
  figures know they have no committed measurements.
- No import cycles in ``chunkstate/``: the modules' imports, read with ``ast``, form no cycle.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "chunkstate"


# ---------------------------------------------------------------------------------------------
# The wheel
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the checkout's pyproject.toml, README.md and chunkstate/.

    Built from a copy, not in place: an in-tree build leaves ``build/lib`` behind, whose stale
    copies of since-deleted modules would go into the next wheel, and runs at the same time would
    share it. Beside the package the copy holds decoys of the repository's other folders (tests/
    and notebooks/ as importable packages, figures/ with data) that must stay out of the wheel."""
    setuptools = pytest.importorskip("setuptools", reason="building the wheel offline needs setuptools installed")
    version = tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())
    if version < (70, 1) and importlib.util.find_spec("wheel") is None:  # bdist_wheel moved into setuptools 70.1
        pytest.skip(f"setuptools {setuptools.__version__} builds wheels only with the wheel package installed")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(PACKAGE, src / "chunkstate", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for decoy in ("tests", "notebooks"):
        (src / decoy).mkdir()
        (src / decoy / "__init__.py").write_text("")
    (src / "figures").mkdir()
    (src / "figures" / "sweep_fwd_h200.json").write_text("{}")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"pip wheel failed:\n{p.stdout}\n{p.stderr}"
    (built,) = (tmp / "dist").glob("chunkstate-*.whl")
    return built


def test_wheel_holds_every_module_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if ".dist-info/" not in n}
    expected = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert {"chunkstate/__init__.py", "chunkstate/exercises/ch00_overview.py",
            "chunkstate/figures/__init__.py"} <= expected  # the test itself reads the right tree
    assert not expected - shipped, f"missing from the wheel: {sorted(expected - shipped)}"
    assert not shipped - expected, f"in the wheel but not a module of chunkstate/: {sorted(shipped - expected)}"
    assert not [n for n in names if n.startswith(("tests/", "notebooks/", "figures/"))]


INSTALLED_CHECK = """
import json
import chunkstate
from chunkstate import figures
from chunkstate.exercises import ch00_overview, ch07_autotuning
from chunkstate.figures import autotune, layout

ch00_overview.check_state_shapes()
ch07_autotuning.check_pick_candidates()  # random tables only: the wheel has no committed sweep
try:
    autotune.load_sweep()
    sweep_error = None
except FileNotFoundError as e:
    sweep_error = str(e)
files = {m.__name__: m.__file__ for m in (chunkstate, figures, ch00_overview, ch07_autotuning, autotune, layout)}
print(json.dumps({"files": files, "figures": str(figures.repository_figures()),
                  "sweep_error": sweep_error, "drawn": [str(p) for p in layout.main("out")]}))
"""


def test_installed_wheel_works_without_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"pip install failed:\n{p.stdout}\n{p.stderr}"
    env = {**os.environ, "PYTHONPATH": str(site), "MPLBACKEND": "Agg"}
    p = subprocess.run([sys.executable, "-c", INSTALLED_CHECK], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"the installed package failed:\n{p.stdout}\n{p.stderr}"
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for module, file in got["files"].items():  # (an editable install's finder would serve what the wheel lacks)
        assert Path(file).is_relative_to(site), f"{module} imported from {file}, not from the installed wheel"
    assert got["figures"] == "None"
    assert "not running from a repository checkout" in got["sweep_error"] and "load_sweep(path=...)" in got["sweep_error"]
    assert [Path(d).name for d in got["drawn"]] == ["layout_time_major.png", "layout_state_tiles.png",
                                                    "layout_varlen.png"]
    assert all((tmp_path / "out" / Path(d).name).is_file() for d in got["drawn"])  # out_dir as given, here: cwd/out


# ---------------------------------------------------------------------------------------------
# Import cycles
#
# Every import counts, at module level and inside functions alike (not under ``if TYPE_CHECKING``,
# which never runs). A function-level import cannot fail at import time, but one that points back
# up is still a two-way dependency between modules, which the package's layering forbids (helpers
# -> kernels -> launch -> pieces / ops -> bench, figures, exercises); and it is how a cycle hides.
# ---------------------------------------------------------------------------------------------

def package_modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (path, is a package's __init__)} for every .py under ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(tree: ast.AST):
    """Every Import / ImportFrom node that can run, with whether it sits inside a function."""
    def walk(nodes, in_function):
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.orelse, in_function)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, in_function
            else:
                function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(ast.iter_child_nodes(node), in_function or function)
    yield from walk([tree], False)


def import_edges(root: Path) -> dict[str, set[tuple[str, str]]]:
    """{module: {(imported module, "path:line")}} for the imports between modules under ``root``.

    ``from X import name`` is an edge to ``X.name`` when that is a module (``from . import pieces
    as _pieces`` -> ``chunkstate.pieces``), else to ``X`` (``from .kernel_parts import f`` ->
    ``chunkstate.kernel_parts``; ``from . import DEVICE`` -> ``chunkstate``, the package's
    ``__init__``). Relative imports are resolved (``from .. import tuning`` in a subpackage). The
    packages a target sits in are edges too (importing ``chunkstate.bench.model`` runs
    ``chunkstate/bench/__init__.py``), except those the importing module sits in itself: they are
    always being imported already.
    """
    modules = package_modules(root)
    top = root.name
    edges: dict[str, set[tuple[str, str]]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for node, in_function in _import_statements(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(root.parent)}:{node.lineno}" + (" (in a function)" if in_function else "")
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] != top:
                    continue
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    step = ".".join(parts[:i])
                    if step in modules and step != name and (step == target or step not in own_packages):
                        edges[name].add((step, where))
    return edges


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component that has one (Tarjan's
    algorithm, iterative), sorted; [] for an acyclic graph."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(component)
    return sorted(_shortest_cycle(graph, component, min(component)) for component in components)


def _shortest_cycle(graph: dict[str, set[str]], component: set[str], first: str) -> list[str]:
    """The shortest way from ``first`` back to itself inside ``component`` (breadth first)."""
    parent, frontier = {}, [first]
    while first not in parent:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child in component and child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    path, node = [first], parent[first]
    while node != first:
        path.append(node)
        node = parent[node]
    return [first] + path[:0:-1] + [first]


def test_no_import_cycles():
    edges = import_edges(PACKAGE)
    assert {"chunkstate.figures", "chunkstate.exercises"} <= edges.keys()
    cycles = find_cycles({m: {t for t, _ in ts} for m, ts in edges.items()})
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            lines += [f"    {a} -> {b}: {where}" for t, where in sorted(edges[a]) if t == b]
    assert not cycles, "import cycles in chunkstate/:\n" + "\n".join(lines)


def test_cycle_finder_on_small_graphs():
    assert find_cycles({}) == []
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []  # a diamond, no cycle
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    # two separate cycles; the shortest way round each (b -> a, not b -> c -> d -> a)
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"a"}, "x": {"y"}, "y": {"x"}}
    assert find_cycles(graph) == [["a", "b", "a"], ["x", "y", "x"]]


def test_import_edges_on_a_small_package(tmp_path):
    """Relative imports resolved, submodules told from names, function-level imports counted,
    TYPE_CHECKING imports not, and a cycle through them found."""
    files = {
        "pkg/__init__.py": "from . import a\nfrom .a import f\nCONSTANT = 1\n",
        "pkg/a.py": "import os\nfrom . import pieces as _pieces\nfrom .sub import b\ndef f():\n    pass\n",
        "pkg/pieces.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "from .. import CONSTANT\ndef g():\n    from ..a import f\n",
        "pkg/sub/c.py": "import pkg.sub.b\nfrom pkg import pieces\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = {m: {t for t, _ in ts} for m, ts in import_edges(tmp_path / "pkg").items()}
    assert edges == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.pieces", "pkg.sub", "pkg.sub.b"},
        "pkg.pieces": set(),  # only under TYPE_CHECKING
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg", "pkg.a"},  # a name of pkg/__init__.py; a function-level import
        "pkg.sub.c": {"pkg.sub.b", "pkg.pieces"},  # pkg and pkg.sub contain c: not edges
    }
    assert find_cycles(edges) == [["pkg", "pkg.a", "pkg.sub.b", "pkg"]]  # one cycle per component


IMPORT_WITHOUT_DEVICE_CALLS = """
import pkgutil, importlib, torch

def refuse(*args, **kwargs):
    raise AssertionError("a CUDA device was asked about at import time")

for name in ("get_device_properties", "get_device_capability", "current_device", "get_device_name",
             "synchronize", "set_device"):
    setattr(torch.cuda, name, refuse)
torch.cuda.is_available = lambda: True  # as on a GPU machine (TRITON_INTERPRET=1 keeps Triton off the GPU)
import chunkstate
names = ["chunkstate." + m.name for m in pkgutil.walk_packages(chunkstate.__path__) if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module("chunkstate." + name if not name.startswith("chunkstate.") else name)
print("imported", len(names), "modules")
"""


def test_importing_asks_no_device_anything():
    """Importing every module of the package asks the CUDA device nothing (no properties, no
    capability, no current device): ``tuning``'s SM count, shared memory and TMA answers are read at
    the first launch. (``import chunkstate`` may ask ``torch.cuda.is_available()`` to pick the
    interpreter; that creates no CUDA context.)"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", IMPORT_WITHOUT_DEVICE_CALLS], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported" in done.stdout


def test_readme_example_runs():
    """The README's first example (under "The package in brief") runs as written and prints a passing
    check, under the interpreter (forced, so a GPU machine runs it on CPU tensors too)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## The package in brief", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "chunk_fwd_h" in code and "check_close" in code
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("h: rel. error") and "✓" in done.stdout, done.stdout
