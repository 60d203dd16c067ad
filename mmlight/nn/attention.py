"""The attention entry point. Models call :func:`attention` with a reweighting module; the choice
between a fused kernel and the explicit path is made here and nowhere else.

It is also the one observation point: inside :func:`observe_attention` (or
:func:`record_attention`), every attention call of the observed model takes the explicit path and
shows its weights, and its mask, to an :class:`AttentionObserver`, with the layer's typed
:class:`~mmlight.nn.sites.AttentionSite` record. The models do not know about it, and outside the
context the fused paths are unchanged.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from timm.layers import Attention as TimmAttention
from timm.models.vision_transformer import init_weights_vit_timm

from mmlight.nn.gate import GateKind, OutputGate, output_gate
from mmlight.nn.sites import AttentionSite
from mmlight.reweighting import Reweighting, Softmax
from mmlight.reweighting.backend import Backend, check_backend, resolve_backend, run_fused


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``(q_len, k_len)`` mask, True = keep, aligned bottom-right.

    Query ``i`` sits at position ``k_len - q_len + i`` and sees keys up to it, which is what
    incremental decoding with a key/value cache needs (SDPA's ``is_causal`` aligns top-left).
    """
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Keys or values ``(B, nkv, T, hs)`` of grouped-query attention as ``(B, n_heads, T, hs)``: query head
    ``h`` reads key/value head ``h // (n_heads // nkv)`` (the grouping of Llama and ``transformers``).
    ``x`` itself when ``nkv == n_heads``."""
    B, n_kv, T, hs = x.shape
    if n_kv == n_heads:
        return x
    return x[:, :, None].expand(B, n_kv, n_heads // n_kv, T, hs).reshape(B, n_heads, T, hs)


def key_padding_of(mask: torch.Tensor | None, batch: int, k_len: int) -> torch.Tensor | None:
    """``mask`` as a ``(B, Tk)`` key-padding mask when it is one, i.e. the same for every head and
    query: shape ``(B|1, 1, 1, Tk)`` after broadcasting's left-padding (so also ``(Tk,)``); else None."""
    if mask is None or mask.dim() > 4:
        return None
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)  # (B|1, nh|1, Tq|1, Tk|1)
    if shape[1] != 1 or shape[2] != 1 or shape[3] != k_len:
        return None
    return mask.reshape(shape[0], k_len).expand(batch, k_len)


