"""Code that only a GPU runs still names things that exist: read, not run, on any machine.

The notebooks' GPU cells (``if ON_GPU:``), ``tests/test_devices.py`` and ``test_large.py``, the
benchmark's timing side: none of it runs without a CUDA GPU, so on a laptop or in CI a rename in
the package can leave it calling what is no longer there, and only the next GPU run finds out.
This reads every notebook (its code cells as one program) and every Python file of the package
and of tests/, and checks, without running them:

1. **names**: every name read is bound somewhere in the program (an assignment, an import, a
   ``def``, a loop or ``with`` target, ...) or is a builtin; in a notebook, a name a cell's own
   code reads (not a function body's, which may run later) is bound by that cell or one above it;
2. **chunkstate attributes**: ``module.name`` on a chunkstate module, read or assigned, is a name
   that module has (assigning a misspelt module flag creates a new attribute and changes nothing);
3. **calls**: a call of a chunkstate function or class, or of a function the notebook defines,
   passes arguments its signature accepts (positional count and keyword names; with ``*args`` or
   ``**kwargs`` in the call, its explicit keyword names only).

It cannot follow values: ``runner.Inputs(shape).gate(...)`` is checked up to ``Inputs(shape)``, and
``inp.gate(...)`` only where ``inp`` is only ever bound to ``runner.Inputs(...)``.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import symtable
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

import chunkstate

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PACKAGE_FILES = sorted((ROOT / "chunkstate").rglob("*.py"))
TEST_FILES = sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "notebooks").glob("*.py"))
# Names a notebook's kernel provides without an import.
IPYTHON_NAMES = {"display", "get_ipython", "In", "Out", "exit", "quit"}
MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__package__", "__builtins__",
                "__loader__", "__annotations__", "__dict__", "__class__"}


def notebook_cells(path: Path) -> dict[int, str]:
    """A notebook's code cells by their index among all its cells; IPython's ``%magic`` and
    ``!shell`` lines blanked."""
    nb = nbformat.read(path, as_version=4)
    return {i: "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
            for i, cell in enumerate(nb.cells) if cell.cell_type == "code"}


def notebook_source(path: Path) -> str:
    """A notebook's code cells as one program (``notebook_cells``, each headed by its index)."""
    return "\n\n".join(f"# cell {i}\n{source}" for i, source in notebook_cells(path).items()) + "\n"


def module_name(path: Path) -> str | None:
    """chunkstate.bench.runner for chunkstate/bench/runner.py; None outside the package."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] != "chunkstate":
        return None
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# ---------------------------------------------------------------------------------------------
# 1. names


def unbound_names(source: str, filename: str) -> list[str]:
    """Names read but bound nowhere in the program (nor builtins), as 'name (scope)'."""
    top = symtable.symtable(source, filename, "exec")
    if any(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
           and any(alias.name == "*" for alias in node.names)):
        return []  # a star import binds names this cannot list
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()
             or s.is_namespace() or s.is_parameter()}
    known = bound | set(dir(builtins)) | IPYTHON_NAMES | MODULE_NAMES
    missing = []

    def walk(table, where):
        for sym in table.get_symbols():
            name = sym.get_name()
            if not sym.is_referenced():
                continue
            # a name a scope reads from the module: implicitly global, or the module's own
            if (table is top or sym.is_global()) and name not in known:
                missing.append(f"{name} ({where})")
        for child in table.get_children():
            walk(child, f"{where} > {child.get_name()}")

    walk(top, "top level")
    return sorted(set(missing))


COMPREHENSIONS = {"listcomp", "setcomp", "dictcomp", "genexpr"}


def read_before_bound(cells: dict[int, str]) -> list[str]:
    """Names a cell reads at its top level (comprehensions included, not function bodies, which
    may run later) that no cell up to and including it binds, as 'name (cell i)': run top to
    bottom, as a reader and nbval run a notebook, the cell raises NameError (``unbound_names``
    asks only whether a name is bound anywhere)."""
    known = set(dir(builtins)) | IPYTHON_NAMES | MODULE_NAMES
    late = []
    for i, cell in cells.items():
        top = symtable.symtable(cell, f"cell {i}", "exec")
        known |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()
                  or s.is_namespace()}
        reads = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
        tables = [t for t in top.get_children() if t.get_name() in COMPREHENSIONS]
        while tables:
            table = tables.pop()
            reads |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global()}
            tables += [t for t in table.get_children() if t.get_name() in COMPREHENSIONS]
        late += [f"{name} (cell {i})" for name in sorted(reads - known)]
    return late


# ---------------------------------------------------------------------------------------------
# 2. and 3. what chunkstate names and calls


@dataclass
class Bindings:
    """Names bound to a chunkstate object by imports alone, and the notebook's own functions."""
    imported: dict[str, str] = field(default_factory=dict)  # name -> "chunkstate.x[:attr]"
    functions: dict[str, inspect.Signature] = field(default_factory=dict)
    other: set[str] = field(default_factory=set)  # names also bound otherwise: not followed
    assigned: dict[str, list] = field(default_factory=dict)  # name -> the values of `name = value`, None if other


