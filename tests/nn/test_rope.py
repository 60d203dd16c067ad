"""Rotary positions (mmlight.nn.rope) against a float64 complex-number rotation, and their relative-position
property."""

import math

import pytest
import torch

from mmlight.nn.rope import RotaryEmbedding, apply_rotary


def complex_reference(x: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Pair channel ``c`` with ``c + hs/2`` as the complex number ``x_c + i x_{c+hs/2}`` and multiply it by
    ``exp(i p theta^(-2c/hs))``, in float64."""
    T, hs = x.shape[-2], x.shape[-1]
    half = hs // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())  # (..., T, hs/2)
    freq = torch.tensor([theta ** (-2 * c / hs) for c in range(half)], dtype=torch.float64)
    pos = torch.arange(start, start + T, dtype=torch.float64)
    z = z * torch.polar(torch.ones(T, half, dtype=torch.float64), pos[:, None] * freq[None, :])
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("theta, start", [(10_000.0, 0), (500_000.0, 37)])
def test_rotation_is_the_complex_rotation_of_each_half_pair(theta, start):
    x = torch.randn(2, 3, 9, 8)
    got = RotaryEmbedding(8, theta)(x, start)
    torch.testing.assert_close(got.double(), complex_reference(x, start, theta), atol=2e-5, rtol=0)
    assert got.dtype == x.dtype


def test_scores_depend_on_positions_only_through_their_difference():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)
    scores = [(rope(q, i) * rope(k, i - 3)).sum().item() for i in (3, 10, 50)]
    assert scores == pytest.approx([scores[0]] * 3, abs=1e-4)
    assert scores[0] != pytest.approx((rope(q, 3) * rope(k, 3)).sum().item(), abs=1e-3)  # a shift changes it


def test_positions_grow_past_any_first_length_and_can_be_gathered():
    rope = RotaryEmbedding(4)
    first = rope.cos_sin(0, 3, "cpu", torch.float32)[0]
    cos, sin = rope.cos_sin(100, 2, "cpu", torch.float32)  # grows the table
    assert torch.equal(rope.cos_sin(0, 3, "cpu", torch.float32)[0], first)
    gathered = rope.cos_sin_at(torch.tensor([100, 101]), torch.float32)
    assert torch.equal(gathered[0], cos) and torch.equal(gathered[1], sin)
    assert cos[1, 0].item() == pytest.approx(math.cos(101.0), abs=1e-5)  # channel 0 turns once per position
    x = torch.randn(2, 4)
    torch.testing.assert_close(apply_rotary(x, cos, sin).norm(dim=-1), x.norm(dim=-1))  # a rotation


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="even head dimension"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="rope_theta must be positive"):
        RotaryEmbedding(8, theta=0.0)
