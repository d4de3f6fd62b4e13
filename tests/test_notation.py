"""The figures speak chapter 00's notation: every size and gate symbol in a figure's text is one
the notation tables of notebooks/00_overview.ipynb define, and no retired name appears.

The tables' symbol and code columns are read from the notebook's JSON; the figures are those
``python -m chunkstate.figures`` draws (each module's ``main``, with ``save`` replaced by a
collector) and the explorer's views (``chunkstate.explore.views``, chapter 03a's settings, every
gate kind), drawn with matplotlib's Agg backend, and their text is every ``Text`` artist: titles,
axis labels, legends, annotations. Symbols are found in mathtext (``$...$``) and in plain text
where they read as symbols (``BT = 64``, ``N·H``, ``[B, T, H]``, ``B8 T1024``, ``2^(Γ − G_i)``).

Retired names: ``\\bar B``, ``G^v``, ``Bv`` (the value-side cumulative gate is ``G_v``), ``A_t``
(a natural-log cumulative gate), ``e^{...}`` of a cumulative gate (cumulative gates are log2, so
their decays are ``2^{...}``), and ``G`` as the GQA group size (that is ``HQ / H``).
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OVERVIEW = ROOT / "notebooks" / "00_overview.ipynb"

# Index subscripts: G_t, G_{t-1}, S_j, k_{n}: the symbol is the base (G_v keeps its v).
_INDEX = re.compile(r"^[tijsnc0-9+\-−, L]*$")
_GREEK = {r"\Gamma": "Γ", r"\gamma": "γ"}

# Retired names, searched in the raw text (mathtext or plain).
BANNED = {
    r"\bar B (value-side cumulative gate: G_v)": re.compile(r"\\bar\s*\{?\s*B|B̄"),
    r"G^v (value-side cumulative gate: G_v)": re.compile(r"G\s*\^\s*\{?\s*v"),
    "Bv (value-side cumulative gate: G_v)": re.compile(r"\bBv\b"),
    "A_t (a natural-log cumulative gate: G_t in log2)": re.compile(r"\bA_\{?[tjs]\b|\$A\$"),
    "e^(...) of a cumulative gate (cumulative gates are log2: 2^(...))":
        re.compile(r"e\^\s*\{[^}]*(?:G|\\Gamma|Γ|A)|e\^\s*\(?\s*-?\s*(?:G|Γ|A)\b"),
    "G as the GQA group size (HQ / H)":
        re.compile(r"\bG\s*[·*×]\s*H\b|HQ\s*=\s*G\b|//\s*G\b|HQ\s*/\s*G\b|\bgroup\s+G\b"),
}

# Plain-text words that look like sizes but are not symbols.
_NOT_SYMBOLS = {"KV", "SM", "SMs", "GPU", "TB", "HBM", "FLOP", "MB", "GiB", "MiB", "ID", "OK"}


def normalise(symbol: str) -> str:
    """One spelling per symbol: Greek letters as Unicode, no bold, no braces, index subscripts
    and ``[n]`` dropped (``G_t`` -> ``G``, ``\\Gamma_v`` -> ``Γ_v``, ``\\mathbf{k}_n`` -> ``k``,
    ``h[n]`` -> ``h``, ``G_{v,t}`` -> ``G_v``)."""
    s = symbol.strip().strip("$`").strip()
    for tex, uni in _GREEK.items():
        s = s.replace(tex, uni)
    s = re.sub(r"\\mathbf\s*\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\[[^\]]*\]$", "", s)
    base, _, sub = s.partition("_")
    sub = sub.strip("{}")
    if not sub or _INDEX.match(sub):
        return base
    first = sub.split(",")[0].strip()
    return f"{base}_{first}" if first and not _INDEX.match(first) else base


def table_symbols(notebook: Path = OVERVIEW) -> set[str]:
    """The symbol and code columns of every notation table ('| symbol | ...') in the notebook."""
    cells = json.loads(notebook.read_text())["cells"]
    found = set()
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        keep = None  # indices of the table's 'symbol' and 'code' columns, inside a table
        for line in "".join(cell["source"]).splitlines():
            columns = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("|"):
                keep = None
            elif columns[0] == "symbol":
                keep = [i for i, c in enumerate(columns) if c in ("symbol", "code")]
            elif keep is not None and not re.match(r"\|\s*-", line):
                for column in (columns[i] for i in keep if i < len(columns)):
                    # `g` `[B, T, H]`: the name, not the shape; $a_t$: the symbol; `K`, `V`: both
                    column = re.sub(r"`\[[^\]]*\]`", "", column)
                    for item in re.findall(r"\$[^$]+\$|`[^`]+`", column):
                        for part in item.strip("$`").split(","):
                            part = re.split(r"\s*(?:=|\\in)\s*", part.strip())[0]
                            if part:
                                found.add(normalise(part))
    return found


def _math_symbols(math: str) -> set[str]:
    """Size and gate symbols in one mathtext segment (without its $)."""
    for tex, uni in _GREEK.items():
        math = math.replace(tex, uni)
    math = re.sub(r"\\(?:mathrm|operatorname|text)\s*\{[^}]*\}", " ", math)
    math = re.sub(r"\\mathbf\s*\{([^}]*)\}", r"\1", math)
    math = re.sub(r"\\[A-Za-z]+", " ", math)  # \odot, \top, \sum, \leq, \log ...
    found = set()
    for m in re.finditer(r"(Γ|[A-Za-zγ]+)(?:_(\{[^}]*\}|[A-Za-z0-9]))?", math):
        name, sub = m.group(1), m.group(2) or ""
        if name in ("g", "gk", "gv", "γ", "a", "b", "Γ") or name == "G":
            found.add(normalise(f"{name}_{sub}" if sub else name))
        elif name.isupper():  # TKV is T·K·V; S, M single letters
            if sub and not _INDEX.match(sub.strip("{}")):
                found.add(normalise(f"{name}_{sub}"))
            else:
                found.update(name)
    return found


def _plain_symbols(text: str) -> set[str]:
    """Size and gate symbols in plain (non-math) text, where they read as symbols."""
    found = set()
    caps = r"[A-Z]{1,2}"
    for m in re.finditer(rf"\b({caps})\s*=\s*(?=[A-Z0-9(\[])", text):  # BT = 64, K = V = 128
        found.add(m.group(1))
    for m in re.finditer(rf"(?:(?<=[·×])({caps})\b|\b({caps})(?=[·×]))", text):  # N·H, K×V
        found.add(m.group(1) or m.group(2))
    for shape in re.findall(r"\[([A-Z0-9, +·]+)\]", text):  # [B, T, H, K]
        found.update(s for s in re.split(r"[, +·]+", shape) if s and not s.isdigit())
    for m in re.finditer(rf"(?<!NVIDIA )(?<!the )\b({caps})(\d+)\b", text):  # B8 T1024 H16 D64
        found.add(m.group(1))
    for m in re.finditer(r"(?<![A-Za-z])(Γ|G)(?:_([A-Za-z0-9]+))?(?![A-Za-z])", text):  # 2^(Γ − G_i)
        found.add(normalise(f"{m.group(1)}_{m.group(2)}" if m.group(2) else m.group(1)))
    return found - _NOT_SYMBOLS


def symbols_in(text: str) -> set[str]:
    """Every size and gate symbol a figure's text uses."""
    parts = text.split("$")
    return (set().union(*(_plain_symbols(p) for p in parts[0::2]))
            | set().union(*(_math_symbols(p) for p in parts[1::2])))


