"""chunkstate.explore: the program map against what the real kernels write, its tables and picture,
the explorer's views and widgets.

The map's central claim is tested against the kernels themselves: for each case, every state
element the map says some program stores is exactly an element that the real ``chunk_fwd_h`` /
``chunk_bwd_dh`` fills in an output that starts NaN (the conftest poisons ``torch.empty``), no
element is claimed by two programs, the map has as many programs as the real launch's grid, and
the programs of each (sequence, head, tile) walk the sequence's tokens exactly once. Two
deliberately wrong helpers show that a change of the kernels' indexing changes the map.
"""
from __future__ import annotations

import sys

import pytest
import torch
import triton
import triton.language as tl

import chunkstate
from chunkstate import backward, explore, forward
from chunkstate.bench import model
from chunkstate.explore import programs, views
from chunkstate.testing import check_close

ON_GPU = chunkstate.DEVICE == "cuda"
TOL = 1e-5 if chunkstate.INTERPRET else 2e-3  # the views run fp32 kernels: tf32 dots on a GPU


def cfg(BK, BV):
    return triton.Config({"BK": BK, "BV": BV}, num_warps=4, num_stages=1)


# (name, B, T, H, lengths or None, chunk_size, split_size, pieces, config, HQ)
CASES = [
    ("dense", 2, 40, 2, None, 16, None, 1, cfg(32, 32), None),
    ("packed-empty-one-token", 1, 64, 2, (20, 0, 33, 1, 10), 16, 32, 1, cfg(16, 32), None),
    ("split-over-chunk", 1, 100, 1, None, 16, 48, 1, cfg(32, 16), None),
    ("dense-pieces-3", 2, 100, 1, None, 16, 32, 3, cfg(32, 32), None),
    ("packed-pieces-3", 1, 130, 2, (70, 0, 1, 59), 16, 16, 3, cfg(32, 32), None),
    ("gqa", 1, 64, 2, (20, 0, 33, 1, 10), 16, 32, 1, cfg(32, 32), 4),
    ("gqa-pieces-2", 1, 98, 1, (64, 34), 16, 32, 2, cfg(32, 16), 2),
]
K, V = 48, 40  # not multiples of the tiles: partial tiles at both edges


def cu_of(lengths):
    if lengths is None:
        return None
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + L)
    return cu


class GridSpy:
    """Records the number of programs of every launch of one kernel (wrapping its ``run``)."""

    def __init__(self, monkeypatch, kernel):
        self.grids = []
        original = kernel.run

        def run(*args, grid, **kwargs):
            g = grid(kwargs) if callable(grid) else grid
            self.grids.append(g[0] if isinstance(g, tuple) else g)
            return original(*args, grid=grid, **kwargs)

        monkeypatch.setattr(kernel, "run", run)


def real_written(direction, B, T, H, lengths, BT, BS, pieces, config, HQ, monkeypatch):
    """The elements of h (dh) [B·NS, H, K, V] the real kernel fills from NaN, and its launches' grids."""
    cu = cu_of(lengths)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=chunkstate.DEVICE)
    dev = chunkstate.DEVICE
    if direction == "fwd":
        spy = GridSpy(monkeypatch, forward.chunk_fwd_kernel_h)
        k, v = torch.randn(B, T, H, K, device=dev), torch.randn(B, T, H, V, device=dev)
        h, _ = chunkstate.chunk_fwd_h(k, v, cu_seqlens=cu_t, chunk_size=BT, split_size=BS, pieces=pieces,
                                      config=config)
    else:
        spy = GridSpy(monkeypatch, backward.chunk_bwd_kernel_dh)
        HQ = HQ or H
        q, do = torch.randn(B, T, HQ, K, device=dev), torch.randn(B, T, HQ, V, device=dev)
        k, v = torch.randn(B, T, H, K, device=dev), torch.randn(B, T, H, V, device=dev)
        h, _ = chunkstate.chunk_bwd_dh(q, k, v, do, None, None, K ** -0.5, cu_seqlens=cu_t, chunk_size=BT,
                                       split_size=BS, pieces=pieces, config=config)
    return ~torch.isnan(h.reshape(-1, H, K, V).cpu()), spy.grids


