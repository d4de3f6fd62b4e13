"""Chapter 09's checkers reject wrong answers (the shipped solutions and a stub: tests/test_exercises.py)."""
import pytest
import torch
import triton

from chunkstate.exercises import ch09_backward_kernel as ex


# ---- store_slot ----

def _fla_0_6_0(i_t, NT, cps):  # the forward's rule: the split's first chunk (fla-core 0.6.0's backward)
    return i_t // cps if i_t % cps == 0 else None


def _forgets_ragged_end(i_t, NT, cps):  # a short last split never stores
    return i_t // cps if i_t % cps == cps - 1 else None


def _every_chunk(i_t, NT, cps):  # stores every chunk, slot counted in chunks
    return i_t


def _slot_off_by_one(i_t, NT, cps):
    s = ex.store_slot(i_t, NT, cps)
    return None if s is None else s + 1


@pytest.mark.parametrize("wrong", [_fla_0_6_0, _forgets_ragged_end, _every_chunk, _slot_off_by_one])
def test_store_slot_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_store_slot(wrong)


# ---- gv_dh ----

def _torch_gv_dh(q, do, Gv, scale, BT, decay=True, exp=torch.exp2, weight="Gv", store_after=False):
    """The backward scan in PyTorch from the value gate's log2 cumsum Gv, with knobs that make it wrong."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    dh = q.new_zeros(B, H, K, V)
    out = []
    for s in reversed(range(0, T, BT)):
        e = min(s + BT, T)
        if not store_after:
            out.append(dh)
        last = Gv[:, e - 1]  # [B, H, V]: Γ_v
        if decay:
            dh = dh * exp(last)[:, :, None, :]
        w = exp(Gv[:, s:e]) if weight == "Gv" else exp(last[:, None] - Gv[:, s:e])
        dh = dh + scale * torch.einsum("blhk,blhv->bhkv", q[:, s:e], do[:, s:e] * w)
        if store_after:
            out.append(dh)
    return torch.stack(out[::-1], 1)


def _right_in_torch(q, do, gv, scale, chunk_size, BK, BV):  # sanity: the knobs' defaults are right
    return _torch_gv_dh(q, do, gv, scale, chunk_size)


def _not_decayed(q, do, gv, scale, chunk_size, BK, BV):
    return _torch_gv_dh(q, do, gv, scale, chunk_size, decay=False)


def _natural_exp(q, do, gv, scale, chunk_size, BK, BV):  # e^x of log2 values
    return _torch_gv_dh(q, do, gv, scale, chunk_size, exp=torch.exp)


def _forward_weights(q, do, gv, scale, chunk_size, BK, BV):  # 2^{Γ_v−G_v} (the forward's) instead of 2^{G_v}
    return _torch_gv_dh(q, do, gv, scale, chunk_size, weight="Gamma_v-Gv")


def _unscaled(q, do, gv, scale, chunk_size, BK, BV):
    return _torch_gv_dh(q, do, gv, 1.0, chunk_size)


def _stored_after_update(q, do, gv, scale, chunk_size, BK, BV):  # counts the chunk's own outputs too
    return _torch_gv_dh(q, do, gv, scale, chunk_size, store_after=True)


def _one_tile_per_head(q, do, gv, scale, chunk_size, BK, BV):  # grid forgets the tiles: NaN left in dh
    B, T, H, K = q.shape
    V = do.shape[-1]
    dh = torch.empty(B, triton.cdiv(T, chunk_size), H, K, V, dtype=torch.float32, device=q.device)
    ex.gv_dh_kernel[(B * H,)](q, do, gv, dh, float(scale), T, H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV)
    return dh


def test_torch_form_is_right():
    ex.check_gv_dh(_right_in_torch)


@pytest.mark.parametrize("wrong", [_not_decayed, _natural_exp, _forward_weights, _unscaled,
                                   _stored_after_update, _one_tile_per_head])
def test_gv_dh_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_gv_dh(wrong)