class AttentionObserver:
    """Sees every attention call of a model while :func:`observe_attention` is active.

    Override :meth:`edit_mask` to intervene (e.g. mask attention sinks, evict keys) and
    :meth:`record` to collect weights.
    """

    def edit_mask(
        self, site: AttentionSite, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The mask this call uses (default: ``mask`` unchanged).

        Args:
            site: the layer (its name, kind, stack, depth and reweighting module).
            q: queries ``(B, nh, Tq, hs)``.
            k: keys ``(B, nh, Tk, hs)``.
            mask: bool, broadcastable to ``(B, nh, Tq, Tk)``, True = attend, with the causal mask
                already folded in; None = every key.
        """
        return mask

    def record(self, site: AttentionSite, weights: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Called with each call's weights.

        Args:
            site: the layer, as for :meth:`edit_mask`.
            weights: ``(B, nh, Tq, Tk)`` reweighted probabilities before dropout, 0 where masked.
            keep: the bool mask used (broadcastable to ``weights``), or None = every key.
        """

    @contextmanager
    def attached(self, network: torch.nn.Module) -> Iterator[None]:
        """A context around the observation of ``network`` (:func:`observe_attention` enters it), for an
        observer that hooks the network itself (default: none)."""
        yield


class RecordedAttention(NamedTuple):
    """One attention call seen by :func:`record_attention`: ``weights`` ``(B, nh, Tq, Tk)`` and the
    ``keep`` mask used (broadcastable to it; None = every key)."""

    weights: torch.Tensor
    keep: torch.Tensor | None


class AttentionRecorder(AttentionObserver):
    """Keeps every call's weights, detached: ``recorder[name]`` is a list with one
    :class:`RecordedAttention` per call of the site of that name (incremental decoding calls a layer
    once per step); ``recorder.site(name)`` is its record."""

    def __init__(self):
        self.calls: dict[str, list[RecordedAttention]] = {}
        self._sites: dict[str, AttentionSite] = {}

    def record(self, site, weights, keep):
        self._sites[site.name] = site
        self.calls.setdefault(site.name, []).append(
            RecordedAttention(weights.detach(), None if keep is None else keep.detach())
        )

    def site(self, name: str) -> AttentionSite:
        """The record of a site seen under ``name``."""
        return self._sites[name]

    def __getitem__(self, site: str) -> list[RecordedAttention]:
        return self.calls[site]

    def sites(self) -> list[str]:
        """The sites seen, in the order of their first call."""
        return list(self.calls)


# (id of a reweighting module -> its site, observer) while observe_attention is active.
_OBSERVED: contextvars.ContextVar[tuple[dict[int, AttentionSite], AttentionObserver] | None] = contextvars.ContextVar(
    "mmlight_observed_attention", default=None
)


def attention_observed() -> bool:
    """Whether an :func:`observe_attention` context is active (compiled networks then run eagerly)."""
    return _OBSERVED.get() is not None


def network_of(module: torch.nn.Module) -> torch.nn.Module:
    """The network that names its reweighting sites (``attention_sites()``/``reweighting_sites()``):
    ``module`` itself, or the ``.model`` of a task."""
    for candidate in (module, getattr(module, "model", None)):
        if candidate is not None and hasattr(candidate, "attention_sites"):
            return candidate
    raise TypeError(f"{type(module).__name__} names no attention sites (no attention_sites() on it or its .model)")


@contextmanager
def observe_attention(model: torch.nn.Module, observer: AttentionObserver) -> Iterator[AttentionObserver]:
    """Route every attention call of ``model`` through the explicit path and ``observer``.

    Args:
        model: a model with ``attention_sites()``, or a task holding one as ``.model``.
        observer: sees each call's mask (and may narrow it) and weights.
    """
    network = network_of(model)
    sites = {id(site.module): site for site in network.attention_sites().values()}
    with observer.attached(network):
        token = _OBSERVED.set((sites, observer))
        try:
            yield observer
        finally:
            _OBSERVED.reset(token)


@contextmanager
def record_attention(model: torch.nn.Module) -> Iterator[AttentionRecorder]:
    """Record the weights of every attention layer of ``model`` by site name::

    with record_attention(model) as rec:
        model(x)
    weights, keep = rec["blocks.3"][0]   # (B, nh, N, N)
    """
    with observe_attention(model, AttentionRecorder()) as recorder:
        yield recorder


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

    * softmax with a fixed temperature: PyTorch's fused SDPA (flash / memory-efficient kernels); also
      softmax of the scores times a per-query factor (Scalable-Softmax), as SDPA on scaled queries;
    * a function whose :meth:`~mmlight.reweighting.Reweighting.fused` operations include attention
      for these inputs (MultiMax), on the ``triton`` backend, no dropout and at most a key-padding
      mask: a fused kernel that never materialises the ``(Tq, Tk)`` scores;
    * otherwise explicit scores, reweighted by the function on the resolved backend (with a
      general mask the ``triton`` backend still uses the row-wise kernel).

    Args:
        q: queries ``(B, nh, Tq, hs)``.
        k: keys ``(B, nkv, Tk, hs)``; ``nkv`` divides ``nh`` (grouped-query attention when smaller: query
            head ``h`` reads key head ``h // (nh // nkv)``, see :func:`repeat_kv`).
        v: values ``(B, nkv, Tk, hv)``.
        reweight: the reweighting module applied to the scores.
        mask: optional boolean mask broadcastable to ``(B, nh, Tq, Tk)``, True = attend.
        is_causal: also mask future keys (bottom-right aligned, see :func:`causal_mask`); required by
            a causal-only function (stick-breaking).
        dropout_p: dropout on the attention weights (pass 0 in eval mode).
        scale: score scale, ``hs ** -0.5`` by default.
        backend: overrides ``reweight.backend`` for this call.

    Returns:
        ``(B, nh, Tq, hv)``. A query whose keys are all masked, or that has no key (``Tk = 0``), gets a zero
        output, never NaN.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_len, k_len = q.shape[-2], k.shape[-2]
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"key/value heads must be equal and divide the query heads, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    backend = check_backend(backend or reweight.backend)
    if reweight.causal_only and not is_causal:
        raise ValueError(
            f"{type(reweight).__name__} weighs keys by their position before the query and needs is_causal=True"
        )
    # a compiled network is never observed (its compiled calls run eagerly while observation is on), and
    # torch 2.9's Dynamo cannot trace ContextVar.get
    observed = None if torch.compiler.is_compiling() else _OBSERVED.get()
    if observed is not None and id(reweight) in observed[0]:
        site, observer = observed[0][id(reweight)], observed[1]
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # observers see one key per query head
        return _observed_attention(site, observer, q, k, v, reweight, mask, is_causal, dropout_p, scale, backend)

    fused = reweight.fused()
    if reweight.sdpa_scale is None and fused is not None and dropout_p == 0.0:
        key_padding = key_padding_of(mask, q.shape[0], k_len)
        # Fused kernels take no empty tensors; the explicit path handles an empty batch.
        fusable = (mask is None or key_padding is not None) and q.numel() > 0 and k_len > 0
        if fusable and resolve_backend(backend, q, True, type(reweight).__name__) == "triton":
            y = run_fused(
                backend,
                f"{type(reweight).__name__} attention",
                fused.attention,
                # the explicit path on the compile backend, if the kernel cannot run here
                lambda *_: attention(q, k, v, reweight, mask, is_causal, dropout_p, scale, "compile"),
                q,
                k,
                v,
                scale,
                is_causal,
                key_padding,
            )
            if y is not None:
                return y

    # the fused kernel above reads each key head once for its group; SDPA takes grouped keys too
    # (enable_gqa); the explicit path needs one key per query head
    softmax_of_scaled = reweight.sdpa_scale is not None or reweight.scales_queries
    if is_causal and (mask is not None or q_len != k_len or not softmax_of_scaled):
        mask = with_causal(mask, q_len, k_len, q.device)
        is_causal = False

    if reweight.sdpa_scale is not None:
        # Fused path (flash / memory-efficient kernels): plain softmax with a fixed temperature.
        return _sdpa(q, k, v, mask, is_causal, dropout_p, scale * reweight.sdpa_scale)
    if reweight.scales_queries:
        # softmax(c_i * s_ij) for a factor c_i per query row (Scalable-Softmax): SDPA on queries c_i * q_i.
        q_scale = reweight.query_scale(keys_seen(mask, is_causal, q_len, k_len, q.device))  # (B|1, nh|1, Tq, 1)
        return _sdpa(q * q_scale.to(q.dtype), k, v, mask, is_causal, dropout_p, scale)

    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # (B, nh, Tk, hs)
    probs = explicit_weights(q, k, reweight, mask, scale, backend)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return probs @ v  # (B, nh, Tq, hv)


def _sdpa(q, k, v, mask, is_causal, dropout_p, scale) -> torch.Tensor:
    """PyTorch's fused SDPA (grouped keys/values allowed), with a zero output (not NaN) for a query that
    sees no key."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}  # the plain call otherwise
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa)
    # SDPA returns NaN for a query with no key: let such rows see every key, then zero them.
    has_key = mask.any(dim=-1, keepdim=True)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key, dropout_p=dropout_p, scale=scale, **gqa)
    return y * has_key


def keys_seen(mask: torch.Tensor | None, is_causal: bool, q_len: int, k_len: int, device) -> torch.Tensor:
    """How many keys each query attends to, ``(B|1, nh|1, Tq, 1)`` (4-D whatever the mask's rank).

    Args:
        mask: bool, broadcastable to ``(B, nh, Tq, Tk)``, with any causal mask folded in; None = all.
        is_causal: (with ``mask`` None) SDPA's top-left causal mask, query ``i`` seeing ``i + 1`` keys.
    """
    if mask is not None:
        counts = mask.sum(dim=-1, keepdim=True)
        counts = counts.reshape((1,) * (4 - counts.dim()) + tuple(counts.shape))
        return counts.expand(*counts.shape[:2], q_len, 1)
    if is_causal:
        return torch.arange(1, q_len + 1, device=device).view(1, 1, q_len, 1)
    return torch.full((1, 1, q_len, 1), k_len, device=device)


def with_causal(mask: torch.Tensor | None, q_len: int, k_len: int, device) -> torch.Tensor:
    """``mask`` (or every key) narrowed to the causal mask of :func:`causal_mask`."""
    causal = causal_mask(q_len, k_len, device)
    return causal if mask is None else mask & causal


def explicit_weights(q, k, reweight, mask, scale, backend) -> torch.Tensor:
    """The attention weights ``(B, nh, Tq, Tk)``, materialised: scores, then the reweighting."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if scores.shape[-1] == 0:  # no key to weigh (the functions reduce over keys); the output is then zero
        return scores
    return reweight.compute(scores, mask, backend)


def _observed_attention(site, observer, q, k, v, reweight, mask, is_causal, dropout_p, scale, backend):
    """The explicit path, with the observer's mask and a record of the weights."""
    if is_causal:
        mask = with_causal(mask, q.shape[-2], k.shape[-2], q.device)
    mask = observer.edit_mask(site, q, k, mask)
    probs = explicit_weights(q, k, reweight, mask, scale, backend)  # (B, nh, Tq, Tk)
    observer.record(site, probs, mask)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return probs @ v  # (B, nh, Tq, hv)


class ReweightedAttention(TimmAttention):
    """timm's multi-head self-attention (same parameters, so timm weights load) routed through
    :func:`attention` with a swappable ``reweight`` module (softmax until the model sets another), and
    an optional output gate (:mod:`mmlight.nn.gate`).

    Takes timm's ``Attention`` arguments; see :class:`timm.layers.Attention`. No gate until
    :meth:`set_gate` adds one.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reweight: Reweighting = Softmax()
        # mmlight's gate is ``out_gate``: ``gate`` is timm's own (``gated=True``: after the norm, per channel)
        self.out_gate: OutputGate | None = None

    def set_gate(self, kind: GateKind) -> None:
        """Gate each head's output by the layer's input (:mod:`mmlight.nn.gate`): ``none``, ``headwise``
        or ``elementwise``. The gate is initialised as timm initialises the ``qkv`` projection (truncated
        normal, std 0.02, zero bias; a bias when ``qkv`` has one), the query projection's init as in the
        paper's released code."""
        self.out_gate = output_gate(
            kind, self.qkv.in_features, self.num_heads, self.head_dim, self.qkv.bias is not None
        )
        if self.out_gate is not None:
            init_weights_vit_timm(self.out_gate)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            raise TypeError("ReweightedAttention takes a boolean attn_mask (True = attend)")
        B, N, C = x.shape
        gate = self.out_gate(x) if self.out_gate is not None else None  # (B, nh, N, 1|hs)
        timm_gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None  # (B, N, C)
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, nh, N, hs) each
        q, k = self.q_norm(q), self.k_norm(k)
        y = attention(
            q,
            k,
            v,
            self.reweight,
            mask=attn_mask,
            is_causal=is_causal,
            dropout_p=self.attn_drop.p if self.training else 0.0,
            scale=self.scale,
        )  # (B, nh, N, hs)
        if gate is not None:
            y = y * gate
        x = y.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if timm_gate is not None:
            x = x * timm_gate
        return self.proj_drop(self.proj(x))