def violations(texts: dict[str, set[str]], defined: set[str]) -> list[str]:
    """'figure: text: problem' for every undefined symbol and every retired name."""
    out = []
    for figure, strings in sorted(texts.items()):
        for text in sorted(strings):
            for why, pattern in BANNED.items():
                if pattern.search(text):
                    out.append(f"{figure}: {text!r}: retired name {why}")
            for symbol in sorted(symbols_in(text) - defined):
                out.append(f"{figure}: {text!r}: symbol {symbol!r} is not in chapter 00's notation tables")
    return out


def figure_modules() -> list[str]:
    """The modules of chunkstate.figures that draw figures (those with a ``main``)."""
    import chunkstate.figures as package

    return [info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_")]


def figure_texts(name: str) -> dict[str, set[str]]:
    """The text of every figure module ``name``'s ``main`` draws (as ``python -m
    chunkstate.figures`` does), by file name; {} for a module without ``main``."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    module = importlib.import_module(f"chunkstate.figures.{name}")
    texts: dict[str, set[str]] = {}
    if not hasattr(module, "main"):
        return texts

    def collect(fig, name, out_dir=None):
        texts[Path(str(name)).name] = {t.get_text() for t in fig.findobj(Text) if t.get_text().strip()}
        plt.close(fig)
        return Path(str(name))

    saved = module.save
    module.save = collect
    try:
        module.main(out_dir=None)
    except FileNotFoundError as e:  # a figure of committed measurements outside a checkout
        pytest.skip(str(e))
    finally:
        module.save = saved
    return texts


@pytest.fixture(scope="module")
def defined():
    return table_symbols()


def test_tables_define_the_notation(defined):
    """The parser reads the tables (else every check below passes vacuously)."""
    sizes = {"B", "T", "H", "HQ", "K", "V", "BT", "BS", "N", "NT", "NS"}
    gates = {"g", "γ", "gk", "gv", "a", "b", "G", "G_v", "Γ", "Γ_v", "g_gamma", "Gv", "Gamma", "Gamma_v"}
    states = {"h", "S", "dh", "h0", "ht", "dht", "dh0", "s", "k", "v", "q", "do", "M"}
    assert sizes | gates | states <= defined, sorted((sizes | gates | states) - defined)
    assert not {"A", "Bv", "G^v", "A_t"} & defined


@pytest.mark.parametrize("module", figure_modules())
def test_figures_use_only_the_notation(defined, module):
    texts = figure_texts(module)
    problems = violations(texts, defined)
    assert not problems, f"chunkstate.figures.{module}: text off chapter 00's notation:\n" + "\n".join(problems)


EXPLORER_SETTINGS = dict(lengths=(72, 0, 9, 1, 46), strength=0.1, chunk_size=16, split_size=32, position=50,
                         K=32, V=32, tile=16, pieces=1)  # chapter 03a's


def _explorer_views():
    from chunkstate.explore import views

    return list(views.VIEWS)


@pytest.mark.parametrize("view", _explorer_views())
def test_explorer_views_use_only_the_notation(defined, view):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from chunkstate.explore import views

    texts = {}
    for gate in views.GATE_KINDS:
        fig = views.render(view, gate=gate, **EXPLORER_SETTINGS)
        texts[f"{view} ({gate})"] = {t.get_text() for t in fig.findobj(Text) if t.get_text().strip()}
        plt.close(fig)
    assert any(texts.values()), f"the view {view!r} drew no text"
    problems = violations(texts, defined)
    assert not problems, f"explorer view {view!r}: text off chapter 00's notation:\n" + "\n".join(problems)


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebooks_use_no_retired_name(path):
    """Markdown and code of every chapter: no retired name (module docstring)."""
    problems = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        text = "".join(cell["source"])
        for why, pattern in BANNED.items():
            for m in pattern.finditer(text):
                problems.append(f"cell {i} ({cell['cell_type']}): ...{text[max(0, m.start() - 30):m.end() + 20]!r}...: {why}")
    assert not problems, f"{path.name}: retired names:\n" + "\n".join(problems)


def test_the_figures_are_read():
    """The collector sees the figures' text (else the test above passes vacuously)."""
    texts = {**figure_texts("chunking"), **figure_texts("gates"), **figure_texts("recurrence")}
    assert {"chunking.png", "gates_cumsum.png", "gates_decays.png", "recurrence_cost.png"} <= set(texts)
    assert any("h[n+1]" in t for t in texts["chunking.png"])
    assert any("K (key rows)" in t for t in texts["gates_decays.png"])


@pytest.mark.parametrize("bad, why", [
    (r"$S_t = e^{\bar B_t}$", "retired name \\bar B"),
    (r"$(v \odot e^{G^v_L - G^v})$", "retired name G^v"),
    ("Bv: value-side cumulative sum", "retired name Bv"),
    (r"global $A_t = \sum_{s \leq t} g_s$", "retired name A_t"),
    (r"$e^{\Gamma - G_t}$", "retired name e^(...)"),
    ("weights e^(Γ − G_i)", "retired name e^(...)"),
    ("HQ = G·H query heads", "retired name G as the GQA group"),
    ("query head j reads state j // G", "retired name G as the GQA group"),
    ("chunks of CS = 64", "symbol 'CS'"),
    (r"$h \in R^{P \times V}$", "symbol 'P'"),
    ("B8 T1024 H8 E64", "symbol 'E'"),
    (r"$G_w$", "symbol 'G_w'"),
])
def test_a_bad_label_is_caught(defined, bad, why):
    problems = violations({"bad.png": {bad}}, defined)
    assert any(why in p for p in problems), (bad, problems)


def test_good_labels_pass(defined):
    good = {
        r"$h[n+1] = \mathrm{diag}(2^{\Gamma})\,h[n]\,\mathrm{diag}(2^{\Gamma_v}) + (\mathbf{k}_n \odot 2^{\Gamma - G})^\top (\mathbf{v}_n \odot 2^{\Gamma_v - G_v})$",
        "2^(Γ − G_i)", "grid = (NK·NV·N·H,)", "h\n[1, NS, H, K, V]", "B8 T1024 H8 D64 on the NVIDIA H200",
        r"$S_t = \mathrm{diag}(e^{a_t})\, S_{t-1}\, \mathrm{diag}(e^{b_t}) + k_t v_t^\top$",
        "T = 4096, BT = 64", "KV cache (bf16)", r"masked form $(\mathbf{q}\mathbf{k}^\top\odot M)\,\mathbf{v}$: $T(T+1)(K+V)$",
    }
    assert violations({"good.png": good}, defined) == []


MODULES = sorted((ROOT / "chunkstate").rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_package_uses_no_retired_name(path):
    """The package's docstrings and comments, which chapters show as highlighted code: no retired
    name either."""
    text = path.read_text()
    problems = []
    for why, pattern in BANNED.items():
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"line {line}: ...{text[max(0, m.start() - 30):m.end() + 20]!r}...: {why}")
    assert not problems, f"{path.relative_to(ROOT)}: retired names:\n" + "\n".join(problems)
