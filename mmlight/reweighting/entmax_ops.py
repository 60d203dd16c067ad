"""The ``entmax`` package's maps as operators of ``torch.library``, so that a compiled network calls
them without a graph break.

The package's autograd functions define ``forward`` as a class method, which ``torch.compile``
cannot trace. Here each map is an opaque operator over the last dimension whose forward pass is
the package's function and whose backward pass is the Jacobian-vector product of alpha-entmax
(Peters et al., 2019; the alpha gradient of Correia et al., 2019), written in plain torch so that
compiled code traces it: with ``g = Y ** (2 - alpha)`` on the support (0 off it),
``dX = g * dY - g * sum(g * dY) / sum(g)``.

The package is imported when a map is first built (:func:`require_entmax`), not with mmlight: an
installation without it (a GPU node given only the wheels it needs) imports and runs everything else.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def require_entmax(function: str) -> ModuleType:
    """The ``entmax`` package, or a ``ModuleNotFoundError`` that names it and the function that needs it.

    Args:
        function: the reweighting function being built (for the message), e.g. ``"sparsemax"``.
    """
    try:
        return importlib.import_module("entmax")
    except ImportError as error:
        raise ModuleNotFoundError(
            f"{function} needs the 'entmax' package, which does not import here ({error}); "
            "install it with `pip install entmax`",
            name="entmax",
        ) from error


def _support_weighted_grad(dy: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g * dy - g * sum(g * dy) / sum(g)`` over the last dim: the gradient of the scores."""
    gdy = g * dy
    return gdy - g * (gdy.sum(-1, keepdim=True) / g.sum(-1, keepdim=True))


def _fake_like(x: torch.Tensor, *_) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("mmlight::sparsemax", mutates_args=())
def _sparsemax(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return require_entmax("sparsemax").sparsemax(x, dim=-1)


@torch.library.custom_op("mmlight::entmax15", mutates_args=())
def _entmax15(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return require_entmax("entmax15").entmax15(x, dim=-1)


@torch.library.custom_op("mmlight::entmax_bisect", mutates_args=())
def _entmax_bisect(x: torch.Tensor, alpha: torch.Tensor, n_iter: int) -> torch.Tensor:
    with torch.no_grad():
        return require_entmax("alpha_entmax").entmax_bisect(x, alpha, dim=-1, n_iter=n_iter)


for _op in (_sparsemax, _entmax15, _entmax_bisect):
    _op.register_fake(_fake_like)


def _save_output(ctx, inputs, output):
    ctx.save_for_backward(output, *inputs[1:2])  # Y, and alpha for entmax_bisect


def _sparsemax_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return _support_weighted_grad(dy, (y > 0).to(dy.dtype))


def _entmax15_grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return _support_weighted_grad(dy, y.sqrt())


def _entmax_bisect_grad(ctx, dy):
    y, alpha = ctx.saved_tensors
    support = y > 0
    g = torch.where(support, y.clamp_min(torch.finfo(y.dtype).tiny) ** (2 - alpha), 0.0)
    dx = _support_weighted_grad(dy, g)
    # d Y / d alpha (Correia et al., 2019, Prop. 1), contracted with dY over the row
    y_log_y = torch.where(support, y * y.clamp_min(torch.finfo(y.dtype).tiny).log(), 0.0)
    skewed = g / g.sum(-1, keepdim=True)
    entropy_term = y_log_y - skewed * y_log_y.sum(-1, keepdim=True)
    d_alpha = (dy * ((y - skewed) / (alpha - 1) ** 2 - entropy_term / (alpha - 1))).sum(-1, keepdim=True)
    return dx, d_alpha, None


_sparsemax.register_autograd(_sparsemax_grad, setup_context=_save_output)
_entmax15.register_autograd(_entmax15_grad, setup_context=_save_output)
_entmax_bisect.register_autograd(_entmax_bisect_grad, setup_context=_save_output)


def sparsemax(x: torch.Tensor) -> torch.Tensor:
    """Sparsemax over the last dimension of ``x`` ``(..., K)``."""
    return _sparsemax(x)


def entmax15(x: torch.Tensor) -> torch.Tensor:
    """1.5-entmax over the last dimension of ``x`` ``(..., K)``."""
    return _entmax15(x)


def entmax_bisect(x: torch.Tensor, alpha: torch.Tensor, n_iter: int) -> torch.Tensor:
    """alpha-entmax over the last dimension of ``x`` ``(..., K)`` by ``n_iter`` bisection steps.

    Args:
        x: scores ``(..., K)``.
        alpha: broadcastable to ``(..., 1)`` (e.g. per head ``(nh, 1, 1)``); its gradient is summed
            back to its own shape by autograd.
        n_iter: bisection steps.
    """
    return _entmax_bisect(x, torch.broadcast_to(alpha, (*x.shape[:-1], 1)), n_iter)
