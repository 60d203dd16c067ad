"""MultiMax attention through PyTorch's FlexAttention: the peer the fused Triton kernel must beat.

``torch.nn.attention.flex_attention`` takes a ``score_mod(score, b, h, q_idx, kv_idx)`` applied to
the *scaled* score before the mask, which is MultiMax's order (sigma first, masking after), and
compiles it into a FlashAttention-style kernel. Since torch 2.14 the tensors a ``score_mod``
captures may require grad; their gradients are accumulated with atomics in the backward pass (so
they are not deterministic). Indexing one captured tensor that requires grad twice inside
``score_mod`` raises, so the 8 parameters are captured as separate 0-D tensors, split off
``ranges`` and ``ts`` outside it (still differentiable back to them).

Uncompiled, ``flex_attention`` runs a dense reference path that materialises the scores: fine for
CPU tests of the forward (its eager backward does not run on the CPU). Benchmarks compile it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: the first torch whose FlexAttention accepts captured tensors that require grad (module docstring)
LEARNABLE_CAPTURES_TORCH = "2.14.0a0"


def require_learnable_captures() -> None:
    """Raise, naming the torch needed, where FlexAttention cannot train captured parameters; the rest of
    mmlight runs on older torch (pyproject.toml's floor)."""
    if torch.__version__ < LEARNABLE_CAPTURES_TORCH:
        raise RuntimeError(
            "FlexAttention with learnable captured parameters (MultiMax's ranges and ts requiring grad) needs "
            f"torch >= 2.14; this is torch {torch.__version__}. Use the package's attention (mmlight.nn) "
            "or call this under torch.no_grad()."
        )


def multimax_score_mod(ranges: torch.Tensor, ts: torch.Tensor, frozen: bool = False) -> Callable:
    """A ``score_mod`` computing MultiMax's sigma of the scaled score.

    Args:
        ranges: ``(2,)`` (first order) or ``(4,)`` (second order), see
            :func:`mmlight.reweighting.multimax.multimax_sigma`.
        ts: same shape as ``ranges``.
        frozen: capture the parameters detached (no gradient):
            the forward that any torch's FlexAttention runs (before 2.14 it cannot differentiate
            captured tensors).
    """
    if ranges.shape != ts.shape or ranges.shape not in ((2,), (4,)):
        raise ValueError(
            f"ranges and ts must both have shape (2,) or (4,), got {tuple(ranges.shape)} and {tuple(ts.shape)}"
        )
    if frozen:  # detached 0-D tensors: no gradient to take (Python floats become SymFloats, refused by torch 2.15)
        ranges, ts = ranges.detach(), ts.detach()
    r0, r1, *r_quadratic = ranges.unbind(0)  # separate 0-D tensors (see the module docstring)
    t0, t1, *t_quadratic = ts.unbind(0)

    def first_order(score, b, h, q_idx, kv_idx):
        return score + t0 * torch.relu(r0 - score) + t1 * torch.relu(score - r1)

    if not r_quadratic:
        return first_order
    r2, r3 = r_quadratic
    t2, t3 = t_quadratic

    def second_order(score, b, h, q_idx, kv_idx):
        low, high = torch.relu(r2 - score), torch.relu(score - r3)
        return first_order(score, b, h, q_idx, kv_idx) + t2 * low * low + t3 * high * high

    return second_order


def causal_block_mask(q_len: int, k_len: int, device: torch.device | str, compile_mask: bool = False):
    """FlexAttention block mask of :func:`mmlight.nn.attention.causal_mask` (bottom-right aligned).

    Args:
        q_len: queries.
        k_len: keys.
        device: where the mask lives.
        compile_mask: build it with ``torch.compile`` (about 10x faster on a GPU; not on the CPU).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    offset = k_len - q_len

    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    return create_block_mask(causal, B=None, H=None, Q_LEN=q_len, KV_LEN=k_len, device=device, _compile=compile_mask)


def flex_multimax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: torch.Tensor,
    ts: torch.Tensor,
    scale: float | None = None,
    block_mask=None,
    flex: Callable | None = None,
    frozen: bool = False,
) -> torch.Tensor:
    """``softmax(sigma(scale * q k^T) masked) v`` with FlexAttention.

    Args:
        q: ``(B, H, Tq, D)``.
        k: ``(B, H, Tk, D)``.
        v: ``(B, H, Tk, D)``.
        ranges: MultiMax ``ranges``.
        ts: MultiMax ``ts``.
        scale: score scale, ``D ** -0.5`` by default.
        block_mask: from :func:`causal_block_mask` (or any FlexAttention block mask); None = no mask.
        flex: the ``flex_attention`` to call, e.g. ``torch.compile(flex_attention)`` (the default,
            uncompiled, materialises the scores).
        frozen: sigma's parameters as constants (:func:`multimax_score_mod`): gradients reach q, k
            and v only.
    """
    if not frozen and torch.is_grad_enabled() and (ranges.requires_grad or ts.requires_grad):
        require_learnable_captures()
    if flex is None:
        from torch.nn.attention.flex_attention import flex_attention as flex
    score_mod = multimax_score_mod(ranges, ts, frozen)
    return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
