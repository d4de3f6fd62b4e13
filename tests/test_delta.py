"""``chunkstate.delta`` (chapter 12): the delta rule's chunked form against its token loop.

Float64 both sides, so they agree to rounding (1e-12): odd shapes (T = 1, 63, 100; K, V not
powers of two; chunk sizes 16, 32, 64 with a ragged last chunk), with and without h0; ``beta = 0``
leaves the state alone; and ``chunk_fwd_h`` fed the chunked form's ``v_new`` gives the delta
rule's states (fp32 kernel: 1e-5 under the interpreter, tf32 on a GPU: 5e-3).
"""
import pytest
import torch
import torch.nn.functional as F

import chunkstate
from chunkstate import delta
from chunkstate.testing import check_close, state_tolerance


def _inputs(B, T, H, K, V, h0=True, device="cpu"):
    q = torch.randn(B, T, H, K, dtype=torch.float64, device=device)
    k = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64, device=device), dim=-1)
    v = torch.randn(B, T, H, V, dtype=torch.float64, device=device)
    beta = torch.sigmoid(torch.randn(B, T, H, dtype=torch.float64, device=device))
    s0 = torch.randn(B, H, K, V, dtype=torch.float64, device=device) if h0 else None
    return q, k, v, beta, s0


@pytest.mark.parametrize("B,T,H,K,V,BT", [(2, 100, 3, 12, 20, 32), (1, 1, 1, 5, 7, 16), (1, 63, 2, 16, 16, 64),
                                           (2, 64, 1, 8, 3, 16), (1, 130, 2, 33, 9, 64)])
@pytest.mark.parametrize("h0,scale", [(True, None), (False, 0.3)], ids=["h0", "no-h0-scale0.3"])
def test_chunked_equals_loop(B, T, H, K, V, BT, h0, scale):
    q, k, v, beta, s0 = _inputs(B, T, H, K, V, h0)
    o, h, ht = delta.recurrent_delta(q, k, v, beta, s0, scale=scale, chunk_size=BT)
    o2, h2, ht2, v_new = delta.chunked_delta(q, k, v, beta, s0, scale=scale, chunk_size=BT)
    for name, got, ref in (("o", o2, o), ("h", h2, h), ("ht", ht2, ht)):
        check_close(got, ref, f"chunked {name} vs the loop", 1e-12)
    assert v_new.shape == v.shape


def test_zero_beta_writes_nothing():
    q, k, v, beta, s0 = _inputs(1, 40, 2, 6, 5)
    _, h, ht = delta.recurrent_delta(q, k, v, torch.zeros_like(beta), s0, chunk_size=16)
    assert torch.equal(ht, s0) and all(torch.equal(h[:, n], s0) for n in range(h.shape[1]))


def test_one_full_write_stores_the_value():
    """beta = 1 and a unit key: afterwards the state maps that key to exactly its value."""
    q, k, v, _, s0 = _inputs(1, 1, 1, 8, 4)
    _, _, ht = delta.recurrent_delta(q, k, v, torch.ones(1, 1, 1, dtype=torch.float64), s0)
    check_close(torch.einsum("bhkv,bhk->bhv", ht, k[:, 0]), v[:, 0], "S^T k after a full write", 1e-12)


def test_ut_transform_solves_the_chunk_system():
    """(I + tril(diag(β) K Kᵀ, −1)) T = diag(β), T lower triangular, on batched chunks."""
    k = F.normalize(torch.randn(3, 2, 16, 8, dtype=torch.float64), dim=-1)
    beta = torch.rand(3, 2, 16, dtype=torch.float64)
    T = delta.ut_transform(k, beta)
    A = torch.tril(beta[..., :, None] * (k @ k.transpose(-1, -2)), -1)
    check_close((torch.eye(16, dtype=torch.float64) + A) @ T, torch.diag_embed(beta), "the system", 1e-12)
    assert torch.equal(T, torch.tril(T))


@pytest.mark.parametrize("BT", [16, 64])
def test_chunk_fwd_h_with_v_new_gives_the_delta_states(BT, device):
    q, k, v, beta, s0 = _inputs(2, 100, 2, 32, 24)
    _, h, ht, v_new = delta.chunked_delta(q, k, v, beta, s0, chunk_size=BT)
    hk, htk = chunkstate.chunk_fwd_h(k.float().to(device), v_new.float().to(device), h0=s0.float().to(device),
                                     chunk_size=BT, output_final_state=True)
    check_close(hk, h, f"chunk_fwd_h(k, v_new) vs the delta rule's states (BT={BT})", state_tolerance(torch.float32))
    check_close(htk, ht, f"chunk_fwd_h(k, v_new) final state (BT={BT})", state_tolerance(torch.float32))


@pytest.mark.gpu
def test_gpu_matches_fla_chunk_delta_rule(fla_one_config):
    """fla-core 0.6.0's ``chunk_delta_rule`` (bf16 inputs, its own Triton kernels) against this
    module's loop on the same bf16-rounded inputs: outputs and final state, with h0 and a ragged
    last chunk. An outside anchor for the chapter's semantics (``v − Sᵀk``, β, the scale)."""
    fla_delta = pytest.importorskip("fla.ops.delta_rule")
    q, k, v, beta, s0 = _inputs(2, 300, 4, 64, 48, device="cuda")
    q, k, v, beta = (x.to(torch.bfloat16) for x in (q, k, v, beta))
    o, _, ht = delta.recurrent_delta(q, k, v, beta, s0)
    o_fla, ht_fla = fla_delta.chunk_delta_rule(q, k, v, beta, initial_state=s0.float(), output_final_state=True)
    check_close(o_fla, o, "fla's chunk_delta_rule outputs vs the loop", state_tolerance(torch.bfloat16))
    check_close(ht_fla, ht, "fla's chunk_delta_rule final state vs the loop", state_tolerance(torch.bfloat16))
