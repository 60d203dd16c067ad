"""KV-cache eviction: which past keys a causal decoder keeps at a budget, by named method, and what
the eviction costs in attention (the Devoto thesis, Chapter 4; kvpress's presses).

Every method scores the past keys of each query; the query keeps its own key and the ``ceil(r * n)``
of its ``n`` past keys with the highest scores (``r`` the **keep ratio**; kvpress states the
**compression ratio** ``1 - r``, the fraction dropped). Applied to each query in turn, teacher-forced
or at each step of beam search through the KV cache, this is what the query sees with the cache
compressed to that budget just before it.

Methods (:data:`METHODS`, by name):

* ``l2``: the keys of **lowest** L2 norm (Devoto et al., EMNLP 2024; kvpress ``KnormPress``);
* ``streaming``: the first 4 keys plus the most recent (StreamingLLM; ``StreamingLLMPress``);
* ``qfilters``: the keys of highest projection on the head's Q-filter (:func:`qfilters`, calibrated
  by ``mmlight analyze --kv_calibrate``; ``QFilterPress`` with the opposite sign convention);
* ``expected_attention``: the expected attention of future queries, modelled as a Gaussian, times
  ``||W_O v||`` (thesis Eqs. 4.11-4.13; ``ExpectedAttentionPress``, see :class:`ExpectedAttention`);
* ``oracle``: the keys the query itself weighs most in its full attention: no method loses less
  attention mass at the same budget (:func:`attention_loss`, thesis Eq. 4.5);
* ``random``: uniformly random keys, the floor.

A sixth method is one :class:`EvictionMethod` subclass with ``name`` set: it is then in
:data:`METHODS` and accepted by ``mmlight analyze --kv_methods``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from mmlight.nn.attention import AttentionObserver, explicit_weights, network_of

KEEP_RATIOS = (1.0, 0.9, 0.7, 0.5, 0.3, 0.1)
#: Keys at the start that ``streaming`` and ``expected_attention`` always keep (kvpress's ``n_sink``).
N_SINK = 4


def budget(n: torch.Tensor, ratio: float) -> torch.Tensor:
    """``ceil(ratio * n)`` without float noise (``0.7 * 10`` is 7.000000000000001)."""
    return torch.ceil(n.double() * ratio - 1e-9).long()


def full_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``mask`` expanded to ``(B, nh, Tq, Tk)`` (all True for None)."""
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ones(shape, dtype=torch.bool, device=q.device) if mask is None else mask.expand(shape)


def compression_ratio(keep_ratio: float) -> float:
    """kvpress's ``compression_ratio``, the fraction of keys dropped, for mmlight's keep ratio, rounded to
    12 decimals (``1 - 0.9`` is 0.09999999999999998 in floats, written 0.1)."""
    return round(1.0 - keep_ratio, 12)


# ----------------------------------------------------------------------------------------------
# Scoring functions: higher = keep. Keys ``(B, h, Tk, hs)``, ``h`` the KV heads.


def l2_scores(keys: torch.Tensor) -> torch.Tensor:
    """``-||k||`` ``(B, h, Tk)``, in at least float32: the lowest norms rank first."""
    return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32))


def streaming_scores(past: torch.Tensor, n_sink: int = N_SINK) -> torch.Tensor:
    """Scores over the keys a query may keep (``past``, bool ``(..., Tk)``): the first ``n_sink`` of
    them highest (the oldest first), then the others by recency."""
    from_start = past.long().cumsum(-1) - 1  # 0 = the oldest visible past key
    n = past.shape[-1]
    return torch.where(from_start < n_sink, 2 * n - from_start, torch.arange(n, device=past.device)).double()


