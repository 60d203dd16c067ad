"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer"), applied to queries and keys.

Each pair of channels of a head is rotated by an angle proportional to the token's position, so that
``q_i . k_j`` depends on the positions only through ``i - j``. The pairs are in the "rotate half" layout
of Llama and Hugging Face ``transformers``: channel ``c`` of the first half of the head is paired with
channel ``c + hs/2`` (the original RoFormer code pairs neighbours ``2c, 2c+1``), so weights copied from
or to a ``transformers`` Llama need no permutation. Pair ``c`` turns at the frequency
``theta ** (-2c / hs)``.

Positions are absolute token indices: during incremental decoding a new token at position ``p`` is
rotated by ``p`` before its key enters the cache, and cached keys are never rotated again.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """The cosines and sines of the rotary angles, computed once per device and grown on demand.

    Not an ``nn.Module`` and without buffers: it holds no parameter, and DDP broadcasts buffers before
    every forward, which deadlocks when ranks run different numbers of evaluation batches.

    Args:
        head_dim: channels per head (even).
        theta: the base of the frequencies (10,000 in Llama 2, 500,000 in Llama 3).
    """

    def __init__(self, head_dim: int, theta: float = 10_000.0):
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head dimension, got {head_dim}")
        if not theta > 0:
            raise ValueError(f"rope_theta must be positive, got {theta}")
        self.head_dim, self.theta = head_dim, float(theta)
        self._cos = self._sin = torch.empty(0, head_dim)

    def inverse_frequencies(self, device=None) -> torch.Tensor:
        """``theta ** (-2c / hs)`` for ``c = 0 .. hs/2 - 1``, fp32 ``(hs/2,)``."""
        exponents = torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
        return 1.0 / (self.theta**exponents)

    def _grow(self, n: int, device) -> None:
        if self._cos.shape[0] >= n and self._cos.device == torch.device(device):
            return
        n = max(n, 2 * self._cos.shape[0])  # amortised growth during decoding
        angles = torch.arange(n, device=device).float()[:, None] * self.inverse_frequencies(device)  # (n, hs/2)
        angles = torch.cat([angles, angles], dim=-1)  # (n, hs): both halves of a pair turn together
        self._cos, self._sin = angles.cos(), angles.sin()

    def cos_sin(self, start: int, length: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``(length, hs)`` in ``dtype``, of positions ``start .. start + length - 1``."""
        self._grow(start + length, device)
        return self._cos[start : start + length].to(dtype), self._sin[start : start + length].to(dtype)

    def cos_sin_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``(*positions.shape, hs)`` for any integer ``positions`` (>= 0), e.g. the
        positions of the keys a compressed cache kept."""
        self._grow(int(positions.max()) + 1 if positions.numel() else 0, positions.device)
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)

    def __call__(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``x`` ``(..., T, hs)`` (e.g. ``(B, nh, T, hs)``) rotated at positions ``start .. start + T - 1``."""
        return apply_rotary(x, *self.cos_sin(start, x.shape[-2], x.device, x.dtype))

    def __repr__(self) -> str:
        return f"RotaryEmbedding(head_dim={self.head_dim}, theta={self.theta:g})"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x2, x1)`` for the halves ``x1, x2`` of the last dimension: a quarter turn of each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(..., T, hs)`` by the angles whose ``cos``/``sin`` are ``(T, hs)`` (or broadcastable)."""
    return x * cos + rotate_half(x) * sin