def map_written(table):
    """The elements the map says are stored, and how many programs claim each."""
    count = torch.zeros(table.B * table.NS, table.H, table.K, table.V, dtype=torch.int32)
    for r in table.rows:
        s0 = r["first_slot"]
        count[s0:s0 + r["slots"], r["head"], r["k0"]:r["k1"], r["v0"]:r["v1"]] += 1
    return count > 0, count


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_map_matches_what_the_kernel_writes(case, direction, monkeypatch):
    name, B, T, H, lengths, BT, BS, P, config, HQ = case
    if HQ is not None and direction == "fwd":
        pytest.skip("GQA is the backward's (the forward has one head per state)")
    table = explore.program_map(B, T, H, K, V, cu_seqlens=cu_of(lengths), chunk_size=BT, split_size=BS, pieces=P,
                                config=config, direction=direction, HQ=HQ)
    real, grids = real_written(direction, B, T, H, lengths, BT, BS, P, config, HQ, monkeypatch)
    claimed, count = map_written(table)
    assert real.shape == claimed.shape
    assert int(count.max()) <= 1, "two programs of the map store the same state element"
    missing = (real & ~claimed).nonzero()[:5].tolist()
    extra = (claimed & ~real).nonzero()[:5].tolist()
    assert not missing and not extra, (f"{name} {direction}: elements the kernel writes but the map does not claim "
                                       f"(slot, head, k, v) {missing}; claimed but left NaN {extra}")
    assert real.any()
    assert grids and grids[-1] == table.grid == len(table.rows), \
        f"the map has {len(table.rows)} programs; the real launches had grids {grids}"
    assert table.pieces == P


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_token_walked_once_per_tile(case):
    name, B, T, H, lengths, BT, BS, P, config, HQ = case
    table = explore.program_map(B, T, H, K, V, cu_seqlens=cu_of(lengths), chunk_size=BT, split_size=BS, pieces=P,
                                config=config, direction="bwd" if HQ else "fwd", HQ=HQ)
    NK, NV = -(-K // config.kwargs["BK"]), -(-V // config.kwargs["BV"])
    lens = list(lengths) if lengths else [T] * B
    walks = {}
    for r in table.rows:
        walks.setdefault((r["seq"], r["head"], r["i_k"], r["i_v"]), []).append((r["bos"], r["length"]))
        assert r["chunks"] == -(-r["length"] // BT)
        assert r["slots"] == -(-r["length"] // table.BS)
    for n, L in enumerate(lens):
        for h in range(H):
            for i_k in range(NK):
                for i_v in range(NV):
                    spans = sorted(walks.get((n, h, i_k, i_v), []))
                    if L == 0:  # launched and idle without pieces; no piece at all with them
                        assert all(length == 0 for _, length in spans) and (P > 1 or len(spans) == 1)
                        continue
                    pos = table.seq_offsets[n]
                    for bos, length in spans:
                        assert bos == pos, f"{name}: sequence {n} head {h} tile {(i_k, i_v)}: gap or overlap at {pos}"
                        pos += length
                    assert pos == table.seq_offsets[n] + L, f"{name}: sequence {n} not walked to its end"
                    starts = sorted({x for x in table.piece_offsets[:-1] if table.seq_offsets[n] <= x < pos})
                    assert len(spans) == len(starts), f"{name}: sequence {n}: {len(spans)} walks, pieces {starts}"


def test_pieces_marked_as_pieces_run_plans_them():
    table = explore.program_map(1, 768, 2, 64, 64, chunk_size=64, split_size=128, pieces=3)
    assert table.piece_offsets == (0, 256, 512, 768)
    assert sorted({r["piece"] for r in table.rows}) == [0, 1, 2]
    assert {r["first_slot"] for r in table.rows} == {0, 2, 4}
    assert table.one_launch and table.first_walk_bytes()["read"] > 0


# ---------------------------------------------------------------------------------------------
# A wrong helper changes the map (the interpreter looks the helpers up when the kernel runs; a
# compiled kernel keeps the helper it was compiled with, so these run on CPU only)
# ---------------------------------------------------------------------------------------------

@triton.jit
def heads_first_tile(H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """program_tile with sequence and head swapped (i_n = i_nh % H): a plausible slip."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0).to(tl.int64)
    i_nh = pid // (NK * NV)
    return i_nh, i_nh % H, i_nh // H, ((pid // NV) % NK).to(tl.int32), (pid % NV).to(tl.int32)


@triton.jit
def chunk_counted_bounds(i_n, T, cu_seqlens, split_offsets, BS: tl.constexpr, IS_VARLEN: tl.constexpr,
                         STORE_STATES: tl.constexpr):
    """sequence_bounds counting a dense sequence's slots in 16-token chunks instead of splits."""
    bos = i_n * T
    return bos, T, i_n * tl.cdiv(T, 16)


@pytest.mark.skipif(ON_GPU, reason="a compiled kernel keeps the helper it was first compiled with")
@pytest.mark.parametrize("helper, wrong", [("program_tile", heads_first_tile),
                                          ("sequence_bounds", chunk_counted_bounds)])
def test_a_wrong_helper_changes_the_map(helper, wrong, monkeypatch):
    args = dict(chunk_size=16, split_size=32, config=cfg(32, 32))
    right = explore.program_map(3, 64, 2, K, V, **args)
    real, _ = real_written("fwd", 3, 64, 2, None, 16, 32, 1, cfg(32, 32), None, monkeypatch)
    assert torch.equal(map_written(right)[0], real)
    monkeypatch.setattr(programs, helper, wrong)
    mutated = explore.program_map(3, 64, 2, K, V, **args)
    assert [(r["seq"], r["head"], r["first_slot"]) for r in mutated.rows] != \
        [(r["seq"], r["head"], r["first_slot"]) for r in right.rows]
    assert mutated.written_slots() != right.written_slots()


# ---------------------------------------------------------------------------------------------
# The bytes model
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("gate", ["g", "gk"])
def test_bytes_equal_unique_bytes_with_one_tile(direction, gate):
    """One tile per (sequence, head): the rows add up to the benchmark's unique bytes."""
    shape = model.Shape(2, 320, 3, 64)
    case = model.Case(shape, direction, gate=gate, split=128)
    table = explore.program_map(2, 320, 3, 64, 64, chunk_size=model.BT, split_size=128, config=cfg(64, 64),
                                direction=direction, gates=(gate,), dtype=torch.bfloat16, h0=True,
                                output_final_state=True)
    total = table.total_bytes()
    assert total["read"] + total["written"] == sum(model.unique_bytes(case, h0=True, final=True).values())


def test_bytes_with_several_tiles_read_inputs_again():
    """Two V tiles read k twice, two K tiles v twice; the scalar gate once per tile."""
    B, T, H, D = 1, 200, 2, 128
    one = explore.program_map(B, T, H, D, D, config=cfg(128, 128), gates=("g",))
    four = explore.program_map(B, T, H, D, D, config=cfg(64, 64), gates=("g",))
    tokens = B * T * H
    assert four.total_bytes()["written"] == one.total_bytes()["written"]
    extra = four.total_bytes()["read"] - one.total_bytes()["read"]
    assert extra == tokens * D * 2 * (2 - 1) * 2 + tokens * 4 * (4 - 1)  # k and v once more each, g 3 more times


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_pieces_bytes_as_the_call_runs_them(direction, monkeypatch):
    """In one launch each sequence's last piece (in the backward, its first) skips walk 0, and walk 1
    reads the contributions it folds; in three launches the first pass walks every piece and the
    storing pass reads the scan's start. B1 T768 H2 in 3 pieces of 256 tokens, 64 × 64 tiles."""
    shape = dict(B=1, T=768, H=2, K=128, V=128, chunk_size=64, split_size=128, gates=("g",), direction=direction)
    whole = explore.program_map(**shape, pieces=1)
    one = explore.program_map(**shape, pieces=3, one_launch=True)
    three = explore.program_map(**shape, pieces=3, one_launch=False)
    assert one.one_launch and not three.one_launch and not whole.one_launch
    monkeypatch.setattr(chunkstate.pieces, "ONE_LAUNCH", False)
    assert not explore.program_map(**shape, pieces=3).one_launch  # the default follows pieces.ONE_LAUNCH
    monkeypatch.setattr(chunkstate.pieces, "ONE_LAUNCH", True)
    assert explore.program_map(**shape, pieces=3).one_launch
    skipped = 2 if direction == "fwd" else 0  # the piece whose contribution nothing reads
    assert {r["piece"] for r in one.rows if r["first_walk_read"] == 0} == {skipped}
    assert all(r["first_walk_read"] > 0 and r["first_walk_written"] > 0 for r in three.rows)
    inputs, tile = whole.total_bytes()["read"], 64 * 64 * 4  # no h0: the unsplit launch reads its inputs only
    assert one.first_walk_bytes() == {"read": inputs * 2 // 3, "written": 16 * tile}  # 2 of 3 pieces, 8 tiles each
    assert three.first_walk_bytes() == {"read": inputs, "written": 24 * tile}
    assert one.total_bytes()["read"] == inputs + (0 + 1 + 2) * 8 * tile  # the fold: the pieces walked before
    assert three.total_bytes()["read"] == inputs + 24 * tile  # each program's start, from the scan
    assert one.total_bytes()["written"] == three.total_bytes()["written"] == whole.total_bytes()["written"]
    reads = (one.total_bytes()["read"] + one.first_walk_bytes()["read"]) / inputs
    assert 1.9 < reads < 2  # every piece's walk 0 counted, as the three launches' first pass, it is over 2:
    assert (three.total_bytes()["read"] + three.first_walk_bytes()["read"]) / inputs > 2.2
    ends = explore.program_map(**shape, pieces=3, one_launch=True, h0=True, output_final_state=True)
    opens, closes = (0, 2) if direction == "fwd" else (2, 0)  # h0 / dht read, ht / dh0 written, in one launch
    assert [e["bytes_read"] - r["bytes_read"] for e, r in zip(ends.rows, one.rows)] == \
        [tile * (r["piece"] == opens) for r in one.rows]
    assert [e["bytes_written"] - r["bytes_written"] for e, r in zip(ends.rows, one.rows)] == \
        [tile * (r["piece"] == closes) for r in one.rows]
    empty = explore.program_map(1, 130, 2, 128, 128, cu_seqlens=[0, 70, 70, 130], chunk_size=16, split_size=16,
                                pieces=3, one_launch=True, direction=direction)
    assert not empty.one_launch and all(r["first_walk_read"] > 0 for r in empty.rows)  # as pieces.run: three


def test_gqa_reads_every_query_head():
    one = explore.program_map(1, 64, 2, 32, 32, direction="bwd", config=cfg(32, 32))
    four = explore.program_map(1, 64, 2, 32, 32, direction="bwd", HQ=8, config=cfg(32, 32))
    assert len(four) == len(one) == 2  # a program per KV head, either way
    assert four.total_bytes()["read"] == 4 * one.total_bytes()["read"]


# ---------------------------------------------------------------------------------------------
# Arguments and the table
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(chunk_size=12), ValueError, "chunk_size must be a power of two"),
    (dict(split_size=40), ValueError, "split_size must be a positive multiple"),
    (dict(cu_seqlens=[0, 10, 60]), ValueError, "cu_seqlens must end at T=64"),
    (dict(cu_seqlens=[0, 70, 64]), ValueError, "non-decreasing"),
    (dict(cu_seqlens="0,64"), TypeError, "cu_seqlens must be"),
    (dict(pieces=0), ValueError, "pieces must be None or a positive int"),
    (dict(config=cfg(24, 32)), ValueError, "config's BK must be 16, 32, 64 or 128"),
    (dict(config=triton.Config({"BK": 32, "BV": 32, "NARROW_V": True}), direction="bwd"), ValueError,
     "does not take"),
    (dict(direction="up"), ValueError, "direction must be"),
    (dict(HQ=3), ValueError, "HQ must be a positive multiple of H=2"),
    (dict(gates=("g", "gq")), ValueError, "gates must name"),
])
def test_bad_arguments_get_the_kernels_errors(kwargs, error, match):
    B = 1 if "cu_seqlens" in kwargs else 2
    with pytest.raises(error, match=match):
        explore.program_map(B, 64, 2, 32, 32, **kwargs)


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="T must be an int >= 0"):
        explore.program_map(1, -1, 1, 32, 32)
    with pytest.raises(ValueError, match="with cu_seqlens the batch size must be 1"):
        explore.program_map(2, 64, 1, 32, 32, cu_seqlens=[0, 64])


def test_nothing_to_do_gives_an_empty_map():
    assert len(explore.program_map(1, 64, 1, 0, 32)) == 0
    assert len(explore.program_map(0, 64, 1, 32, 32)) == 0
    table = explore.program_map(1, 0, 1, 32, 32)
    assert len(table) == 1 and table.rows[0]["length"] == 0 and table.rows[0]["slots"] == 0


def test_table_columns_and_pandas():
    table = explore.program_map(1, 64, 2, 32, 32, cu_seqlens=[0, 30, 30, 64], chunk_size=16)
    assert table.column("pid") == list(range(len(table)))
    assert table.grid == 3 * 2 and "6 programs" in table.summary()
    assert table.written_slots() == {(s, h) for s in range(2 + 3) for h in range(2)}
    try:
        import pandas  # noqa: F401  (optional: not a dependency)
    except ImportError:
        with pytest.raises(ImportError):
            table.to_pandas()
    else:
        assert list(table.to_pandas()["pid"]) == list(range(6))


def test_default_config_is_the_interpreters():
    table = explore.program_map(1, 64, 1, 100, 100)
    assert (table.BK, table.BV) == (64, 64) and len(table) == 4


def test_packed_slots_match_the_layout_figure():
    """Chapter 06's packed batch (lengths 5, 0, 11, 1, 8 at BT = 4, drawn by figures.layout) owns
    the same slots as that batch four times as long at BT = 16, which the kernels can run."""
    table = explore.program_map(1, 97, 1, 16, 16, cu_seqlens=[0, 20, 20, 64, 65, 97], chunk_size=16)
    first = {r["seq"]: r["first_slot"] for r in table.rows}
    assert [first[n] for n in range(5)] == [0, 2, 2, 5, 6]
    assert sum(r["slots"] for r in table.rows) == 8


# ---------------------------------------------------------------------------------------------
# The picture, the views, the explorer
# ---------------------------------------------------------------------------------------------

def test_draw_program_map():
    import matplotlib

    matplotlib.use("Agg")
    table = explore.program_map(1, 97, 2, 64, 64, cu_seqlens=[0, 20, 20, 64, 65, 97], chunk_size=16, config=cfg(32, 64))
    fig = explore.draw_program_map(table, sms=8, mark_token=30)
    ax = fig.axes[0]
    assert ax.get_ylim() == (len(table) - 0.5, -0.5)
    assert "20 programs on 8 SMs: 3 wave(s)" in ax.get_title()
    assert len(ax.patches) >= sum(r["length"] > 0 for r in table.rows)  # one bar per busy program
    assert views.png(fig)[:4] == b"\x89PNG"


SETTINGS = dict(lengths=(40, 0, 23, 1, 36), strength=0.1, chunk_size=16, split_size=32, position=50, K=16, V=16,
                tile=16, pieces=1)


@pytest.mark.parametrize("gate", views.GATE_KINDS)
def test_kernel_states_match_the_loop(gate):
    s = views.states(**{**SETTINGS, "gate": gate})
    assert s["h_kernel"].shape == s["h_loop"].shape == (2 + 0 + 1 + 1 + 2, 16, 16)
    check_close(s["h_kernel"], s["h_loop"], f"h with {gate}", tol=TOL)
    check_close(s["ht_kernel"], s["ht_loop"], f"ht with {gate}", tol=TOL)


def test_pieces_give_the_same_states():
    one = views.states(**{**SETTINGS, "lengths": (100,), "gate": "gk"})
    three = views.states(**{**SETTINGS, "lengths": (100,), "gate": "gk", "pieces": 3})
    check_close(three["h_kernel"], one["h_kernel"], "h with 3 pieces against 1", tol=TOL)


def test_decay_weights_inside_a_chunk():
    for gate in views.GATE_KINDS:
        d = views.chunk_decays(SETTINGS["lengths"], gate, 0.1, 16, 50, K=16, V=16)
        assert (d["t0"], d["t1"]) == (40, 56)  # sequence 2 starts at 40; its first chunk
        W = d["W"]
        assert W.shape[0] == 16 and bool((W > 0).all() and (W <= 1 + 1e-12).all())
        assert torch.allclose(W[-1], torch.ones_like(W[-1]))  # the last token is not decayed
        assert bool((W[:-1] <= W[1:] + 1e-12).all())  # earlier tokens decay more
    d = views.chunk_decays((64,), "g_gamma", 0.1, 16, 20)
    assert torch.allclose(d["W"], torch.exp(-0.1 * torch.arange(15, -1, -1, dtype=torch.float64)))


def test_views_are_figures_that_follow_the_settings():
    import matplotlib

    matplotlib.use("Agg")
    for view in views.VIEWS:
        a = views.png(views.render(view, gate="gk", **SETTINGS))
        b = views.png(views.render(view, gate="gk", **{**SETTINGS, "position": 90}))
        assert a[:4] == b[:4] == b"\x89PNG"
        assert a != b, f"{view}: moving the token changed nothing"
    with pytest.raises(ValueError, match="position must be a token"):
        views.state_heatmaps(**{**SETTINGS, "position": 100})
    with pytest.raises(ValueError, match="gate must be one of"):
        views.decay_weights(**{**SETTINGS, "gate": "gq"})
    with pytest.raises(ValueError, match="view must be one of"):
        views.render("heat", **SETTINGS)


def test_locate():
    where = views.locate((40, 0, 23, 1, 36), 63, 16, 32)
    assert where == dict(seq=3, bos=63, L=1, chunk=0, t0=63, t1=64, split=0, slot=3, first_slot=3, slots=1)


def test_explorer_widgets_redraw():
    pytest.importorskip("ipywidgets", reason="ipywidgets is not installed (pip install -r requirements.txt)")
    from chunkstate.explore import widgets

    ui = widgets.explorer(K=16, V=16, lengths="30, 20", position=10, view="decay weights")
    first = ui.image.value
    assert first[:4] == b"\x89PNG" and ui.redraws == 1
    ui.controls["position"].value = 35
    assert ui.image.value != first and ui.redraws == 2
    ui.controls["lengths"].value = "12"
    assert ui.controls["position"].max == 11 and ui.controls["position"].value == 11
    ui.controls["lengths"].value = "12, x"
    assert "whole numbers" in ui.status.value
    with pytest.raises(TypeError, match="unknown settings"):
        widgets.explorer(colour="red")
    assert "text/plain" in ui._repr_mimebundle_() or ui._repr_mimebundle_()


def test_explorer_without_ipywidgets_shows_a_static_figure(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets now raises ImportError
    from chunkstate.explore import widgets

    with pytest.warns(UserWarning, match="need ipywidgets"):
        fig = widgets.explorer(K=16, V=16, lengths="30", position=3)
    assert hasattr(fig, "savefig")
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_import_chunkstate_loads_no_plotting_or_widgets():
    import subprocess

    code = ("import sys, chunkstate, chunkstate.explore; "
            "print(sorted(m for m in ('matplotlib', 'ipywidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
