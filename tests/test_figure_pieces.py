"""chunkstate.figures.pieces: the pieces' boundaries, and the figure's three labelled steps."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from chunkstate import pieces as pieces_module  # noqa: E402
from chunkstate.figures import pieces  # noqa: E402


def test_boundaries_tile_the_sequence_like_the_plan():
    """The drawn pieces are the plan's: 4 pieces of 4 chunks (split = chunk) start where
    chunkstate.pieces.plan starts them."""
    BT = 64
    assert pieces.boundaries(4, 4) == [0, 4, 8, 12, 16]
    cu_pieces, seq_pieces = pieces_module.plan([16 * BT], BT, 4)
    assert [x // BT for x in cu_pieces] == pieces.boundaries(4, 4) and seq_pieces == [0, 4]


def test_boundaries_refuse_bad_sizes():
    with pytest.raises(ValueError, match="n_pieces"):
        pieces.boundaries(0, 4)


def test_draw_has_the_three_labelled_steps():
    fig = pieces.draw(n_pieces=4, chunks_per_piece=4)
    try:
        step1, step2, step3 = fig.axes
        assert [ax.get_title(loc="left")[:2] for ax in fig.axes] == ["1.", "2.", "3."]
        assert "zero state" in step1.get_title(loc="left")
        assert r"h_{p+1}" in step2.get_title(loc="left") and "f_p" in step2.get_title(loc="left")
        assert "storing its states" in step3.get_title(loc="left")
        texts1 = [t.get_text() for t in step1.texts]
        assert [t for t in texts1 if "f_" in t] == [f"$f_{p}$, $d_{p}$" for p in range(4)]
        assert texts1.count("0") == 4  # every piece starts from a zero state
        assert len(step1.patches) == 4 and len(step3.patches) == 4
        texts2 = [t.get_text() for t in step2.texts]
        assert [t for t in texts2 if t.startswith("$h_")] == ["$h_{0}$ = h0", "$h_{1}$", "$h_{2}$", "$h_{3}$",
                                                              "$h_{4}$ = ht"]
        assert sum(t.startswith("$+") for t in texts2) == 4 and len(step2.patches) == 4  # one arrow a piece
        assert [t.get_text() for t in step3.texts] == [f"from $h_{p}$" for p in range(4)]
        stored = [x for line in step3.lines for x in line.get_xdata()]
        assert sorted(stored) == list(range(16))  # one state h[n] entering each chunk n
        assert "4 pieces of 4 chunks" in step3.get_xlabel()
    finally:
        plt.close(fig)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("n_pieces", [1, 2, 4, 7])
def test_one_launch_schedule_follows_the_kernels_rules(n_pieces, reverse):
    """The timeline the one-launch figure draws keeps the kernels' rules (pieces.piece_role,
    fold_contributions, publish_contribution): every piece but the one nothing reads walks from zero
    and publishes; each folds exactly the pieces before it (after it, nearest last, in reverse), in
    the kernels' order, and starts its storing walk only after all of them published; no piece waits
    on one that waits; the launch ends after two walks and a fold, or one walk with one piece."""
    c, fold = 4, 0.5
    rows = pieces.one_launch_schedule(n_pieces, c, reverse=reverse, fold_steps=fold)
    assert [r["piece"] for r in rows] == list(range(n_pieces))
    unread = 0 if reverse else n_pieces - 1
    for r in rows:
        p = r["piece"]
        assert (r["walk0"] is None) == (p == unread)
        assert r["folds"] == (list(range(n_pieces - 1, p, -1)) if reverse else list(range(p)))
        assert all(rows[q]["walk0"] is not None for q in r["folds"])  # it waits only on pieces that publish
        published = max((rows[q]["walk0"][1] for q in r["folds"]), default=0)
        assert r["wait"][1] == max(published, r["walk0"][1] if r["walk0"] else 0)
        assert r["fold"] == (r["wait"][1], r["wait"][1] + (fold if r["folds"] else 0))
        assert r["walk1"] == (r["fold"][1], r["fold"][1] + c)
    end = max(r["walk1"][1] for r in rows)
    assert end == (c if n_pieces == 1 else 2 * c + fold)
    assert rows[unread]["wait"] == (0, 0 if n_pieces == 1 else c)  # the piece nothing reads waits one walk


def test_draw_one_launch_names_each_walk_and_fold():
    fig = pieces.draw_one_launch(n_pieces=4, chunks_per_piece=4)
    try:
        (ax,) = fig.axes
        texts = [t.get_text() for t in ax.texts]
        assert [t for t in texts if t.startswith("walk 0")] == [f"walk 0: from 0 to $f_{p}$, $d_{p}$" for p in range(3)]
        assert [t for t in texts if t.startswith("walk 1")] == (["walk 1: from $h_0$ = h0, storing"]
                                                               + [f"walk 1: from $h_{p}$, storing" for p in (1, 2, 3)])
        assert [t for t in texts if t.startswith("fold")][-1] == "fold: $h_3$ = h0 carried through $f_0$, $f_1$, $f_2$"
        assert [t for t in texts if t.startswith("waits")] == ["waits for the flags of $f_0$, $f_1$, $f_2$"]
        stored = sum(len(line.get_xdata()) for line in ax.lines if line.get_marker() == "|")
        assert stored == 16  # one state entering each chunk, as the unsplit run stores them
        ticks = [t.get_text() for t in ax.get_yticklabels()]
        assert ticks == ["one pass"] + [f"piece {p} (ticket {p})" for p in range(4)]
        assert "one pass after 16" in ax.get_xlabel()
    finally:
        plt.close(fig)


def test_main_writes_the_pngs(tmp_path):
    paths = pieces.main(tmp_path)
    assert [p.name for p in paths] == ["pieces_steps.png", "pieces_one_launch.png"]
    assert all(p.stat().st_size > 0 for p in paths)
