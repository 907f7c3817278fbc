"""strategies.optim.norms.square_sum: the sum of squares of a long vector, accurate whatever its length."""

import pytest
import torch

from strategies.optim.norms import CHUNK, square_sum


@pytest.mark.parametrize("n", [1, CHUNK - 1, CHUNK, 3 * CHUNK + 5, 5_000_000])
def test_square_sum_is_the_exact_sum_within_fp32_rounding(n: int) -> None:
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    exact = float(g.double().square().sum())
    got = square_sum(g)
    assert got.dtype == torch.float32 and got.shape == ()
    assert abs(float(got) - exact) <= 2e-7 * exact


def test_square_sum_carries_a_non_finite_element() -> None:
    g = torch.ones(3 * CHUNK)
    g[CHUNK + 7] = float("inf")
    assert not torch.isfinite(square_sum(g))
    g[CHUNK + 7] = float("nan")
    assert torch.isnan(square_sum(g))
