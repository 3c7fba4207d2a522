"""Stochastic rounding of half-precision rows: unbiased, one of the two neighbours, FBGEMM's bf16
rule bit for bit, and reproducible draws."""

import pytest
import torch

from dynarec.optim.rounding import rounded_match, rounding_noise, stochastic_round

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The storage values just below and just above ``|x|`` (in magnitude), by brute force over
    every finite value of the 16-bit type."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    every = every[torch.isfinite(every)].unique()
    below = torch.stack([every[every <= v].max() if v >= 0 else every[every >= v].min() for v in x])
    above = torch.stack([every[every >= v].min() if v >= 0 else every[every <= v].max() for v in x])
    return below, above


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_is_unbiased_and_picks_a_neighbour(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(40, generator=g) * 3, torch.randn(8, generator=g) * 1e-6, torch.tensor([1.0, -2.5])])
    draws = 20000
    u = torch.rand(x.numel(), draws, generator=g)
    out = stochastic_round(x[:, None].expand(-1, draws).contiguous(), dtype, u).float()
    lo, hi = neighbours(x, dtype)
    assert ((out == lo[:, None]) | (out == hi[:, None])).all()
    spacing = (hi - lo).abs()
    # mean of 20000 two-point draws: within 5 standard deviations (<= spacing / 2 / sqrt(draws))
    assert ((out.mean(1) - x).abs() <= 5 * spacing / 2 / draws**0.5 + 1e-12).all()
    exact = torch.tensor([1.0, -2.5, 0.0])
    assert torch.equal(stochastic_round(exact, dtype, torch.full((3,), 0.999)).float(), exact)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_stay_and_the_range_saturates(dtype):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6 if dtype == torch.float16 else 3.399e38])
    out = stochastic_round(x, dtype, torch.full((4,), 0.5))
    assert out[0].isnan() and out[1] == float("inf") and out[2] == -float("inf")
    assert out[3] == torch.finfo(dtype).max


def test_bf16_rounding_is_fbgemms_rule_bit_for_bit():
    """FBGEMM adds 16 random bits r below a bf16 mantissa and truncates; with r = 65535 -
    floor(u * 65536) that is this rounding exactly, for either sign."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50000, generator=g) * 10
    u = torch.rand(50000, generator=g)
    r = 65535 - (u * 65536).floor().to(torch.int64)
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign, magnitude = bits & 0x80000000, bits & 0x7FFFFFFF
    fbgemm = (sign | ((magnitude + r) & 0x7FFF0000)) >> 16
    ours = stochastic_round(x, torch.bfloat16, u).view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(ours, fbgemm)


def test_draws_depend_on_seed_step_row_and_column_only():
    rows = torch.tensor([5, 0, 2**31 + 7, 123456789])
    a = rounding_noise(11, 3, rows, 16)
    assert a.shape == (4, 16) and (a >= 0).all() and (a < 1).all()
    torch.testing.assert_close(rounding_noise(11, 3, rows.flip(0), 16), a.flip(0), rtol=0, atol=0)
    torch.testing.assert_close(rounding_noise(11, 3, rows[2:3], 4), a[2:3, :4], rtol=0, atol=0)
    for other in (rounding_noise(12, 3, rows, 16), rounding_noise(11, 4, rows, 16)):
        assert (other != a).float().mean() > 0.99
    many = rounding_noise(0, 1, torch.arange(4096), 64)
    assert abs(float(many.mean()) - 0.5) < 0.005 and abs(float((many < 0.25).float().mean()) - 0.25) < 0.005


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounded_match_allows_a_flip_only_where_the_draw_straddles_two_close_updates(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20000, generator=g)
    noise = torch.rand(20000, generator=g)
    stored = stochastic_round(x, dtype, noise).float()
    assert rounded_match(stored, x, dtype, noise, rtol=1e-5, atol=1e-6).all()
    # an update one float32 ulp away rounds apart only where its draw sits at the threshold
    nudged = torch.nextafter(x, torch.full_like(x, float("inf")))
    other = stochastic_round(nudged, dtype, noise).float()
    assert rounded_match(other, x, dtype, noise, rtol=1e-5, atol=1e-6).all()
    # nearest rounding, or a value past the neighbours, does not match
    nearest = x.to(dtype).float()
    assert (~rounded_match(nearest, x, dtype, noise, rtol=1e-5, atol=1e-6)).float().mean() > 0.2
    assert not rounded_match(stored * 1.1 + 0.01, x, dtype, noise, rtol=1e-5, atol=1e-6).any()
