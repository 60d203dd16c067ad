"""The attention entry point. Models call :func:`attention` with a reweighting module; the choice
between a fused kernel and the explicit path is made here and nowhere else.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.layers import Attention as TimmAttention

from mmlight.reweighting import Reweighting, Softmax
from mmlight.reweighting.backend import Backend, check_backend, resolve_backend


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``(q_len, k_len)`` mask, True = keep, aligned bottom-right.

    Query ``i`` sits at position ``k_len - q_len + i`` and sees keys up to it, which is what
    incremental decoding with a key/value cache needs (SDPA's ``is_causal`` aligns top-left).
    """
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def key_padding_of(mask: torch.Tensor | None, batch: int, k_len: int) -> torch.Tensor | None:
    """``mask`` as a ``(B, Tk)`` key-padding mask when it is one, i.e. the same for every head and
    query: shape ``(B|1, 1, 1, Tk)`` after broadcasting's left-padding (so also ``(Tk,)``); else None."""
    if mask is None or mask.dim() > 4:
        return None
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)  # (B|1, nh|1, Tq|1, Tk|1)
    if shape[1] != 1 or shape[2] != 1 or shape[3] != k_len:
        return None
    return mask.reshape(shape[0], k_len).expand(batch, k_len)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    reweight: Reweighting,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with a swappable reweighting function.

    Three paths, chosen here and nowhere else:

    * softmax with a fixed temperature: PyTorch's fused SDPA (flash / memory-efficient kernels);
    * a function with a Triton kernel (MultiMax) on the ``triton`` backend, no dropout and at most
      a key-padding mask: the fused kernel of :func:`mmlight.kernels.multimax_attention`, which
      never materialises the ``(Tq, Tk)`` scores;
    * otherwise explicit scores, reweighted by the function on the resolved backend (with a
      general mask the ``triton`` backend still uses the row-wise kernel).

    Args:
        q: queries ``(B, nh, Tq, hs)``.
        k: keys ``(B, nh, Tk, hs)``.
        v: values ``(B, nh, Tk, hv)``.
        reweight: the reweighting module applied to the scores.
        mask: optional boolean mask broadcastable to ``(B, nh, Tq, Tk)``, True = attend.
        is_causal: also mask future keys (bottom-right aligned, see :func:`causal_mask`).
        dropout_p: dropout on the attention weights (pass 0 in eval mode).
        scale: score scale, ``hs ** -0.5`` by default.
        backend: overrides ``reweight.backend`` for this call.

    Returns:
        ``(B, nh, Tq, hv)``. A query whose keys are all masked gets a zero output, never NaN.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_len, k_len = q.shape[-2], k.shape[-2]
    observed = _OBSERVED.get(id(reweight))
    if observed is not None:
        return _observed_attention(q, k, v, reweight, mask, is_causal, dropout_p, scale, backend, *observed)
    backend = check_backend(backend or reweight.backend)
    sigma = reweight.fused_sigma()
    if reweight.sdpa_scale is None and sigma is not None and dropout_p == 0.0:
        key_padding = key_padding_of(mask, q.shape[0], k_len)
        # The fused kernel takes no empty tensors; the explicit path handles an empty batch.
        fusable = (mask is None or key_padding is not None) and q.numel() > 0 and k_len > 0
        if fusable and resolve_backend(backend, q, True, type(reweight).__name__) == "triton":
            from mmlight.kernels.attention import SUPPORTED_HEAD_DIMS, multimax_attention  # Triton, lazily

            if q.shape[-1] in SUPPORTED_HEAD_DIMS:
                return multimax_attention(q, k, v, sigma.ranges, sigma.ts, scale * sigma.scale,
                                          causal=is_causal, key_padding=key_padding)

    if is_causal and (mask is not None or q_len != k_len or reweight.sdpa_scale is None):
        causal = causal_mask(q_len, k_len, q.device)
        mask = causal if mask is None else mask & causal
        is_causal = False

    if reweight.sdpa_scale is not None:
        # Fused path (flash / memory-efficient kernels): plain softmax with a fixed temperature.
        if mask is None:
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale * reweight.sdpa_scale
            )
        # SDPA returns NaN for a query with no key: let such rows see every key, then zero them.
        has_key = mask.any(dim=-1, keepdim=True)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p, scale=scale * reweight.sdpa_scale
        )
        return y * has_key

    # Explicit path: materialise the scores and reweight them.
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    probs = reweight.compute(scores, mask, backend)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return probs @ v  # (B, nh, Tq, hv)


