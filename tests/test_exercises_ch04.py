"""Chapter 04's checkers reject wrong answers (the shipped solutions and a stub: tests/test_exercises.py)."""
import pytest
import torch

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
