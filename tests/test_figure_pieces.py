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


def test_main_writes_the_png(tmp_path):
    paths = pieces.main(tmp_path)
    assert [p.name for p in paths] == ["pieces_steps.png"] and paths[0].stat().st_size > 0
