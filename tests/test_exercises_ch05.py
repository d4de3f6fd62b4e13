"""Chapter 05's checkers reject wrong answers (the shipped solutions and a stub: tests/test_exercises.py)."""
import pytest
import torch
import triton

from chunkstate.exercises import ch05_tiles_and_gates as ex


# ---- program_id_of ----

def _k_fastest(i_n, i_h, i_k, i_v, H, NK, NV):  # i_k varies fastest: another order than the decode
    return ((i_n * H + i_h) * NV + i_v) * NK + i_k


def _one_program_per_head(i_n, i_h, i_k, i_v, H, NK, NV):  # forgets that a head has NK·NV tiles
    return (i_n * H + i_h) + i_k * NV + i_v


def _ignores_sequence(i_n, i_h, i_k, i_v, H, NK, NV):
    return (i_h * NK + i_k) * NV + i_v


@pytest.mark.parametrize("wrong", [_k_fastest, _one_program_per_head, _ignores_sequence])
def test_program_id_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_program_id_of(wrong)


# ---- gv_states ----

def _torch_gv(k, v, G, BT, decay_h=True, exp=torch.exp2):
    """The chunk update in PyTorch from the log2 cumsum G, with knobs that make it wrong."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    h = k.new_zeros(B, H, K, V)
    out = []
    for s in range(0, T, BT):
        e = min(s + BT, T)
        out.append(h)
        last = G[:, e - 1]  # [B, H, V]
        if decay_h:
            h = h * exp(last)[:, :, None, :]
        h = h + torch.einsum("blhk,blhv->bhkv", k[:, s:e], v[:, s:e] * exp(last[:, None] - G[:, s:e]))
    return torch.stack(out, 1)


def _right_in_torch(k, v, gv, chunk_size, BK, BV):  # sanity: the knobs' default is right
    return _torch_gv(k, v, gv, chunk_size)


def _h_not_decayed(k, v, gv, chunk_size, BK, BV):
    return _torch_gv(k, v, gv, chunk_size, decay_h=False)


def _natural_exp(k, v, gv, chunk_size, BK, BV):  # e^x of log2 values
    return _torch_gv(k, v, gv, chunk_size, exp=torch.exp)


def _ungated(k, v, gv, chunk_size, BK, BV):
    return _torch_gv(k, v, torch.zeros_like(gv), chunk_size)


def _one_tile_per_head(k, v, gv, chunk_size, BK, BV):  # grid forgets the tiles: NaN left in h
    B, T, H, K = k.shape
    V = v.shape[-1]
    h = torch.empty(B, triton.cdiv(T, chunk_size), H, K, V, dtype=torch.float32, device=k.device)
    ex.gv_states_kernel[(B * H,)](k, v, gv, h, T, H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV)
    return h


def test_torch_form_is_right():
    ex.check_gv_states(_right_in_torch)


@pytest.mark.parametrize("wrong", [_h_not_decayed, _natural_exp, _ungated, _one_tile_per_head])
def test_gv_states_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_gv_states(wrong)
