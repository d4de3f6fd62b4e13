"""Chapter 12's checker rejects wrong UT transforms (the shipped solution and a stub:
tests/test_exercises.py)."""
import pytest
import torch

from chunkstate.exercises import ch12_delta_rule as ex


def _ut(k, beta, diagonal=-1, beta_right=True, transpose=False):
    """The solution with knobs to break one thing at a time."""
    L = k.shape[0]
    A = torch.tril(beta[:, None] * (k @ k.T), diagonal=diagonal)
    rhs = torch.diag(beta) if beta_right else torch.eye(L, dtype=k.dtype)
    T = torch.linalg.solve(torch.eye(L, dtype=k.dtype) + A, rhs)
    return T.T if transpose else T


def test_knobs_at_defaults_pass():
    ex.check_ut_transform(_ut)


@pytest.mark.parametrize("knob", [{"diagonal": 0}, {"beta_right": False}, {"transpose": True}],
                         ids=["diagonal-in-tril", "no-diag-beta", "transposed"])
def test_wrong_answer_rejected(knob):
    with pytest.raises(AssertionError):
        ex.check_ut_transform(lambda k, beta: _ut(k, beta, **knob))


def test_wrong_shape_rejected():
    with pytest.raises(AssertionError, match=r"must return a tensor \[L, L\]"):
        ex.check_ut_transform(lambda k, beta: _ut(k, beta)[:, :1])


def test_float32_answer_rejected_saying_why():
    with pytest.raises(AssertionError, match="must compute in float64"):
        ex.check_ut_transform(lambda k, beta: _ut(k, beta).float())
