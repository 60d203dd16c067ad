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


def test_defaults_are_llama_2_s_theta_and_position_zero_is_the_identity():
    x = torch.randn(2, 3, 5, 8)
    torch.testing.assert_close(RotaryEmbedding(8)(x).double(), complex_reference(x, 0, 10_000.0), atol=2e-5, rtol=0)
    want = torch.tensor([10_000.0 ** (-c / 8) for c in range(0, 8, 2)], dtype=torch.float64)
    torch.testing.assert_close(RotaryEmbedding(8).inverse_frequencies().double(), want, rtol=1e-6, atol=0)
    first = torch.randn(1, 2, 1, 8)
    assert torch.equal(RotaryEmbedding(8)(first), first)  # a fresh table's row 0: cos 1, sin 0
    freqs = RotaryEmbedding(8, theta=0.5).inverse_frequencies()  # a base below 1 is allowed
    torch.testing.assert_close(freqs, torch.tensor([0.5 ** (-c / 8) for c in range(0, 8, 2)]))


def test_any_leading_dimensions_are_rotated():
    x = torch.randn(6, 8)  # (T, hs)
    torch.testing.assert_close(RotaryEmbedding(8)(x, 4).double(), complex_reference(x, 4, 10_000.0), atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_tables_and_rotations_are_in_the_dtype_asked_for(dtype):
    rope = RotaryEmbedding(8)
    assert {t.dtype for t in rope.cos_sin(2, 3, "cpu", dtype)} == {dtype}
    assert {t.dtype for t in rope.cos_sin_at(torch.tensor([[0, 4], [1, 2]]), dtype)} == {dtype}
    assert rope(torch.randn(1, 1, 3, 8, dtype=dtype)).dtype == dtype


def test_tables_are_made_on_the_device_of_the_call():
    rope = RotaryEmbedding(8)
    assert rope.inverse_frequencies("meta").device.type == "meta"
    cos, sin = rope.cos_sin(0, 3, "meta", torch.float32)
    assert (cos.device.type, sin.device.type, cos.shape) == ("meta", "meta", (3, 8))
    assert rope.cos_sin(0, 3, "cpu", torch.float32)[0].device.type == "cpu"  # a table per device, remade


def test_gathered_positions_grow_a_fresh_table_and_an_empty_gather_is_empty():
    cos, sin = RotaryEmbedding(4).cos_sin_at(torch.tensor([5, 2]), torch.float64)
    want = RotaryEmbedding(4).cos_sin(0, 6, "cpu", torch.float64)
    assert torch.equal(cos, want[0][[5, 2]]) and torch.equal(sin, want[1][[5, 2]])
    cos, sin = RotaryEmbedding(4).cos_sin_at(torch.tensor([], dtype=torch.long), torch.float32)
    assert cos.shape == sin.shape == (0, 4)


def test_the_table_is_computed_only_when_it_grows_and_then_doubles(monkeypatch):
    """Decoding one token at a time to position 63 computes the table 7 times (1, 2, 4, ..., 64 rows), not
    once per token; a gather asks for exactly the rows it needs, and an empty one computes nothing."""
    rope, sizes = RotaryEmbedding(4), []
    original = RotaryEmbedding.inverse_frequencies

    def counted(self, device=None):
        sizes.append(None)
        return original(self, device)

    monkeypatch.setattr(RotaryEmbedding, "inverse_frequencies", counted)
    rope.cos_sin_at(torch.tensor([], dtype=torch.long), torch.float32)
    assert sizes == []
    for t in range(64):
        rope(torch.randn(1, 1, 1, 4), start=t)
    assert len(sizes) == 7
    fresh = RotaryEmbedding(4)
    fresh.cos_sin_at(torch.tensor([3]), torch.float32)  # 4 rows
    fresh.cos_sin(0, 4, "cpu", torch.float32)  # still 4: nothing computed
    assert len(sizes) == 8
    fresh.cos_sin(0, 5, "cpu", torch.float32)  # grows to 8
    assert len(sizes) == 9
    fresh.cos_sin(0, 8, "cpu", torch.float32)
    assert len(sizes) == 9
