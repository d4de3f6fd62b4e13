"""chunkstate.figures.pipeline: the schedule it draws, and the figure's labelled parts."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from chunkstate.figures import pipeline  # noqa: E402


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("n_chunks", [1, 2, 7])
def test_schedule_respects_the_loop(stages, n_chunks):
    L, C = 3, 1
    load, compute = pipeline.schedule(stages, n_chunks, L, C)
    assert len(load) == len(compute) == n_chunks
    for n in range(n_chunks):
        assert compute[n] >= load[n] + L  # a product waits for its chunk's k and v
        if n:
            assert compute[n] >= compute[n - 1] + C  # and for h[n], the previous product
    ends = sorted(set(load) | {s + L for s in load} | set(compute))
    most = max(pipeline.in_flight(load, L, t) for t in ends)
    assert most <= max(1, stages - 1)  # at most s − 1 loads on their way
    if stages == 1:  # no overlap: each load is issued after the previous product
        assert all(load[n] >= compute[n - 1] + C for n in range(1, n_chunks))


def test_schedule_while_chunk_n_computes_the_next_loads_are_in_flight():
    """num_stages = 3: while chunk n (from the second on) is computed, chunks n+1 and n+2 are on their
    way or arrived; num_stages = 1 takes (L + C) per chunk; 3 stages are faster."""
    L, C, NT = 3, 1, 6
    load, compute = pipeline.schedule(3, NT, L, C)
    for n in range(NT - 2):
        assert load[n + 1] <= compute[n] and load[n + 2] <= compute[n]
    load1, compute1 = pipeline.schedule(1, NT, L, C)
    assert compute1[-1] + C == NT * (L + C)
    assert compute[-1] + C < compute1[-1] + C


def test_schedule_refuses_bad_sizes():
    with pytest.raises(ValueError, match="num_stages"):
        pipeline.schedule(0, 4)


def test_draw_has_the_labelled_parts():
    fig = pipeline.draw(stages=(1, 3), n_chunks=6)
    try:
        axes = fig.axes
        assert len(axes) == 2
        assert "num_stages = 1" in axes[0].get_title() and "num_stages = 3" in axes[1].get_title()
        for ax in axes:
            rows = [t.get_text() for t in ax.get_yticklabels()]
            assert any("load" in r for r in rows) and any("compute" in r for r in rows)
            labels = [t.get_text() for t in ax.texts]
            assert sorted(labels) == sorted([str(n) for n in range(6)] * 2)  # every chunk: a load and a product
            assert len(ax.patches) == 12
            assert ax.get_xlabel() == "time step"
        assert "24 steps" in axes[0].get_title() and "11 steps" in axes[1].get_title()
    finally:
        plt.close(fig)


def test_main_writes_the_png(tmp_path):
    paths = pipeline.main(tmp_path)
    assert [p.name for p in paths] == ["pipelined_loop.png"] and paths[0].stat().st_size > 0
