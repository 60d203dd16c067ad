"""The backward kernels recompute every attention score bit for bit as the forward computed it.

``p = exp(sigma(x) - m) / l`` is rebuilt in backward from the forward's row max ``m`` and sum ``l``;
a score that comes out one ulp off scales its weight by ``exp(sigma'(x) * ulp)``, uncorrected by any
renormalisation, and sigma' of trained second-order MultiMax reaches 10-30. The forward, the dQ
kernel and the (transposed) dK/dV kernel compute scores on tiles of different shapes, so this pins
that ``_scores`` gives each score independently of the tile's shape and orientation: under the
interpreter (CPU) and, where a GPU is present, compiled.
"""

import pytest
import torch
import triton
import triton.language as tl

from mmlight.kernels.attention import FP32_DOT_PRECISION, _scores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _score_tile_kernel(
    A,
    B,
    OUT,
    scale,
    R: tl.constexpr,
    C: tl.constexpr,
    D: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """OUT (R, C) = scale * A (R, D) @ B (C, D)^T, directly or as the transpose of B @ A^T."""
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    offs_d = tl.arange(0, D)
    a = tl.load(A + rows[:, None] * D + offs_d[None, :])
    b = tl.load(B + cols[:, None] * D + offs_d[None, :])
    if TRANSPOSED:
        x = tl.trans(_scores(b, a, scale, DOT_PRECISION))
    else:
        x = _scores(a, b, scale, DOT_PRECISION)
    tl.store(OUT + rows[:, None] * C + cols[None, :], x)


def score_tile(q: torch.Tensor, k: torch.Tensor, transposed: bool) -> torch.Tensor:
    out = torch.empty(q.shape[0], k.shape[0], dtype=torch.float32, device=q.device)
    _score_tile_kernel[(1,)](
        q,
        k,
        out,
        q.shape[1] ** -0.5,
        R=q.shape[0],
        C=k.shape[0],
        D=q.shape[1],
        TRANSPOSED=transposed,
        DOT_PRECISION=FP32_DOT_PRECISION,
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_scores_do_not_depend_on_tile_shape_or_orientation(dtype, head_dim):
    gen = torch.Generator().manual_seed(0)
    q = (3.0 * torch.randn(128, head_dim, generator=gen)).to(DEVICE, dtype)
    k = torch.randn(64, head_dim, generator=gen).to(DEVICE, dtype)
    forward = score_tile(q, k, transposed=False)  # the forward's (128, 64) tile
    # the float64 product of the same (rounded) inputs: a check that the tile is a product at all
    exact = (q.double() @ k.double().T) * head_dim**-0.5
    assert torch.allclose(forward.double(), exact, rtol=1e-2, atol=1e-2)
    for rows, cols, transposed in [(64, 32, False), (16, 64, True), (32, 64, True)]:
        tile = score_tile(q[:rows], k[:cols], transposed)
        assert torch.equal(tile, forward[:rows, :cols]), (
            f"({rows}, {cols}) transposed={transposed}: max diff {(tile - forward[:rows, :cols]).abs().max():.3g}"
        )
