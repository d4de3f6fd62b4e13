"""Chapter 02's checker rejects wrong answers (the shipped solution and a stub: tests/test_exercises.py)."""
import pytest
import torch

from chunkstate.exercises import ch02_gates as ex
from chunkstate.gates import RCP_LN2


def test_shipped_solution_matches_package_on_a_fresh_varlen_split():
    # The solution is an independent loop: it must agree with the package's vectorised version
    # on a case the checker does not list (a fresh varlen split).
    L = torch.randint(0, 40, (5,))
    cu = torch.cat([torch.zeros(1, dtype=torch.long), L.cumsum(0)])
    gate = torch.nn.functional.logsigmoid(torch.randn(1, int(cu[-1]), 2, 7))
    from chunkstate.gates import chunk_local_cumsum
    from chunkstate.testing import check_close
    check_close(ex.chunk_local_cumsum(gate, 8, cu), chunk_local_cumsum(gate, 8, cu), "solution vs package")


def _natural_log(gate, chunk_size, cu_seqlens=None):
    return ex.chunk_local_cumsum(gate, chunk_size, cu_seqlens) / RCP_LN2


def _global(gate, chunk_size, cu_seqlens=None):
    return ex.chunk_local_cumsum(gate, 10 ** 9, cu_seqlens)


def _exclusive(gate, chunk_size, cu_seqlens=None):
    return ex.chunk_local_cumsum(gate, chunk_size, cu_seqlens) - (RCP_LN2 * gate).float()


def _ignores_sequences(gate, chunk_size, cu_seqlens=None):
    return ex.chunk_local_cumsum(gate, chunk_size, None)


def _float64(gate, chunk_size, cu_seqlens=None):
    return ex.chunk_local_cumsum(gate, chunk_size, cu_seqlens).double()


def _off_by_one_chunks(gate, chunk_size, cu_seqlens=None):
    return ex.chunk_local_cumsum(gate, chunk_size + 1, cu_seqlens)


def _last_token_unwritten(gate, chunk_size, cu_seqlens=None):
    out = ex.chunk_local_cumsum(gate, chunk_size, cu_seqlens)
    out[:, -1] = float("nan")
    return out


def _list(gate, chunk_size, cu_seqlens=None):
    return ex.chunk_local_cumsum(gate, chunk_size, cu_seqlens).tolist()


@pytest.mark.parametrize("wrong", [_natural_log, _global, _exclusive, _ignores_sequences, _float64,
                                   _off_by_one_chunks, _last_token_unwritten, _list])
def test_wrong_answer_rejected(wrong):
    with pytest.raises(AssertionError):
        ex.check_chunk_local_cumsum(wrong)


@pytest.mark.parametrize("wrong, hint", [(_natural_log, "natural-log"), (_global, "restart"),
                                         (_exclusive, "exclusive"), (_ignores_sequences, "packed row")])
def test_near_misses_get_a_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        ex.check_chunk_local_cumsum(wrong)
