"""Chapter 04's checkers reject wrong answers (the shipped solutions and a stub: tests/test_exercises.py)."""
import warnings

import pytest
import torch
import triton
import triton.language as tl

from chunkstate.exercises import ch04_first_kernel as ex


# ---- token_offset ----

def _head_first(b, t, i_h, d, T, H, D):  # the [B, H, T, D] layout
    return ((b * H + i_h) * T + t) * D + d


def _forgets_heads(b, t, i_h, d, T, H, D):  # token stride D instead of H·D
    return (b * T + t) * D + i_h * D + d


def _forgets_batch(b, t, i_h, d, T, H, D):
    return (t * H + i_h) * D + d


@pytest.mark.parametrize("wrong", [_head_first, _forgets_heads, _forgets_batch])
def test_offset_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_token_offset(wrong)


# ---- final_state ----

def _last_full_chunk_only(k, v, chunk_size):  # drops the ragged last chunk
    T = k.shape[1]
    return ex.final_state(k[:, : T - T % chunk_size] if T % chunk_size else k,
                          v[:, : T - T % chunk_size] if T % chunk_size else v, chunk_size)


def _first_head_only(k, v, chunk_size):  # grid of B programs: heads >= 1 never written (NaN)
    B, T, H, K = k.shape
    V = v.shape[-1]
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    ex.final_state_kernel[(B,)](k, v, ht, T, H=H, K=K, V=V, BT=chunk_size)
    return ht


def _transposed(k, v, chunk_size):  # [B, H, V, K]
    return ex.final_state(k, v, chunk_size).transpose(-1, -2).contiguous()


def _not_a_tensor(k, v, chunk_size):
    return ex.final_state(k, v, chunk_size), None


@pytest.mark.parametrize("wrong", [_last_full_chunk_only, _first_head_only, _transposed, _not_a_tensor])
def test_final_state_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_final_state(wrong)


@triton.jit
def _unmasked_kernel(k, v, ht, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """The shipped kernel without the masks on the ragged last chunk: it reads past the sequence."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_t, o_k, o_v = tl.arange(0, BT), tl.arange(0, K), tl.arange(0, V)
    p_k0 = k + (i_b * T * H + i_h) * K
    p_v0 = v + (i_b * T * H + i_h) * V
    b_h = tl.zeros([K, V], dtype=tl.float32)
    for i_t in range(0, tl.cdiv(T, BT)):
        rows = tl.cast(i_t, tl.int64) * BT + o_t
        b_k = tl.load(p_k0 + rows[None, :] * (H * K) + o_k[:, None])  # no mask
        b_v = tl.load(p_v0 + rows[:, None] * (H * V) + o_v[None, :])  # no mask
        b_h = tl.dot(b_k, b_v, b_h)
    tl.store(ht + i_bh * K * V + o_k[:, None] * V + o_v[None, :], b_h)


def _unmasked(k, v, chunk_size):
    B, T, H, K = k.shape
    V = v.shape[-1]
    ht = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device)
    _unmasked_kernel[(B * H,)](k, v, ht, T, H=H, K=K, V=V, BT=chunk_size)
    return ht


def test_final_state_unmasked_last_chunk_named():
    """Without masks the last chunk reads past the sequence: the message says so (not 'never
    written?'), and no numpy overflow warning leaks out of the interpreter."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(AssertionError, match="reads past the end of the sequence") as e:
            ex.check_final_state(_unmasked)
    assert "mask the loads of the last, ragged chunk" in str(e.value).lower()
    assert "never written" not in str(e.value)
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in seen]


def test_final_state_unwritten_heads_still_named():
    """A grid of too few programs leaves NaN that no input memory explains: 'never written?'."""
    with pytest.raises(AssertionError, match="never written"):
        ex.check_final_state(_first_head_only)