def absolute(module: str | None, level: int, package_of: str | None) -> str | None:
    if level == 0:
        return module
    if package_of is None:
        return None
    base = package_of.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def stub_signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """The signature of a function the program defines, with every default replaced by None."""
    args = ast.arguments(
        posonlyargs=node.args.posonlyargs, args=node.args.args, vararg=node.args.vararg,
        kwonlyargs=node.args.kwonlyargs, kw_defaults=[None if d is None else ast.Constant(None)
                                                     for d in node.args.kw_defaults],
        kwarg=node.args.kwarg, defaults=[ast.Constant(None) for _ in node.args.defaults])
    for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    stub = ast.Module(body=[ast.FunctionDef(name="stub", args=args, body=[ast.Pass()], decorator_list=[],
                                            returns=None, type_params=[])], type_ignores=[])
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(stub), "<stub>", "exec"), namespace)
    return inspect.signature(namespace["stub"])


def collect_bindings(tree: ast.Module, package_of: str | None) -> Bindings:
    b = Bindings()
    imports: dict[str, set[str]] = {}
    defs: dict[str, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    imports.setdefault(alias.asname, set()).add(alias.name)
                else:  # import a.b binds a
                    top = alias.name.split(".")[0]
                    imports.setdefault(top, set()).add(top)
        elif isinstance(node, ast.ImportFrom):
            mod = absolute(node.module, node.level, package_of)
            for alias in node.names:
                if mod is not None and alias.name != "*":
                    imports.setdefault(alias.asname or alias.name, set()).add(f"{mod}:{alias.name}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.setdefault(node.name, []).append(node)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            b.other.add(node.id)
            if isinstance(node.ctx, ast.Del):
                continue  # `del inp` unbinds: it gives the name no other value
            parent = getattr(node, "parent", None)
            simple = isinstance(parent, ast.Assign) and parent.targets == [node]
            b.assigned.setdefault(node.id, []).append(parent.value if simple else None)
        elif isinstance(node, ast.arg):
            b.other.add(node.arg)
            b.assigned.setdefault(node.arg, []).append(None)
    for name, targets in imports.items():
        if len(targets) == 1 and name not in b.other and name not in defs:
            b.imported[name] = targets.pop()
        else:
            b.other.add(name)
    # the program's own functions, when the name is bound once, by that def, at the top level
    top_defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name, nodes in defs.items():
        node = top_defs.get(name)
        if len(nodes) == 1 and node is nodes[0] and name not in b.other and name not in imports \
                and not node.decorator_list:
            b.functions[name] = stub_signature(node)
    return b


class Unresolved(Exception):
    pass


def resolve_import(target: str):
    """The object an import binds: a module ("chunkstate.bench") or a name in one ("m:name")."""
    if ":" not in target:
        return importlib.import_module(target)
    mod, name = target.split(":")
    module = importlib.import_module(mod)
    if hasattr(module, name):
        return getattr(module, name)
    try:
        return importlib.import_module(f"{mod}.{name}")
    except ImportError:
        raise Unresolved(f"`from {mod} import {name}`: {mod} has no {name}") from None


def attribute_chain(node: ast.expr) -> list[str] | None:
    """["a", "b", "c"] for a.b.c; None when the chain does not start at a name."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + chain[::-1]


def follow(obj, chain: list[str], shown: str):
    """Follow attributes from a chunkstate module while they are modules; then one step more."""
    for attr in chain:
        if not isinstance(obj, types.ModuleType):
            return obj  # a value: its attributes are the value's business (instances, kernels, ...)
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
            continue
        try:
            obj = importlib.import_module(f"{obj.__name__}.{attr}")
        except ImportError:
            raise Unresolved(f"{shown}: module {obj.__name__} has no attribute {attr}") from None
    return obj


def ours(obj) -> bool:
    mod = getattr(obj, "__module__", None) or (obj.__name__ if isinstance(obj, types.ModuleType) else "")
    return isinstance(mod, str) and mod.split(".")[0] == "chunkstate"


def binds(sig: inspect.Signature, call: ast.Call) -> str | None:
    """Why the call's arguments do not fit the signature; None if they do. With ``*args`` or
    ``**kwargs`` in the call (how many, which names: unknown) only its explicit keywords are checked,
    against the names the signature has."""
    keywords = [k.arg for k in call.keywords if k.arg is not None]
    if any(isinstance(a, ast.Starred) for a in call.args) or len(keywords) < len(call.keywords):
        takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        unknown = [] if takes_any else [k for k in keywords if k not in sig.parameters
                                         or sig.parameters[k].kind is inspect.Parameter.POSITIONAL_ONLY]
        return f"got an unexpected keyword argument {unknown[0]!r}" if unknown else None
    try:
        sig.bind(*[None] * len(call.args), **{k: None for k in keywords})
    except TypeError as e:
        return str(e)
    return None


def signature_of(obj) -> inspect.Signature | None:
    fn = obj.fn if hasattr(obj, "fn") and not inspect.isclass(obj) and not inspect.isfunction(obj) else obj
    if not callable(fn):
        return None
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def instances_of(b: Bindings, resolved: dict) -> dict[str, type]:
    """Names only ever bound as ``name = SomeChunkstateClass(...)``, to that class."""
    out = {}
    for name, values in b.assigned.items():
        classes = set()
        for value in values:
            chain = isinstance(value, ast.Call) and attribute_chain(value.func)
            if not chain or chain[0] not in resolved:
                classes.add(None)
                continue
            try:
                obj = follow(resolved[chain[0]], chain[1:], "")
            except Unresolved:
                obj = None
            classes.add(obj if inspect.isclass(obj) and ours(obj) else None)
        if len(classes) == 1 and None not in classes:
            out[name] = classes.pop()
    return out


def has_attribute(cls: type, attr: str) -> bool:
    """The class has it, or an instance gets it: a dataclass or named-tuple field, ``self.attr = ...``."""
    if hasattr(cls, attr):
        return True
    if attr in getattr(cls, "__dataclass_fields__", {}) or attr in getattr(cls, "_fields", ()):
        return True
    for klass in cls.__mro__:
        if not ours(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == attr \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                return True
    return False


def method_signature(cls: type, attr: str) -> inspect.Signature | None:
    """A method's signature as called on an instance (without self)."""
    raw = inspect.getattr_static(cls, attr, None)
    if raw is None or not callable(getattr(cls, attr, None)):
        return None
    if isinstance(raw, (staticmethod, classmethod)):
        return inspect.signature(getattr(cls, attr))
    if not inspect.isfunction(raw):
        return None
    params = list(inspect.signature(raw).parameters.values())[1:]
    return inspect.Signature(params)


def mark_parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node


def chunkstate_problems(source: str, filename: str, package_of: str | None,
                        checked: list[str] | None = None) -> list[str]:
    """What does not exist or does not fit; ``checked`` collects each call whose signature was checked."""
    tree = ast.parse(source, filename)
    mark_parents(tree)
    b = collect_bindings(tree, package_of)
    problems = []
    resolved: dict[str, object] = {}
    for name, target in b.imported.items():
        if target.split(":")[0].split(".")[0] != "chunkstate":
            continue
        try:
            resolved[name] = resolve_import(target)
        except Unresolved as e:
            problems.append(str(e))
    instances = instances_of(b, resolved)
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in instances:
            cls = instances[node.value.id]
            if not has_attribute(cls, node.attr):
                problems.append(f"{where}: {node.value.id}.{node.attr}: a {cls.__qualname__} has no attribute "
                                f"{node.attr}")
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            chain = attribute_chain(node)
            if chain and chain[0] in resolved:
                try:
                    follow(resolved[chain[0]], chain[1:], f"{where}: {'.'.join(chain)}")
                except Unresolved as e:
                    problems.append(str(e))
        if isinstance(node, ast.Call):
            chain = attribute_chain(node.func)
            if not chain:
                continue
            shown = f"{where}: {'.'.join(chain)}(...)"
            if len(chain) == 1 and chain[0] in b.functions:
                sig = b.functions[chain[0]]
            elif len(chain) == 2 and chain[0] in instances:
                sig = method_signature(instances[chain[0]], chain[1])
            elif chain[0] in resolved:
                try:
                    obj = follow(resolved[chain[0]], chain[1:], shown)
                except Unresolved:
                    continue  # reported above as an attribute
                # only what the chain names itself (not a method of a value it reached)
                if len(chain) > 1 and not isinstance(follow(resolved[chain[0]], chain[1:-1], shown), types.ModuleType):
                    continue
                sig = signature_of(obj) if ours(obj) else None
            else:
                continue
            if sig is None:
                continue
            if checked is not None:
                checked.append(".".join(chain))
            why = binds(sig, node)
            if why:
                problems.append(f"{shown}: {why}")
    return problems



# ---------------------------------------------------------------------------------------------
# the tests

SOURCES = NOTEBOOKS + PACKAGE_FILES + TEST_FILES
IDS = [str(p.relative_to(ROOT)) for p in SOURCES]


def read(path: Path) -> str:
    return notebook_source(path) if path.suffix == ".ipynb" else path.read_text()


@pytest.mark.parametrize("path", SOURCES, ids=IDS)
def test_every_name_is_bound(path):
    missing = unbound_names(read(path), str(path))
    assert not missing, f"{path.relative_to(ROOT)} reads names bound nowhere: {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[str(p.relative_to(ROOT)) for p in NOTEBOOKS])
def test_no_cell_reads_a_name_before_a_cell_binds_it(path):
    late = read_before_bound(notebook_cells(path))
    assert not late, f"{path.relative_to(ROOT)} reads names before any cell up to there binds them: {late}"


@pytest.mark.parametrize("path", SOURCES, ids=IDS)
def test_chunkstate_names_and_calls_exist(path):
    mod = module_name(path)
    package_of = None if mod is None else (mod if path.name == "__init__.py" else mod.rpartition(".")[0])
    problems = chunkstate_problems(read(path), str(path), package_of)
    assert not problems, f"{path.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


FAULTY = """
import chunkstate
from chunkstate import bench, launch
from chunkstate.bench import runner
from chunkstate.testing import random_gates
ON_GPU = False


def helper(a, b=1, *, c=2):
    return a


if ON_GPU:
    libs = runner.Librarie(fla_all_configs=False)
    launch.DIRCT = True
    random_gates(1, 2, 3, 4, 5, mld=True)
    helper(1, d=3)
    print(never_bound)
    bench.Case(bench.Shape(1, 2, 3), "fwd", final=True, nope=1)
    chunkstate.chunk_fwd_h(1, 2, gg=3)
    chunkstate.chunk_bwd_dh(*libs, **libs, scael=1.0)
    from chunkstate.gates import no_such
    inp = runner.Inputs(bench.Shape(1, 64, 2))
    inp.gate("g", "gk")
    print(inp.x3, inp.x1, inp.shape)
"""


def test_the_checks_catch_what_they_are_for():
    """Each kind of rot, in a branch that never runs: every one is reported (else the tests above pass vacuously)."""
    assert unbound_names(FAULTY, "faulty") == ["never_bound (top level)"]
    # bound, but only by a later cell (chapter 11's cache-clear cell read triton before section 7 imported it)
    late = {0: "import torch\nif torch.cuda.is_available():\n    print(triton.__version__, [n for n in names])",
            1: "import triton\nnames = [x for x in dir(triton)]\ndef f():\n    return later",
            2: "later = 1"}
    assert read_before_bound(late) == ["names (cell 0)", "triton (cell 0)"]
    problems = "\n".join(chunkstate_problems(FAULTY, "faulty", None))
    for expected in ("runner.Librarie: module chunkstate.bench.runner has no attribute Librarie",
                     "launch.DIRCT: module chunkstate.launch has no attribute DIRCT",
                     "random_gates(...): got an unexpected keyword argument 'mld'",
                     "helper(...): got an unexpected keyword argument 'd'",
                     "bench.Case(...): got an unexpected keyword argument 'nope'",
                     "chunkstate.chunk_fwd_h(...): got an unexpected keyword argument 'gg'",
                     "chunkstate.gates has no no_such",
                     "inp.gate(...): too many positional arguments",
                     "inp.x3: a Inputs has no attribute x3",
                     "chunkstate.chunk_bwd_dh(...): got an unexpected keyword argument 'scael'"):
        assert expected in problems, (expected, problems)
    assert len(problems.splitlines()) == 10, problems


def test_the_gpu_cells_are_read():
    """Calls that only a GPU runs are among those checked (chapter 11's benchmark cells, chapter 06's packed batch)."""
    for name, calls in (("11_speed.ipynb", {"runner.Libraries", "runner.run_case", "runner.Inputs", "inp.gate",
                                            "bench.case_pieces",
                                            "roofline.floor_ms", "runner.copy_bandwidth"}),
                        ("06_state_in_out_varlen.ipynb", {"random_gates", "kernel_gates", "chunkstate.chunk_fwd_h",
                                                          "reference.chunked_states"})):
        checked: list[str] = []
        assert not chunkstate_problems(read(ROOT / "notebooks" / name), name, None, checked)
        assert calls <= set(checked), (name, calls - set(checked))