def qfilter_scores(keys: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """``<k, f_h>`` ``(B, h, Tk)`` for filters ``(h, hs)`` signed so that queries project positively on
    them (:func:`qfilters`): a high projection predicts a high attention score. kvpress's
    ``QFilterPress`` scores ``-<k, f>``, i.e. takes filters of the opposite sign."""
    return torch.einsum("bhtd,hd->bht", keys.double(), filters.double().to(keys.device))


def qfilters(queries: torch.Tensor) -> torch.Tensor:
    """The Q-filter of a head from its calibration queries ``(N, hs)``: the first right singular
    vector of the (uncentred) query matrix, signed so that the mean projection of the queries on it is
    positive (Devoto thesis, Theorem 4.2.1). Returns ``(hs,)`` in float64."""
    q = queries.double()
    _, _, vh = torch.linalg.svd(q, full_matrices=False)
    f = vh[0]
    return f if float((q @ f).mean()) >= 0 else -f


def query_statistics(
    hidden: torch.Tensor, w_q: torch.Tensor, b_q: torch.Tensor | None, n_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(B, nh, hs)`` and covariance ``(B, nh, hs, hs)`` of the (pre-rotary) queries, from the
    hidden states ``(B, N, d)`` through ``W_Q`` ``(nh*hs, d)`` and its bias: the Gaussian of the
    thesis, ``mu_q = W_Q mu_h + b`` and ``Sigma_q = W_Q Sigma_h W_Q^T`` (biased covariance, as
    kvpress). In float64."""
    h = hidden.double()
    mu_h = h.mean(1)  # (B, d)
    centred = h - mu_h[:, None]
    sigma_h = centred.transpose(1, 2) @ centred / h.shape[1]  # (B, d, d)
    w = w_q.double().view(n_heads, -1, w_q.shape[1])  # (nh, hs, d)
    mu = torch.einsum("hed,bd->bhe", w, mu_h)
    if b_q is not None:
        mu = mu + b_q.double().view(n_heads, -1)
    sigma = torch.einsum("hed,bdc,hfc->bhef", w, sigma_h, w)
    return mu, sigma


def rotary_average(start: torch.Tensor | int, future: int, head_dim: int, theta: float | None) -> torch.Tensor:
    """The rotary matrix averaged over the ``future`` positions after ``start``: ``(1/T) sum_t
    R(start + 1 + t)``, in the "rotate_half" layout (dimension ``i`` paired with ``i + hs/2``, as
    Hugging Face's Llama and kvpress); ``theta`` None (additive positions) gives the identity.

    Args:
        start: the position of the last token seen, an int or a tensor ``(P,)`` of them.
        future: ``T``, the positions averaged over.
        head_dim: ``hs`` (even for rotary positions).
        theta: the rotary base, None for additive positions.

    Returns:
        ``(hs, hs)``, or ``(P, hs, hs)`` for a tensor ``start``, in float64.
    """
    starts = torch.as_tensor(start, dtype=torch.float64).reshape(-1)  # (P,)
    eye = torch.eye(head_dim, dtype=torch.float64)
    if theta is None:
        out = eye.expand(len(starts), head_dim, head_dim)
    else:
        half = head_dim // 2
        freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)  # (hs/2,)
        pos = starts[:, None] + 1 + torch.arange(future, dtype=torch.float64)  # (P, T)
        angle = pos[..., None] * freq  # (P, T, hs/2)
        cos, sin = angle.cos().mean(1), angle.sin().mean(1)  # (P, hs/2)
        out = torch.zeros(len(starts), head_dim, head_dim, dtype=torch.float64)
        i = torch.arange(half)
        out[:, i, i], out[:, i + half, i + half] = cos, cos
        out[:, i, i + half], out[:, i + half, i] = -sin, sin
    return out[0] if torch.as_tensor(start).dim() == 0 else out


def expected_logits(keys: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``log E[exp(q.k / sqrt(d))]`` for ``q ~ N(mu, Sigma)``: ``mu.k / sqrt(d) + k^T Sigma k / (2d)``.

    Args:
        keys: ``(B, nh, Tk, hs)`` (repeated to the query heads).
        mu: ``(B, nh, [Tq,] hs)``.
        sigma: ``(B, nh, [Tq,] hs, hs)``.

    Returns:
        ``(B, nh, [Tq,] Tk)`` in float64.
    """
    k = keys.double()
    d = k.shape[-1]
    if mu.dim() == 3:
        mean, quad = torch.einsum("bhe,bhte->bht", mu, k), torch.einsum("bhte,bhef,bhtf->bht", k, sigma, k)
    else:
        mean, quad = torch.einsum("bhqe,bhte->bhqt", mu, k), torch.einsum("bhte,bhqef,bhtf->bhqt", k, sigma, k)
    return mean / d**0.5 + quad / (2 * d)


def expected_attention_scores(
    logits: torch.Tensor, allowed: torch.Tensor, value_norms: torch.Tensor, n_kv_heads: int
) -> torch.Tensor:
    """The Expected Attention importance of each key for each KV head: the expected attention (the
    softmax of :func:`expected_logits` over the ``allowed`` keys) times the norm of the key's value as
    it reaches the output, averaged over the query heads of the KV group (thesis Eq. 4.11).

    Args:
        logits: ``(B, nh, [Tq,] Tk)``.
        allowed: bool, broadcastable to ``logits``: the keys the softmax runs over.
        value_norms: ``(B, nh, Tk)``: ``||W_O^h v_j||`` per query head (or ``||v_j||`` for kvpress's
            convention), broadcast over ``Tq``.
        n_kv_heads: the KV heads ``nh`` is grouped into (``nh`` without grouping).

    Returns:
        ``(B, n_kv_heads, [Tq,] Tk)`` float64.
    """
    probs = torch.where(allowed, logits, -math.inf).softmax(-1).nan_to_num(0.0)
    norms = value_norms.double() if logits.dim() == 3 else value_norms.double()[:, :, None]
    weighted = probs * norms
    return weighted.unflatten(1, (n_kv_heads, -1)).mean(2)


def out_value_norms(values: torch.Tensor, w_o: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``||W_O^h v_j||`` ``(B, nh, Tk)``: each query head's slice of the output projection ``(d,
    nh*hs)`` applied to the values ``(B, n_kv, Tk, hs)`` of its KV head."""
    v = values.double().repeat_interleave(n_heads // values.shape[1], dim=1)  # (B, nh, Tk, hs)
    w = w_o.double().view(w_o.shape[0], n_heads, -1).transpose(0, 1)  # (nh, d, hs)
    return torch.einsum("hde,bhte->bhtd", w, v).norm(dim=-1)


def attention_loss(weights: torch.Tensor, dropped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Thesis Eq. 4.5 per query row: the share of the row's attention mass on the ``dropped`` pairs,
    ``(sum, rows)``: summed over the rows with any mass, and their count (a row of zero mass, e.g.
    a sigmoid row, has no share to lose and is not counted).

    Args:
        weights: the full attention ``(B, nh, Tq, Tk)`` (no eviction).
        dropped: bool, broadcastable to ``weights``.
    """
    w = weights.double()
    total = w.sum(-1)
    counted = total > 0
    share = (w * dropped).sum(-1) / torch.where(counted, total, 1.0)
    return share[counted].sum(), counted.sum()


# ----------------------------------------------------------------------------------------------
# Methods behind one interface


@dataclass
class KVCall:
    """One decoder self-attention call, as a method scores it.

    Args:
        site: the layer.
        q: queries ``(B, nh, Tq, hs)``.
        k: keys ``(B, h, Tk, hs)``.
        keys: bool ``(B, nh, Tq, Tk)``: what each query sees without eviction.
        past: ``keys`` without each query's own key: what may be evicted.
    """

    site: object
    q: torch.Tensor
    k: torch.Tensor
    keys: torch.Tensor
    past: torch.Tensor
    _weights: torch.Tensor | None = field(default=None, repr=False)

    def weights(self) -> torch.Tensor:
        """The full attention ``(B, nh, Tq, Tk)`` with the layer's own reweighting (no eviction)."""
        if self._weights is None:
            reweight = self.site.module
            k = self.k.repeat_interleave(self.q.shape[1] // self.k.shape[1], dim=1)
            self._weights = explicit_weights(self.q, k, reweight, self.keys, self.q.shape[-1] ** -0.5, reweight.backend)
        return self._weights


METHODS: dict[str, type[EvictionMethod]] = {}


class EvictionMethod:
    """A way to rank the past keys. Subclasses set ``name`` (which registers them in :data:`METHODS`)
    and implement :meth:`scores`; :meth:`attached` may hook the network while it is observed."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            METHODS[cls.name] = cls

    def scores(self, call: KVCall) -> torch.Tensor:
        """Scores broadcastable to ``(B, nh, Tq, Tk)`` (``h`` KV heads in place of ``nh`` are
        repeated to the query heads); higher = keep."""
        raise NotImplementedError

    @contextmanager
    def attached(self, network) -> Iterator[None]:
        """A context around the observed evaluation of ``network`` (default: nothing to hook)."""
        yield


class L2Norm(EvictionMethod):
    """Keep the keys of lowest L2 norm (Devoto et al. 2024)."""

    name = "l2"

    def scores(self, call):
        return l2_scores(call.k)[:, :, None, :]


class Streaming(EvictionMethod):
    """Keep the first :data:`N_SINK` past keys and the most recent ones (StreamingLLM)."""

    name = "streaming"

    def scores(self, call):
        return streaming_scores(call.past)


class Oracle(EvictionMethod):
    """Keep the keys the query itself weighs most (its full attention): the least attention loss."""

    name = "oracle"

    def scores(self, call):
        return call.weights()


class Random(EvictionMethod):
    """Uniformly random keys (one draw per call, shared by its heads and queries), the floor.

    Args:
        seed: seed of the draws.
    """

    name = "random"

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def scores(self, call):
        B, _, _, Tk = call.keys.shape
        return torch.rand(B, 1, 1, Tk, generator=self.generator).to(call.k.device)


class QFilters(EvictionMethod):
    """Keep the keys of highest projection on their head's Q-filter.

    Args:
        filters: ``(n_layers, h, hs)``, from :func:`calibrate_qfilters` (saved by
            ``mmlight analyze --kv_calibrate``); required.
    """

    name = "qfilters"

    def __init__(self, filters: torch.Tensor | None = None):
        if filters is None:
            raise ValueError("qfilters needs calibrated filters: run `mmlight analyze --kv_calibrate N` first")
        self.filters = filters

    def scores(self, call):
        f = self.filters[call.site.layer]
        return qfilter_scores(call.k, f.repeat_interleave(call.k.shape[1] // f.shape[0], dim=0))[:, :, None, :]


def attention_parts(module) -> dict:
    """What Expected Attention reads from an attention module: ``W_Q`` (``q_proj``), ``W_O``
    (``out_proj``), ``v_proj``, the head counts, the query norm (``q_norm``, Qwen3's QK-norm, None
    without) and the **positions kind**: ``"rotary"`` with its base ``theta`` when the module rotates its
    queries and keys (mmlight's ``rope``, a :class:`~mmlight.nn.rope.RotaryEmbedding`, or a ``positions``
    attribute ``"rotary"`` with ``rope_theta``), else ``"additive"`` (positions added to the embeddings,
    or none at all: the identity rotation)."""
    n_heads = module.n_heads
    rope = getattr(module, "rope", None)
    positions = "rotary" if rope is not None else getattr(module, "positions", "additive")
    if positions not in ("additive", "rotary"):
        raise ValueError(f"{type(module).__name__}.positions must be 'additive' or 'rotary', got {positions!r}")
    theta = None
    if positions == "rotary":
        theta = float(rope.theta if rope is not None else module.rope_theta)
    return {
        "q_proj": module.q_proj,
        "q_norm": getattr(module, "q_norm", None),
        "v_proj": module.v_proj,
        "w_o": module.out_proj.weight,
        "n_heads": n_heads,
        "n_kv_heads": getattr(module, "n_kv_heads", n_heads),
        "theta": theta,
    }


class ExpectedAttention(EvictionMethod):
    """Keep the keys of highest expected attention from future queries times ``||W_O v||`` (thesis
    Eqs. 4.11-4.13).

    For the query at position ``i``, the hidden states (the layer's input) of positions
    ``n_sink .. i`` give the Gaussian of the queries through ``W_Q`` (:func:`query_statistics`); with
    rotary positions its mean and covariance are rotated by the rotary matrix averaged over the
    ``future`` positions after ``i`` (:func:`rotary_average`, the identity for additive positions).
    The first ``n_sink`` keys are always kept (kvpress's ``n_sink``). The expected attention is a
    softmax over every key a future query sees (the query's own key included, the sinks left out).

    The statistics are the mean and covariance of the queries as the layer forms them before the
    rotation. Without QK-norm these equal the thesis's ``W_Q mu_h``, ``W_Q Sigma_h W_Q^T``; with
    QK-norm (``q_norm``, applied before the rotation) the queries are no longer a linear image of the
    hidden states, and the Gaussian is moment-matched to the normed queries instead (kvpress's
    ``ExpectedAttentionPress`` does the same for Qwen3).

    Args:
        future: ``T``, the future positions the rotary matrix is averaged over (kvpress: 512).
        n_sink: leading keys kept, and left out of the statistics.
        value_norm: ``"out"``, ``||W_O^h v||`` per query head (thesis Eq. 4.11), or ``"value"``,
            ``||v||`` (kvpress's ``use_vnorm``).
    """

    name = "expected_attention"

    def __init__(self, future: int = 512, n_sink: int = N_SINK, value_norm: str = "out"):
        if value_norm not in ("out", "value"):
            raise ValueError(f"value_norm must be 'out' or 'value', got {value_norm!r}")
        self.future, self.n_sink, self.value_norm = future, n_sink, value_norm
        self._parts: dict[int, dict] = {}  # id(reweight module) -> attention_parts
        self._hidden: dict[int, torch.Tensor] = {}  # id(reweight module) -> (B, Tk, d) layer inputs
        self._keys: dict[int, torch.Tensor] = {}  # the keys of the last call, to follow beam reorders

    @contextmanager
    def attached(self, network):
        handles = []
        for module in network.modules():
            reweight = getattr(module, "reweight", None)
            if reweight is not None and hasattr(module, "q_proj") and not getattr(module, "cross", False):
                self._parts[id(reweight)] = attention_parts(module)
                handles.append(module.register_forward_pre_hook(self._hook(id(reweight)), with_kwargs=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._hidden.clear()
            self._keys.clear()

    def _hook(self, key: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            cache = kwargs.get("cache")
            past = None if cache is None else cache.k
            if past is None or key not in self._keys:
                self._hidden[key] = x.detach()
            else:  # incremental decoding: the cache may have been reordered (beam search) since
                before = self._keys[key]  # as the attention received them: grouped KV heads may be repeated
                rows = follow_rows(past.repeat_interleave(before.shape[1] // past.shape[1], dim=1), before)
                self._hidden[key] = torch.cat([self._hidden[key][rows], x.detach()], dim=1)

        return hook

    def scores(self, call):
        key = id(call.site.module)
        parts, hidden = self._parts[key], self._hidden[key]  # (B, Tk, d)
        self._keys[key] = call.k.detach()
        B, nh, Tq, hs = call.q.shape
        Tk = call.k.shape[2]
        q_pre = parts["q_proj"](hidden).view(B, Tk, nh, hs).transpose(1, 2)  # (B, nh, Tk, hs), before rotation
        if parts["q_norm"] is not None:
            q_pre = parts["q_norm"](q_pre)
        k = call.k.repeat_interleave(nh // call.k.shape[1], dim=1)
        logits = torch.cat(
            [
                expected_logits(k, *self._rotated(mu, sigma, ends, parts["theta"], hs))
                for ends, mu, sigma in running_statistics(q_pre, self.n_sink, Tk - Tq)
            ],
            dim=2,
        )  # (B, nh, Tq, Tk)
        values = parts["v_proj"](hidden).view(B, Tk, parts["n_kv_heads"], hs).transpose(1, 2)
        if self.value_norm == "out":
            norms = out_value_norms(values, parts["w_o"], nh)  # (B, nh, Tk)
        else:
            norms = values.double().norm(dim=-1).repeat_interleave(nh // values.shape[1], dim=1)
        sinks = first_keys(call.past, self.n_sink)  # (B, nh, Tq, Tk)
        scores = expected_attention_scores(logits, call.keys & ~sinks, norms, parts["n_kv_heads"])
        return torch.where(sinks[:, :1], math.inf, scores)

    def _rotated(self, mu, sigma, ends, theta, hs):
        """``R mu`` and ``R Sigma R^T`` with ``R`` each query's :func:`rotary_average`."""
        rot = rotary_average(ends.cpu(), self.future, hs, theta).to(mu.device)  # (Tq, hs, hs)
        return torch.einsum("qef,bhqf->bhqe", rot, mu), torch.einsum("qef,bhqfg,qig->bhqei", rot, sigma, rot)


def first_keys(past: torch.Tensor, n: int) -> torch.Tensor:
    """bool like ``past``: the first ``n`` keys of each query's ``past``."""
    return past & (past.long().cumsum(-1) <= n)


def running_statistics(q: torch.Tensor, start: int, first: int, chunk_bytes: int = 2**27):
    """Mean and (biased) covariance of ``q`` ``(B, h, T, hs)`` over positions ``start .. e``, for each
    query position ``e`` from ``first`` to ``T - 1``, in chunks of queries (at most about
    ``chunk_bytes`` of covariances at once). Yields ``(ends (c,), mu (B, h, c, hs), sigma (B, h, c,
    hs, hs))``; zero where the range is empty. In float64."""
    q = q.double()
    B, h, T, hs = q.shape
    c = max(1, chunk_bytes // (8 * B * h * hs * hs))
    for a in range(first, T, c):
        b = min(a + c, T)
        lo = min(max(start, 0), a)
        base1 = q[:, :, lo:a].sum(2, keepdim=True)  # (B, h, 1, hs): positions start .. a - 1
        base2 = torch.einsum("bhte,bhtf->bhef", q[:, :, lo:a], q[:, :, lo:a])[:, :, None]
        inside = q[:, :, a:b] * (torch.arange(a, b, device=q.device) >= start)[:, None].double()
        s1 = base1 + inside.cumsum(2)  # (B, h, c, hs)
        s2 = base2 + torch.einsum("bhte,bhtf->bhtef", inside, inside).cumsum(2)
        ends = torch.arange(a, b, device=q.device)
        n = (ends - start + 1).clamp(min=0).double()  # (c,)
        safe = n.clamp(min=1)
        mu = s1 / safe[:, None]
        sigma = s2 / safe[:, None, None] - torch.einsum("bhqe,bhqf->bhqef", mu, mu)
        yield ends, mu, sigma


def follow_rows(past: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The rows of ``before`` ``(B0, h, T, hs)`` (a layer's keys at the previous decoding step) that
    became the rows of ``past`` ``(B, h, T, hs)`` (the cache now, after beam search reordered it):
    matched on random projections of each row's keys; raises if a row has no match."""
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(past[0].numel(), 4, generator=g, dtype=torch.float64).to(past.device)
    a, b = past.flatten(1).double() @ proj, before.flatten(1).double() @ proj  # (B, 4), (B0, 4)
    dist = torch.cdist(a, b)
    best, rows = dist.min(dim=1)
    scale = b.abs().max().clamp(min=1.0)
    if bool((best > 1e-6 * scale).any()):
        raise RuntimeError("expected_attention lost track of the reordered KV cache (a row matches no earlier row)")
    return rows


def method(name: str, **options) -> EvictionMethod:
    """The registered method ``name`` built with ``options``; a ``ValueError`` naming the known ones."""
    if name not in METHODS:
        raise ValueError(f"unknown KV eviction method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name](**options)


# ----------------------------------------------------------------------------------------------
# The observer


@dataclass
class LossSums:
    """Running sums of one layer's attention loss (:func:`attention_loss`) over its counted query rows:
    the method's, and the oracle's at the same budget on the same calls (never above the method's)."""

    method: float = 0.0
    oracle: float = 0.0
    rows: int = 0


#: The columns of :meth:`KVEviction.loss_rows`.
LOSS_COLUMNS = ("layer", "rows", "attention_loss", "oracle_loss")


class KVEviction(AttentionObserver):
    """Evict past keys in causal decoder self-attention (see the module docstring), and sum the
    attention loss of each layer (:attr:`loss`: layer -> :class:`LossSums`).

    Args:
        ratio: keep ratio ``r`` of the past keys (kvpress's compression ratio is ``1 - r``).
        method: a name of :data:`METHODS` or an :class:`EvictionMethod`.
        skip_layers: layers ``0 .. skip_layers - 1`` keep every key.
        measure_loss: also compute each call's full attention, and the attention loss of the method
            and of the oracle at the same budget.
    """

    def __init__(
        self, ratio: float, method: str | EvictionMethod = "l2", skip_layers: int = 2, measure_loss: bool = False
    ):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"keep ratio must be in (0, 1], got {ratio}")
        self.method = globals()["method"](method) if isinstance(method, str) else method
        self.ratio, self.skip_layers, self.measure_loss = ratio, skip_layers, measure_loss
        self.loss: dict[int, LossSums] = {}

    def attached(self, network):
        return self.method.attached(network)

    def edit_mask(self, site, q, k, mask):
        if site.kind != "decoder_self" or site.layer < self.skip_layers:
            return mask
        keys = full_mask(q, k, mask)  # (B, nh, Tq, Tk)
        q_len, k_len = q.shape[2], k.shape[2]
        own = torch.arange(k_len, device=q.device) == (k_len - q_len + torch.arange(q_len, device=q.device))[:, None]
        call = KVCall(site, q, k, keys, keys & ~own)
        kept = keep_top(self.method.scores(call), call.past, self.ratio)
        if self.measure_loss:
            self._add_loss(site.layer, call, kept)
        return (keys & own) | kept

    def _add_loss(self, layer: int, call: KVCall, kept: torch.Tensor) -> None:
        weights = call.weights()
        total, rows = attention_loss(weights, call.past & ~kept)
        best, _ = attention_loss(weights, call.past & ~keep_top(weights, call.past, self.ratio))
        sums = self.loss.setdefault(layer, LossSums())
        sums.method, sums.oracle, sums.rows = (
            sums.method + float(total),
            sums.oracle + float(best),
            sums.rows + int(rows),
        )

    def loss_rows(self) -> list[tuple]:
        """``(layer, rows, attention_loss, oracle_loss)`` per evicted layer, then ``("all", ...)`` pooled
        over them: the mean share of a counted query row's attention mass on the pairs the method dropped,
        and the oracle's at the same budget on the same calls (None for a layer without a counted row)."""
        pooled = LossSums()
        out = []
        for layer, sums in sorted(self.loss.items()):
            out.append((layer, *loss_means(sums)))
            pooled.method, pooled.oracle, pooled.rows = (
                pooled.method + sums.method,
                pooled.oracle + sums.oracle,
                pooled.rows + sums.rows,
            )
        return out + [("all", *loss_means(pooled))] if out else []


def loss_means(sums: LossSums) -> tuple[int, float | None, float | None]:
    """``(rows, method mean, oracle mean)`` of ``sums`` (None for the means over no row)."""
    if sums.rows == 0:
        return 0, None, None
    return sums.rows, sums.method / sums.rows, sums.oracle / sums.rows


def keep_top(scores: torch.Tensor, past: torch.Tensor, ratio: float) -> torch.Tensor:
    """bool like ``past`` ``(B, nh, Tq, Tk)``: the ``ceil(ratio * n)`` past keys of highest score per
    query (ties: the earlier key), ``scores`` broadcastable (KV heads repeated to the query heads)."""
    if scores.dim() == 4 and scores.shape[1] not in (1, past.shape[1]):
        scores = scores.repeat_interleave(past.shape[1] // scores.shape[1], dim=1)
    scores = torch.where(past, scores.to(past.device).double(), -math.inf).expand(past.shape)
    order = scores.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)  # 0 = the highest-scored key
    return past & (rank < budget(past.sum(-1, keepdim=True), ratio))


def decoder_layers(task) -> list[int]:
    """The layers of the task's causal decoder self-attention."""
    return [s.layer for s in network_of(task).attention_sites().values() if s.kind == "decoder_self"]


def check_evictable(task, skip_layers: int) -> None:
    """A ``ValueError`` before any work when ``skip_layers`` leaves no decoder self-attention layer to
    evict in (every row would be the plain evaluation)."""
    layers = decoder_layers(task)
    if layers and not any(layer >= skip_layers for layer in layers):
        raise ValueError(
            f"--kv_skip_layers {skip_layers} leaves no layer to evict in: the decoder self-attention has "
            f"layers {layers}; pass --kv_skip_layers {max(layers)} or less"
        )


# ----------------------------------------------------------------------------------------------
# Q-Filters calibration


class QueryCollector(AttentionObserver):
    """Collect the queries of every decoder self-attention call (those of counted positions), per
    layer: :attr:`queries` layer -> list of ``(n, nh, hs)``."""

    def __init__(self):
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.query_keep: dict[str, torch.Tensor | None] = {}  # the task's query_keep of the current batch

    def edit_mask(self, site, q, k, mask):
        if site.kind == "decoder_self":
            rows = q.transpose(1, 2)  # (B, Tq, nh, hs)
            keep = self.query_keep.get(site.stack)  # (B, T) or None
            if keep is not None:
                rows = rows[keep]
            self.queries.setdefault(site.layer, []).append(rows.reshape(-1, q.shape[1], q.shape[3]).detach().cpu())
        return mask


def layer_filters(queries: dict[int, torch.Tensor], n_kv_heads: dict[int, int]) -> torch.Tensor:
    """``(L, n_kv, hs)`` filters from each layer's queries ``(N, nh, hs)``, pooling the query heads of
    each KV group."""
    out = []
    for layer in sorted(queries):
        q = queries[layer]  # (N, nh, hs)
        groups = q.unflatten(1, (n_kv_heads[layer], -1))  # (N, n_kv, group, hs)
        out.append(torch.stack([qfilters(groups[:, g].reshape(-1, q.shape[-1])) for g in range(groups.shape[1])]))
    return torch.stack(out)


def calibrate_qfilters(task, batches: list) -> dict:
    """Q-filters of ``task``'s decoder self-attention from teacher-forced ``batches`` (the queries as
    the attention receives them, i.e. after rotary positions where there are any), and their stability:
    the cosine between the filters of the first and second half of the batches (disjoint sequences).

    Returns:
        ``{"filters": (L, n_kv, hs), "cosine": (L, n_kv), "num_sequences": N}``.
    """
    from mmlight.analysis.batches import batch_size, teacher_forced_pass

    n = sum(batch_size(b) for b in batches)
    if n < 2:
        raise ValueError(f"Q-filter calibration needs at least 2 sequences (two disjoint halves), got {n}")
    network = network_of(task)
    kv_heads = {
        s.layer: attention_parts(m)["n_kv_heads"]
        for s in network.attention_sites().values()
        for m in network.modules()
        if s.kind == "decoder_self" and getattr(m, "reweight", None) is s.module
    }
    halves = []
    for part in split_samples(batches, n // 2):
        collector = QueryCollector()
        teacher_forced_pass(task, part, collector)
        halves.append({layer: torch.cat(q) for layer, q in collector.queries.items()})
    first, second = layer_filters(halves[0], kv_heads), layer_filters(halves[1], kv_heads)
    both = layer_filters({layer: torch.cat([halves[0][layer], halves[1][layer]]) for layer in halves[0]}, kv_heads)
    return {
        "filters": both.float(),
        "cosine": (first * second).sum(-1),
        "num_sequences": n,
    }


def split_samples(batches: list, n: int) -> tuple[list, list]:
    """``batches`` cut into the batches of the first ``n`` samples and those of the rest."""
    from mmlight.analysis.batches import batch_size, map_batch

    first, rest, seen = [], [], 0
    for batch in batches:
        size = batch_size(batch)
        cut = min(max(n - seen, 0), size)
        if cut:
            first.append(map_batch(batch, lambda t, cut=cut: t[:cut]))
        if cut < size:
            rest.append(map_batch(batch, lambda t, cut=cut: t[cut:]))
        seen += size
    return first, rest
