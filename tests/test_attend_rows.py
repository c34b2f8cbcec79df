"""A row's attention in C (app.attend_rows) against PyTorch's kernels, which every bigger row still takes."""

from __future__ import annotations

import pytest
import torch

from app import native
from app.attend_rows import WORK_IN_C, attend_row
from app.ragged import _attend, _attend_lse, _merge, causal_mask

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler here (PyTorch's kernel runs)")


def _row(n: int, length: int, heads: int, groups: int, seed: int, dim: int = 64):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(1, n, heads, dim, generator=gen).transpose(1, 2)  # laid out as the ragged pass has it
    keys, values = (torch.randn(1, groups, length, dim, generator=gen) for _ in range(2))
    return query, keys, values


@pytest.mark.parametrize("n,length", [(1, 1), (1, 50), (1, WORK_IN_C), (3, 40), (8, 30)])
@pytest.mark.parametrize("heads,groups", [(9, 3), (4, 4)])
def test_a_row_alone_matches_sdpa(n, length, heads, groups):
    query, keys, values = _row(n, length, heads, groups, n * length)
    got = attend_row(query, keys, values, 0.125, None)
    want = _attend(query, keys, values, causal_mask(n, length - n, None), 0.125)
    assert got.shape == want.shape and torch.allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("n,length", [(1, 1), (1, 100), (4, 60)])
def test_a_row_reading_a_shared_prefix_matches_the_cascade_merge(n, length):
    query, keys, values = _row(n, length, 9, 3, 100 + n)
    gen = torch.Generator().manual_seed(n)
    head = torch.randn(1, 9, n, 64, generator=gen), torch.randn(1, 9, n, generator=gen) * 3
    got = attend_row(query, keys, values, 0.125, head)
    want = _merge(*head, *_attend_lse(query, keys, values, causal_mask(n, length - n, 3), 0.125))
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)


def test_rows_past_the_work_limit_go_to_pytorch():
    assert attend_row(*_row(1, WORK_IN_C + 1, 9, 3, 1), 0.125, None) is None
    assert attend_row(*_row(2, WORK_IN_C // 2 + 1, 9, 3, 2), 0.125, None) is None


def test_a_query_gets_the_same_bits_wherever_its_tensor_lies():
    """The ragged pass hands C a slice of the step's queries: the offset and the neighbours change nothing."""
    query, keys, values = _row(1, 80, 9, 3, 5)
    alone = attend_row(query, keys, values, 0.125, None)
    step = torch.cat([torch.randn(1, 9, 5, 64), query, torch.randn(1, 9, 2, 64)], dim=2)
    assert torch.equal(attend_row(step[:, :, 5:6], keys, values, 0.125, None), alone)


def test_without_the_library_pytorch_runs(monkeypatch):
    monkeypatch.setenv("TEXTENV_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert attend_row(*_row(1, 10, 9, 3, 3), 0.125, None) is None
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