# ----------------------------------------------------------------------------------------------
# Observation (minimal version on branch `analysis`; the lead's version on main replaces it)


class AttentionObserver:
    """Sees every attention call of a model while active (inside :func:`observe_attention`)."""

    def edit_mask(self, site: str, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None):
        """Return the (possibly narrowed) mask; ``q`` ``(B, nh, Tq, hs)``, ``k`` ``(B, nh, Tk, hs)``,
        ``mask`` bool broadcastable to ``(B, nh, Tq, Tk)`` (True = attend, causal folded in) or None."""
        return mask

    def record(self, site: str, weights: torch.Tensor, keep: torch.Tensor | None) -> None:
        """``weights`` ``(B, nh, Tq, Tk)`` before dropout (zeros where masked); ``keep`` the mask used."""


_OBSERVED: dict[int, tuple[str, AttentionObserver]] = {}


def model_of(model_or_task: torch.nn.Module) -> torch.nn.Module:
    """The model of a task (a LightningModule with ``.model``), or the model itself."""
    inner = getattr(model_or_task, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else model_or_task


@contextmanager
def observe_attention(model: torch.nn.Module, observer: AttentionObserver):
    """Route every attention call of ``model`` (or a task's model) through the explicit path and ``observer``."""
    sites = model_of(model).attention_sites()
    for site, reweight in sites.items():
        _OBSERVED[id(reweight)] = (site, observer)
    try:
        yield observer
    finally:
        for reweight in sites.values():
            _OBSERVED.pop(id(reweight), None)


@dataclass
class RecordedAttention:
    weights: torch.Tensor
    keep: torch.Tensor | None


class _Recorder(AttentionObserver):
    def __init__(self):
        self.recording: dict[str, list[RecordedAttention]] = {}

    def record(self, site, weights, keep):
        self.recording.setdefault(site, []).append(RecordedAttention(weights.detach(), keep))


@contextmanager
def record_attention(model: torch.nn.Module):
    """Yield ``recording[site] -> [RecordedAttention(weights, keep), ...]``, one per attention call."""
    recorder = _Recorder()
    with observe_attention(model, recorder):
        yield recorder.recording


def _observed_attention(q, k, v, reweight, mask, is_causal, dropout_p, scale, backend, site, observer):
    if is_causal:
        causal = causal_mask(q.shape[-2], k.shape[-2], q.device)
        mask = causal if mask is None else mask & causal
    mask = observer.edit_mask(site, q, k, mask)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    probs = reweight.compute(scores, mask, check_backend(backend or reweight.backend))
    observer.record(site, probs, mask)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return probs @ v


class ReweightedAttention(TimmAttention):
    """timm's multi-head self-attention (same parameters, so timm weights load) routed through
    :func:`attention` with a swappable ``reweight`` module (softmax until the model sets another).

    Takes timm's ``Attention`` arguments; see :class:`timm.layers.Attention`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reweight: Reweighting = Softmax()

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            raise TypeError("ReweightedAttention takes a boolean attn_mask (True = attend)")
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, nh, N, hs) each
        q, k = self.q_norm(q), self.k_norm(k)
        x = attention(
            q, k, v, self.reweight,
            mask=attn_mask, is_causal=is_causal,
            dropout_p=self.attn_drop.p if self.training else 0.0, scale=self.scale,
        )
        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))
