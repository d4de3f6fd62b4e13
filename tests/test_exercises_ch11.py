"""Chapter 11's checkers reject wrong answers (the shipped solutions and a stub:
tests/test_exercises.py); the chapter's figure module reads the committed H200 sweep consistently
with the byte model."""
import matplotlib
import pytest

from chunkstate import bench
from chunkstate.exercises import ch11_speed as ex
from chunkstate.figures import roofline

matplotlib.use("Agg")


# ---------------------------------------------------------------- exercise 1: unique bytes

def _bytes(B, T, H, D, gate="g", state_bytes=2, split_size=64, lens=None, per_chunk=False, dense=False,
           floor=False, gate_scalar=False, gate_bf16=False, no_v=False, no_states=False):
    """The solution with knobs to break one thing at a time."""
    tokens = B * T * H
    kv = (1 if no_v else 2) * tokens * D * 2
    gate_bytes = tokens * (2 if gate_bf16 else 4) * (D if gate == "gk" and not gate_scalar else 1)
    lengths = [T] * B if (lens is None or dense) else list(lens)
    BS = 64 if per_chunk else split_size
    splits = sum((L // BS) if floor else -(-L // BS) for L in lengths)
    return kv + gate_bytes + (0 if no_states else splits * H * D * D * state_bytes)


def test_forward_bytes_knobs_at_defaults_pass():
    ex.check_forward_bytes(_bytes)


@pytest.mark.parametrize("knob", ["per_chunk", "dense", "floor", "gate_scalar", "gate_bf16", "no_v", "no_states"])
def test_forward_bytes_wrong_answer_rejected(knob):
    def wrong(*args, **kwargs):
        return _bytes(*args, **kwargs, **{knob: True})

    with pytest.raises(AssertionError):
        ex.check_forward_bytes(wrong)


def test_forward_bytes_float_rejected():
    def as_float(*args, **kwargs):
        return float(ex.forward_bytes(*args, **kwargs))

    with pytest.raises(AssertionError, match="must return an int"):
        ex.check_forward_bytes(as_float)


# ---------------------------------------------------------------- exercise 2: the piece plan

def _plan(lengths, BS, pieces, round_splits=True, own_length=False, empty_piece=False, seq_off_by_one=False,
          floor=False):
    longest = max(lengths, default=0)
    cu, seq, start = [0], [0], 0
    for L in lengths:
        ref = L if own_length else longest
        per = ref // pieces if floor else -(-ref // pieces)
        piece_len = max(BS, -(-per // BS) * BS) if round_splits else max(1, per)
        if L == 0 and empty_piece:
            cu.append(start)
        for first in range(0, L, piece_len):
            cu.append(start + min(first + piece_len, L))
        start += L
        seq.append(len(cu) - 1 + (1 if seq_off_by_one else 0))
    return cu, seq


def test_piece_plan_knobs_at_defaults_pass():
    ex.check_piece_plan(_plan)


@pytest.mark.parametrize("knob", ["round_splits", "own_length", "empty_piece", "seq_off_by_one", "floor"])
def test_piece_plan_wrong_answer_rejected(knob):
    def wrong(lengths, BS, pieces):
        return _plan(lengths, BS, pieces, **{knob: knob != "round_splits"})

    with pytest.raises(AssertionError):
        ex.check_piece_plan(wrong)


def test_piece_plan_cu_only_rejected():
    with pytest.raises(AssertionError, match="must return a tuple"):
        ex.check_piece_plan(lambda lengths, BS, pieces: ex.piece_plan(lengths, BS, pieces)[0])


# ---------------------------------------------------------------- the chapter's figure module

def test_sweep_floors_are_the_byte_model_over_the_copy_bandwidth():
    sweep = roofline.load_sweep()
    copy = sweep["copy_bandwidth_TBps"]
    rows = roofline.sweep_rows(sweep)
    assert len(rows) == len(sweep["rows"]) == 8
    for r in rows:
        assert abs(r["bytes"] / (copy * 1e9) / r["floor_ms"] - 1) < 1e-9, r["label"]
        assert r["best_ms"] >= r["floor_ms"], r["label"]  # nothing beats a copy


def test_flops_and_intensity_by_hand():
    case = bench.Case(bench.Shape(8, 4096, 16), "fwd")
    assert roofline.flops(case) == 2 * 128 * 128 * 8 * 4096 * 16
    # per (token, head): 32,768 FLOP over 2·128·2 (k, v) + 4 (g) + 128²·2/64 (h) = 1,028 bytes
    assert roofline.intensity(case) == pytest.approx(32768 / 1028)
    assert roofline.ridge() == pytest.approx(989 / 4.8)


def test_parse_config():
    assert roofline.parse_config("64x128w4s3") == (64, 128, 4, 3)
    with pytest.raises(ValueError, match="config name"):
        roofline.parse_config("64x128")


def test_figures_draw(tmp_path):
    import matplotlib.pyplot as plt

    sweep = roofline.load_sweep()
    for draw in (roofline.draw_roofline, roofline.draw_occupancy):
        fig = draw(sweep)
        assert fig.axes and fig.axes[0].get_title()
        plt.close(fig)
    paths = roofline.main(tmp_path)
    assert paths == [tmp_path / "roofline.png", tmp_path / "occupancy_h200.png"] and all(p.is_file() for p in paths)
