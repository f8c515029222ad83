"""Positional noise: a function of (seed, layer, position) only, and Gaussian."""

import torch

from snac_server.noise import positional_gaussian


def _noise(seed: int, start: int, length: int, layer: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + length, dtype=torch.int64)[None]
    return positional_gaussian(torch.tensor([seed]), layer, positions)[0]


def test_same_positions_give_same_noise_however_split():
    whole = _noise(7, 0, 1000)
    parts = torch.cat([_noise(7, 0, 300), _noise(7, 300, 700)])
    assert torch.equal(whole, parts)


def test_seed_and_layer_change_the_noise():
    base = _noise(7, 0, 1000)
    assert not torch.allclose(base, _noise(8, 0, 1000))
    assert not torch.allclose(base, _noise(7, 0, 1000, layer=1))


def test_noise_is_standard_normal():
    z = _noise(123, 10_000, 200_000)
    assert abs(z.mean().item()) < 0.01
    assert abs(z.std().item() - 1.0) < 0.01
    assert torch.isfinite(z).all()
    # Neighbouring samples are independent: lag-1 correlation near zero.
    assert abs(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1].item()) < 0.01
