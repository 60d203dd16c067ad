"""Transformer language model and encoder-decoder in the shape of fairseq's recipes (the paper's
Sections 5.1.2 and 5.1.3), with every attention layer routed through a reweighting function.

One file, top to bottom: the config and its presets, the incremental-decoding cache, the layers
(attention, feed-forward, encoder and decoder layers), the encoder/decoder stacks and the two models.
All attention masks are boolean, True = attend. Key-padding masks travel as ``(B, Tk)`` and are handed
to :func:`mmlight.nn.attention` as ``(B, 1, 1, Tk)``, the shape its fused MultiMax kernel takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mmlight import reweighting
from mmlight.nn.attention import attention
from mmlight.nn.gate import GateKind, output_gate
from mmlight.nn.rope import RotaryEmbedding
from mmlight.nn.sites import AttentionSite, Block, reweighting_modules, sites_by_name
from mmlight.reweighting import ReweightingSpec
from mmlight.reweighting.backend import Backend
from mmlight.safe_load import checkpoint_record

# ----------------------------------------------------------------------------------------------
# Config

#: how token positions enter the network: added tables (``sinusoidal``, ``learned``), rotary positions on
#: the queries and keys of self-attention (``rope``) or nothing (``none``, NoPE: a causal decoder still
#: knows the order)
PositionKind = Literal["sinusoidal", "learned", "rope", "none"]
NormKind = Literal["layernorm", "rmsnorm"]
FFNKind = Literal["relu", "gelu", "swiglu"]

#: the options that make a Llama-style decoder (pre-norm RMSNorm, rotary positions, SwiGLU, no biases, no
#: embedding scale, no dropout), to combine with a width, depth, heads (``n_kv_heads`` for grouped-query
#: attention, ``qk_norm`` for Qwen3's QK-norm) and vocabulary; docs/llm.md shows them as a config block
LLAMA_STYLE: dict = {
    "pre_norm": True,
    "positions": "rope",
    "rope_theta": 10_000.0,
    "norm": "rmsnorm",
    "norm_eps": 1e-5,
    "ffn": "swiglu",
    "bias": False,
    "embed_scale": 1.0,
    "dropout": 0.0,
}


@checkpoint_record
@dataclass
class TransformerConfig:
    """Architecture of a Transformer LM (``n_encoder_layers == 0``) or encoder-decoder.

    Args:
        vocab_size: target (decoder) vocabulary size; the only vocabulary of an LM.
        src_vocab_size: source vocabulary size of an encoder-decoder; None = ``vocab_size``
            (required to be equal when ``share_embeddings``).
        d_model: embedding and hidden width.
        n_heads: attention heads (``d_model`` must be a multiple).
        ffn_dim: inner width of the feed-forward blocks.
        n_layers: decoder layers.
        n_encoder_layers: encoder layers; 0 builds a decoder-only language model.
        dropout: dropout on embeddings and on each residual branch.
        attention_dropout: dropout on the attention weights.
        activation_dropout: dropout after the feed-forward activation.
        max_positions: longest sequence (source or target) the position embeddings cover.
        pre_norm: the norm before each sublayer plus a final norm (fairseq's
            ``--encoder/decoder-normalize-before``); False is the original post-norm Transformer.
        share_embeddings: one embedding table for encoder and decoder inputs (joint vocabulary).
        share_output_embedding: tie the output projection to the decoder input embedding.
        positions: ``sinusoidal`` (fairseq's fixed table, added to the embeddings), ``learned`` (a trained
            table), ``rope`` (rotary positions on every self-attention's queries and keys, Llama's; no
            table, so no ``max_positions`` limit; cross-attention gets none) or ``none`` (NoPE).
        rope_theta: the base of the rotary frequencies (10,000 in Llama 2, 500,000 in Llama 3).
        sinusoidal_positions: the earlier spelling of ``positions``: True = ``sinusoidal``, False =
            ``learned``; None (the default) leaves ``positions`` as set.
        norm: ``layernorm`` (fairseq) or ``rmsnorm`` (Llama: a learned scale, no mean subtraction, no
            bias) for every sublayer norm and the final norm.
        norm_eps: the epsilon of those norms (and of ``qk_norm``); LayerNorm's 1e-5 by default.
        ffn: the feed-forward block: ``relu`` (fairseq), ``gelu`` (exact, erf-based) or ``swiglu``
            (Llama: ``fc2(silu(x W_gate) * x W_up)``, with gate and up as the two halves of ``fc1``).
        n_kv_heads: key/value heads of every attention layer: fewer than ``n_heads`` (and dividing it)
            is grouped-query attention, 1 is multi-query attention; None = ``n_heads``. The KV cache
            holds ``n_kv_heads`` heads.
        qk_norm: an RMSNorm over the head dimension on each head's queries and keys, before the rotary
            positions (Qwen3).
        bias: biases in every linear layer (projections, feed-forward, gate) and in LayerNorm; Llama has none.
        embed_scale: factor on the token embeddings; None = ``sqrt(d_model)`` as fairseq (a Llama-style
            model sets 1.0).
        pad_id: padding token: its embedding row is zero, padded keys are masked, and it is the
            default ``ignore_index`` of :meth:`TransformerLM.loss`.
        attention: reweighting function of every self- and cross-attention layer (one instance each).
        gate: gated attention (Qiu et al. 2025) in every self- and cross-attention layer: ``none``,
            ``headwise`` (one sigmoid gate per head) or ``elementwise`` (one per channel), computed from
            the queries' input and applied to each head's output before ``out_proj`` (:mod:`mmlight.nn.gate`).
        output_multimax: modulate the output logits with a learnable MultiMax sigma.
        output_multimax_order: its order (1 or 2).
        backend: how every reweighting in the model is computed (``auto``, ``reference``,
            ``compile``, ``triton``); see :mod:`mmlight.reweighting.backend`.
    """

    vocab_size: int
    src_vocab_size: int | None = None
    d_model: int = 512
    n_heads: int = 8
    ffn_dim: int = 2048
    n_layers: int = 6
    n_encoder_layers: int = 0
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    max_positions: int = 1024
    pre_norm: bool = False
    share_embeddings: bool = False
    share_output_embedding: bool = True
    positions: PositionKind = "sinusoidal"
    rope_theta: float = 10_000.0
    sinusoidal_positions: bool | None = None
    norm: NormKind = "layernorm"
    norm_eps: float = 1e-5
    ffn: FFNKind = "relu"
    n_kv_heads: int | None = None
    qk_norm: bool = False
    bias: bool = True
    embed_scale: float | None = None
    pad_id: int = 1
    attention: ReweightingSpec = field(default_factory=ReweightingSpec)
    gate: GateKind = "none"
    output_multimax: bool = False
    output_multimax_order: int = 2
    backend: Backend = "auto"

    def __post_init__(self):
        if self.sinusoidal_positions is not None:  # the earlier spelling, resolved into `positions`
            spelt = "sinusoidal" if self.sinusoidal_positions else "learned"
            if self.positions not in ("sinusoidal", spelt):
                raise ValueError(
                    f"sinusoidal_positions={self.sinusoidal_positions} contradicts positions={self.positions!r}; "
                    "set positions only"
                )
            self.positions, self.sinusoidal_positions = spelt, None
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.share_embeddings and self.src_vocab_size not in (None, self.vocab_size):
            raise ValueError("share_embeddings needs one joint vocabulary (src_vocab_size == vocab_size)")
        choices = {"positions": PositionKind, "norm": NormKind, "ffn": FFNKind}
        for name, kind in choices.items():
            if getattr(self, name) not in kind.__args__:
                raise ValueError(f"{name} must be one of {kind.__args__}, got {getattr(self, name)!r}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must be positive and divide n_heads={self.n_heads}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dimension, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError(f"rope_theta and norm_eps must be positive, got {self.rope_theta} and {self.norm_eps}")

    def __setstate__(self, state: dict) -> None:
        """Unpickling (a checkpoint's hyperparameters): a config saved before ``positions`` existed holds
        ``sinusoidal_positions`` only, resolved here as when the config is built."""
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads per attention layer (``n_kv_heads``, or ``n_heads`` when None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @classmethod
    def transformer_lm_wikitext103(cls, vocab_size: int = 267_744, **overrides) -> TransformerConfig:
        """fairseq ``transformer_lm`` as trained on WikiText-103 (its language-model example, the
        paper's Section 5.1.2): 6 post-norm decoder layers, d 512, FFN 2048, 8 heads, dropout 0.1,
        sinusoidal positions, output projection tied to the input embedding
        (``--share-decoder-input-output-embed``). With the 267,744-word vocabulary: 155,999,232
        parameters (137.1M embedding + 18.9M layers), plus 8 per MultiMax (order 2) layer.
        ``overrides`` replace any field (e.g. ``attention``, ``output_multimax``)."""
        config = cls(
            vocab_size=vocab_size,
            d_model=512,
            n_heads=8,
            ffn_dim=2048,
            n_layers=6,
            n_encoder_layers=0,
            dropout=0.1,
            attention_dropout=0.0,
            activation_dropout=0.0,
            max_positions=512,
            pre_norm=False,
            share_output_embedding=True,
        )
        return replace(config, **overrides)

    @classmethod
    def transformer_iwslt_de_en(cls, vocab_size: int = 10_000, **overrides) -> TransformerConfig:
        """fairseq ``transformer_iwslt_de_en`` (the paper's Section 5.1.3): 6+6 post-norm layers,
        d 512, FFN 1024, 4 heads, dropout 0.3, sinusoidal positions, with one joint vocabulary shared
        by encoder input, decoder input and output (``--share-all-embeddings``). With 10,000 tokens:
        36,663,296 parameters (5.1M embedding + 31.5M layers). ``overrides`` replace any field."""
        config = cls(
            vocab_size=vocab_size,
            d_model=512,
            n_heads=4,
            ffn_dim=1024,
            n_layers=6,
            n_encoder_layers=6,
            dropout=0.3,
            attention_dropout=0.0,
            activation_dropout=0.0,
            max_positions=1024,
            pre_norm=False,
            share_embeddings=True,
            share_output_embedding=True,
        )
        return replace(config, **overrides)


# ----------------------------------------------------------------------------------------------
# Incremental-decoding cache


@dataclass
class KVCache:
    """Keys and values of one attention layer, kept across decoding steps.

    Self-attention appends each step's keys/values; cross-attention fills it once from the encoder
    output and reuses it.

    Args:
        k: keys ``(B, nkv, Tk, hs)`` (``n_kv_heads`` heads, after the QK-norm and rotated at each token's
            absolute position), None while empty.
        v: values ``(B, nkv, Tk, hs)``, None while empty.
        keep: ``(B, Tk)`` bool key-padding mask (True = attend); None = every key is kept.
    """

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None):
        """Add new keys/values ``(B, nkv, T, hs)`` with their ``(B, T)`` mask (or None); return the
        whole ``(k, v, keep)``."""
        if self.k is not None:
            keep = _cat_keep(self.keep, keep, self.k.shape[2], k.shape[2], k.shape[0], k.device)
            k = torch.cat([self.k, k], dim=2)  # (B, nkv, Tk + T, hs)
            v = torch.cat([self.v, v], dim=2)
        self.k, self.v, self.keep = k, v, keep
        return k, v, keep

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows ``index`` ``(B',)`` (beam search), in place."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
        if self.keep is not None:
            self.keep = self.keep.index_select(0, index)


def _cat_keep(old, new, old_len, new_len, batch, device):
    """Concatenate two ``(B, T)`` key masks along time, either of which may be None (all kept)."""
    if old is None and new is None:
        return None
    old = torch.ones(batch, old_len, dtype=torch.bool, device=device) if old is None else old
    new = torch.ones(batch, new_len, dtype=torch.bool, device=device) if new is None else new
    return torch.cat([old, new], dim=1)


@dataclass
class DecoderCache:
    """The caches of every decoder layer; create with ``model.new_cache()``.

    Args:
        self_attn: one :class:`KVCache` per decoder layer (appended each step).
        cross_attn: one per decoder layer for encoder-decoders (filled on the first step); empty for an LM.
    """

    self_attn: list[KVCache]
    cross_attn: list[KVCache]

    @property
    def length(self) -> int:
        """Tokens decoded so far (the position of the next one)."""
        return len(self.self_attn[0]) if self.self_attn else 0

    def layer(self, i: int) -> tuple[KVCache, KVCache | None]:
        return self.self_attn[i], (self.cross_attn[i] if self.cross_attn else None)

    def reorder(self, index: torch.Tensor) -> DecoderCache:
        """Select batch rows ``index`` in every layer, in place; returns self."""
        for c in self.self_attn + self.cross_attn:
            c.reorder(index)
        return self


# ----------------------------------------------------------------------------------------------
# Layers


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor | None:
    """``(B, T)`` bool, True for real tokens; None when there is no padding (keeps the fast paths)."""
    return none_if_all(tokens != pad_id)


def none_if_all(keep: torch.Tensor | None) -> torch.Tensor | None:
    """None for a mask that keeps everything (so attention takes its unmasked fast path), else ``keep``.

    Inside a compiled graph, or on the meta device (FLOP counting), the mask is kept as it is:
    whether it keeps everything is not known there, and a mask that keeps everything gives the same
    result."""
    if keep is None or keep.is_meta or torch.compiler.is_compiling():
        return keep
    return None if bool(keep.all()) else keep


def sinusoidal_table(n_positions: int, dim: int) -> torch.Tensor:
    """fairseq's sinusoidal position table ``(n_positions, dim)``: sines in the first half of the
    channels, cosines in the second (not interleaved), frequencies ``10000 ** (-i / (dim/2 - 1))``."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000.0) / max(half - 1, 1)))
    angles = torch.arange(n_positions, dtype=torch.float)[:, None] * freq[None, :]  # (P, half)
    table = torch.cat([angles.sin(), angles.cos()], dim=1)  # (P, 2 * half)
    return F.pad(table, (0, dim - 2 * half))  # (P, dim): a zero column when dim is odd


def norm_layer(config: TransformerConfig) -> nn.Module:
    """The config's norm over ``d_model`` channels: LayerNorm (with a bias when ``config.bias``) or RMSNorm,
    with ``config.norm_eps``."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (self or cross) through :func:`mmlight.nn.attention`.

    Args:
        d_model: input and output width.
        n_heads: number of query heads.
        reweight: the reweighting module applied to the scores.
        dropout: dropout on the attention weights (training only).
        cross: keys/values come from the encoder output (cached once) instead of the input
            (appended to the cache each step).
        gate: ``none``, ``headwise`` or ``elementwise``: the output gate (:mod:`mmlight.nn.gate`).
        n_kv_heads: key/value heads (grouped-query attention when fewer than ``n_heads``); None = ``n_heads``.
        bias: biases in the four projections (and the gate).
        qk_norm_eps: an RMSNorm over each head's queries and keys with this epsilon (Qwen3's QK-norm);
            None = no norm.
        rope: rotary positions applied to the queries and keys after the QK-norm (self-attention only);
            None = no rotation.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        reweight: reweighting.Reweighting,
        dropout: float = 0.0,
        cross: bool = False,
        gate: GateKind = "none",
        n_kv_heads: int | None = None,
        bias: bool = True,
        qk_norm_eps: float | None = None,
        rope: RotaryEmbedding | None = None,
    ):
        super().__init__()
        self.n_heads, self.head_dim, self.cross = n_heads, d_model // n_heads, cross
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        kv_dim = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, kv_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, kv_dim, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.gate = output_gate(gate, d_model, n_heads, self.head_dim, bias)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=qk_norm_eps)
        self.rope = rope
        self.reweight = reweight
        self.dropout = dropout
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """fairseq's init: Xavier-uniform, gain 1/sqrt(2) on q/k/v (as for its fused projection), zero biases.
        The gate's weights are drawn as the query projection's, from the same uniform range (the paper's
        released code computes the gate as extra rows of ``q_proj``), and its bias is zero."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1.0 if proj is self.out_proj else 2**-0.5)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.gate is not None:
            bound = 2**-0.5 * math.sqrt(6 / sum(self.q_proj.weight.shape))  # xavier_uniform_'s bound for q_proj
            nn.init.uniform_(self.gate.weight, -bound, bound)
            if self.gate.bias is not None:
                nn.init.zeros_(self.gate.bias)

    def _heads(self, x: torch.Tensor, n_heads: int | None = None) -> torch.Tensor:
        """``(B, T, heads * hs)`` -> ``(B, heads, T, hs)``, ``heads`` = ``n_heads`` or the query heads."""
        B, T, _ = x.shape
        return x.view(B, T, n_heads or self.n_heads, self.head_dim).transpose(1, 2)

    def _position(self, x: torch.Tensor, norm: nn.Module | None, start: int) -> torch.Tensor:
        """Queries or keys ``(B, heads, T, hs)`` after the QK-norm and the rotary positions (if any)."""
        x = x if norm is None else norm(x)
        return x if self.rope is None else self.rope(x, start)

    def _keys_values(self, x, memory, keep, cache, start):
        """Keys, values ``(B, nkv, Tk, hs)`` and their ``(B, Tk)`` mask, through the cache when there is one."""
        if self.cross:
            if cache is not None and cache.k is not None:
                return cache.k, cache.v, keep  # encoder keys/values computed on the first step
            k = self._position(self._heads(self.k_proj(memory), self.n_kv_heads), self.k_norm, 0)  # (B, nkv, S, hs)
            v = self._heads(self.v_proj(memory), self.n_kv_heads)
            if cache is not None:
                cache.k, cache.v = k, v
            return k, v, keep
        k = self._position(self._heads(self.k_proj(x), self.n_kv_heads), self.k_norm, start)  # (B, nkv, T, hs)
        v = self._heads(self.v_proj(x), self.n_kv_heads)
        if cache is not None:
            return cache.append(k, v, keep)  # keys enter the cache rotated at their absolute positions
        return k, v, keep

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Attend from ``x`` ``(B, T, d)``; returns ``(B, T, d)``.

        Args:
            x: queries' input (and keys'/values' for self-attention).
            memory: encoder output ``(B, S, d)`` for cross-attention (unused once the cache is filled).
            keep: ``(B, Tk_new)`` key-padding mask of the new keys (self-attention: of ``x``;
                cross-attention: of ``memory``), None = no padding.
            is_causal: mask future keys (bottom-right aligned, so it holds with a cache).
            cache: this layer's :class:`KVCache` during incremental decoding.
        """
        B, T, C = x.shape
        start = 0 if cache is None or self.cross else len(cache)  # position of x's first token
        q = self._position(self._heads(self.q_proj(x)), self.q_norm, start)  # (B, nh, T, hs)
        k, v, keep = self._keys_values(x, memory, keep, cache, start)  # (B, nkv, Tk, hs), (B, Tk)
        mask = None if keep is None else keep[:, None, None, :]  # (B, 1, 1, Tk)
        y = attention(
            q, k, v, self.reweight, mask=mask, is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        if self.gate is not None:
            y = y * self.gate(x)  # gates (B, nh, T, 1|hs) from the queries' input, so none is cached
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, d)
        return self.out_proj(y)


class FeedForward(nn.Module):
    """Position-wise ``fc2(dropout(act(fc1(x))))``; for SwiGLU ``fc1`` holds the gate and up projections
    as the two halves of its output, and ``act(a, b) = silu(a) * b``.

    Args:
        d_model: input and output width.
        ffn_dim: inner width.
        activation_dropout: dropout after the activation.
        kind: ``relu``, ``gelu`` or ``swiglu``.
        bias: biases in ``fc1`` and ``fc2``.
    """

    def __init__(
        self, d_model: int, ffn_dim: int, activation_dropout: float = 0.0, kind: FFNKind = "relu", bias: bool = True
    ):
        super().__init__()
        self.kind = kind
        self.fc1 = nn.Linear(d_model, 2 * ffn_dim if kind == "swiglu" else ffn_dim, bias=bias)
        self.fc2 = nn.Linear(ffn_dim, d_model, bias=bias)
        self.activation_dropout = nn.Dropout(activation_dropout)
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            if fc.bias is not None:
                nn.init.zeros_(fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # (B, T, ffn) or (B, T, 2 ffn)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.relu(h) if self.kind == "relu" else F.gelu(h)
        return self.fc2(self.activation_dropout(h))  # (B, T, d)


class Residual(nn.Module):
    """A sublayer with dropout, residual connection and a norm before (pre-norm) or after it.

    Args:
        norm: the norm module (:func:`norm_layer`).
        dropout: dropout on the sublayer's output.
        pre_norm: normalise the sublayer's input instead of the sum.
    """

    def __init__(self, norm: nn.Module, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = norm
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


def attention_layer(
    config: TransformerConfig, causal: bool, site: str, cross: bool = False, rope: RotaryEmbedding | None = None
) -> MultiHeadAttention:
    """One attention layer of ``config``: its reweighting (built for ``site``), heads, gate, norm and positions."""
    c = config
    return MultiHeadAttention(
        c.d_model,
        c.n_heads,
        c.attention.build(c.backend, c.n_heads, causal=causal, site=site),
        c.attention_dropout,
        cross=cross,
        gate=c.gate,
        n_kv_heads=c.n_kv_heads,
        bias=c.bias,
        qk_norm_eps=c.norm_eps if c.qk_norm else None,
        rope=rope,  # None for cross-attention: DecoderLayer builds it without the stack's rotary positions
    )


def rotary(config: TransformerConfig) -> RotaryEmbedding | None:
    """The rotary positions that a stack's self-attention layers share, None unless ``positions`` is ``rope``."""
    return RotaryEmbedding(config.head_dim, config.rope_theta) if config.positions == "rope" else None


class EncoderLayer(nn.Module):
    """Self-attention over the source, then feed-forward.

    Args:
        config: the architecture (width, heads, dropouts, norm placement, reweighting, backend).
        rope: the stack's rotary positions (None without).
    """

    def __init__(self, config: TransformerConfig, rope: RotaryEmbedding | None = None):
        super().__init__()
        c = config
        self.self_attn = attention_layer(c, causal=False, site="encoder self-attention", rope=rope)
        self.ffn = FeedForward(c.d_model, c.ffn_dim, c.activation_dropout, c.ffn, c.bias)
        self.attn_block = Residual(norm_layer(c), c.dropout, c.pre_norm)
        self.ffn_block = Residual(norm_layer(c), c.dropout, c.pre_norm)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(B, S, d)`` with source mask ``keep`` ``(B, S)`` -> ``(B, S, d)``."""
        x = self.attn_block(x, lambda h: self.self_attn(h, keep=keep))
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output (when ``cross``), feed-forward.

    Args:
        config: the architecture.
        cross: include the cross-attention sublayer (encoder-decoder) or not (language model).
        rope: the stack's rotary positions (None without); cross-attention gets none.
    """

    def __init__(self, config: TransformerConfig, cross: bool, rope: RotaryEmbedding | None = None):
        super().__init__()
        c = config
        self.self_attn = attention_layer(c, causal=True, site="decoder self-attention", rope=rope)
        self.attn_block = Residual(norm_layer(c), c.dropout, c.pre_norm)
        self.cross_attn = self.cross_block = None
        if cross:
            self.cross_attn = attention_layer(c, causal=False, site="cross-attention", cross=True)
            self.cross_block = Residual(norm_layer(c), c.dropout, c.pre_norm)
        self.ffn = FeedForward(c.d_model, c.ffn_dim, c.activation_dropout, c.ffn, c.bias)
        self.ffn_block = Residual(norm_layer(c), c.dropout, c.pre_norm)

    def forward(
        self,
        x: torch.Tensor,
        keep: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_keep: torch.Tensor | None = None,
        cache: tuple[KVCache, KVCache | None] | None = None,
    ) -> torch.Tensor:
        """``x`` ``(B, T, d)`` -> ``(B, T, d)``.

        Args:
            x: decoder states of the new positions.
            keep: ``(B, T)`` mask of the new target tokens (None = no padding).
            memory: encoder output ``(B, S, d)``.
            memory_keep: ``(B, S)`` source mask.
            cache: ``(self-attention cache, cross-attention cache)`` during incremental decoding.
        """
        self_cache, cross_cache = cache if cache is not None else (None, None)
        x = self.attn_block(x, lambda h: self.self_attn(h, keep=keep, is_causal=True, cache=self_cache))
        if self.cross_attn is not None:
            x = self.cross_block(x, lambda h: self.cross_attn(h, memory, keep=memory_keep, cache=cross_cache))
        return self.ffn_block(x, self.ffn)


# ----------------------------------------------------------------------------------------------
# Stacks


class TokenPositionEmbedding(nn.Module):
    """Scaled token embedding plus a position table (``sinusoidal`` or ``learned`` positions), then dropout.

    Args:
        tokens: the token table (possibly shared with other stacks and the output projection).
        config: the architecture (positions, scale, dropout).
    """

    def __init__(self, tokens: nn.Embedding, config: TransformerConfig):
        super().__init__()
        self.tokens = tokens
        self.scale = math.sqrt(config.d_model) if config.embed_scale is None else config.embed_scale
        self.max_positions = config.max_positions
        self.kind = config.positions
        self.sinusoid = self.positions = None
        if config.positions == "sinusoidal":
            # A plain attribute, not a buffer: DDP broadcasts buffers before every forward, also in
            # evaluation, which deadlocks when ranks run different numbers of evaluation batches.
            self.sinusoid = sinusoidal_table(config.max_positions, config.d_model)
        elif config.positions == "learned":
            self.positions = nn.Embedding(config.max_positions, config.d_model)
            nn.init.normal_(self.positions.weight, std=config.d_model**-0.5)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``tokens`` ``(B, T)`` at positions ``start .. start + T - 1`` -> ``(B, T, d)``."""
        T = tokens.shape[1]
        x = self.scale * self.tokens(tokens)  # (B, T, d)
        if self.kind in ("sinusoidal", "learned"):
            if start + T > self.max_positions:
                raise ValueError(f"positions up to {start + T} exceed max_positions={self.max_positions}")
            pos = torch.arange(start, start + T, device=tokens.device)  # (T,)
            if self.positions is None:
                self.sinusoid = self.sinusoid.to(tokens.device)  # a no-op once it is there
                table = self.sinusoid
            else:
                table = self.positions.weight
            x = x + table[pos].to(self.tokens.weight.dtype)
        return self.dropout(x)


def token_embedding(vocab_size: int, d_model: int, pad_id: int) -> nn.Embedding:
    """fairseq's init: N(0, d^-0.5), zero padding row (which gets no gradient)."""
    emb = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
    nn.init.normal_(emb.weight, std=d_model**-0.5)
    with torch.no_grad():
        emb.weight[pad_id].zero_()
    return emb


class Encoder(nn.Module):
    """Embedding, ``n_encoder_layers`` encoder layers, final norm when pre-norm.

    Args:
        tokens: the source token table.
        config: the architecture.
    """

    def __init__(self, tokens: nn.Embedding, config: TransformerConfig):
        super().__init__()
        self.embed = TokenPositionEmbedding(tokens, config)
        rope = rotary(config)
        self.layers = nn.ModuleList(EncoderLayer(config, rope) for _ in range(config.n_encoder_layers))
        self.norm = norm_layer(config) if config.pre_norm else None

    def forward(self, src: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """``src`` ``(B, S)`` with mask ``(B, S)`` (or None) -> memory ``(B, S, d)``."""
        x = self.embed(src)  # (B, S, d)
        for layer in self.layers:
            x = layer(x, keep)
        return x if self.norm is None else self.norm(x)


class Decoder(nn.Module):
    """Embedding, ``n_layers`` decoder layers, final norm when pre-norm.

    Args:
        tokens: the target token table.
        config: the architecture.
        cross: whether the layers attend to an encoder output.
    """

    def __init__(self, tokens: nn.Embedding, config: TransformerConfig, cross: bool):
        super().__init__()
        self.embed = TokenPositionEmbedding(tokens, config)
        rope = rotary(config)
        self.layers = nn.ModuleList(DecoderLayer(config, cross, rope) for _ in range(config.n_layers))
        self.norm = norm_layer(config) if config.pre_norm else None
        self.cross = cross

    def new_cache(self) -> DecoderCache:
        """Empty per-layer caches (self-attention, plus cross-attention when ``cross``)."""
        n = len(self.layers)
        return DecoderCache([KVCache() for _ in range(n)], [KVCache() for _ in range(n)] if self.cross else [])

    def forward(
        self,
        tokens: torch.Tensor,
        keep: torch.Tensor | None,
        memory: torch.Tensor | None = None,
        memory_keep: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``(B, T)`` (the new ones when ``cache`` holds the earlier) -> ``(B, T, d)``.

        Args:
            tokens: target tokens at positions ``cache.length ..`` (0 without a cache).
            keep: their ``(B, T)`` padding mask, None = no padding.
            memory: encoder output ``(B, S, d)`` (encoder-decoder only).
            memory_keep: ``(B, S)`` source mask, None = no padding.
            cache: the :class:`DecoderCache` during incremental decoding.
        """
        x = self.embed(tokens, start=0 if cache is None else cache.length)  # (B, T, d)
        for i, layer in enumerate(self.layers):
            x = layer(x, keep, memory, memory_keep, None if cache is None else cache.layer(i))
        return x if self.norm is None else self.norm(x)


# ----------------------------------------------------------------------------------------------
# Models


class _OutputHead(nn.Module):
    """Output projection, optional output MultiMax and the summed loss, shared by both models."""

    config: TransformerConfig
    decoder: Decoder

    def _build_output(self, config: TransformerConfig, tokens: nn.Embedding):
        self.output_projection = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.share_output_embedding:
            self.output_projection.weight = tokens.weight
        else:
            nn.init.normal_(self.output_projection.weight, std=config.d_model**-0.5)
        self.output = None
        if config.output_multimax:
            self.output = reweighting.MultiMax(order=config.output_multimax_order, backend=config.backend)

    def attention_sites(self) -> dict[str, AttentionSite]:
        """Each attention layer as a typed record by its module path, the stable name that monitoring
        and analysis report (``encoder.layers.0.self_attn``, ``decoder.layers.1.cross_attn``, ...);
        encoder first, then decoder, each layer's self-attention before its cross-attention."""
        sites = []
        encoder = getattr(self, "encoder", None)
        for i, layer in enumerate([] if encoder is None else encoder.layers):
            sites.append(
                AttentionSite(
                    f"encoder.layers.{i}.self_attn",
                    "encoder_self",
                    "encoder",
                    i,
                    layer.self_attn.reweight,
                    gate=layer.self_attn.gate,
                )
            )
        for i, layer in enumerate(self.decoder.layers):
            sites.append(
                AttentionSite(
                    f"decoder.layers.{i}.self_attn",
                    "decoder_self",
                    "decoder",
                    i,
                    layer.self_attn.reweight,
                    gate=layer.self_attn.gate,
                )
            )
            if layer.cross_attn is not None:
                sites.append(
                    AttentionSite(
                        f"decoder.layers.{i}.cross_attn",
                        "cross",
                        "decoder",
                        i,
                        layer.cross_attn.reweight,
                        key_stack="encoder",
                        gate=layer.cross_attn.gate,
                    )
                )
        return sites_by_name(sites)

    def reweighting_sites(self) -> dict[str, reweighting.Reweighting]:
        """The reweighting module of every attention site, plus ``output`` when the output layer is MultiMax."""
        return reweighting_modules(self.attention_sites(), self.output)

    def blocks(self) -> list[Block]:
        """The encoder layers (if any), then the decoder layers, in depth order."""
        stacks = {"encoder": getattr(self, "encoder", None), "decoder": self.decoder}
        return [
            Block(f"{name}.layers.{i}", name, i, layer)
            for name, stack in stacks.items()
            if stack is not None
            for i, layer in enumerate(stack.layers)
        ]

    def new_cache(self) -> DecoderCache:
        """An empty incremental-decoding cache (its batch size is set by the first step)."""
        return self.decoder.new_cache()

    @staticmethod
    def reorder_cache(cache: DecoderCache, index: torch.Tensor) -> DecoderCache:
        """Keep batch rows ``index`` ``(B',)`` of ``cache`` (beam search), in place; returns it."""
        return cache.reorder(index)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores ``(..., V)`` for hidden states ``(..., d)``, modulated by the output MultiMax if any."""
        logits = self.output_projection(hidden)
        return logits if self.output is None else self.output.modulate(logits)

    def summed_loss(self, hidden, targets, loss_mask=None, ignore_index=None, label_smoothing=0.0):
        """Summed cross-entropy of ``logits(hidden)`` ``(B, T, V)`` against ``targets`` ``(B, T)``, and the
        count of scored targets (see :meth:`TransformerLM.loss` for the arguments)."""
        ignore_index = self.config.pad_id if ignore_index is None else ignore_index
        targets = targets.reshape(-1)  # (N,)
        if loss_mask is not None:
            targets = torch.where(loss_mask.reshape(-1), targets, ignore_index)
        raw = self.output_projection(hidden).reshape(targets.shape[0], -1)  # (N, V)
        if self.output is not None:
            total = self.output.cross_entropy(raw, targets, label_smoothing, ignore_index, reduction="sum")
        else:
            total = F.cross_entropy(
                raw, targets, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum"
            )
        return total, (targets != ignore_index).sum()


class TransformerLM(_OutputHead):
    """Decoder-only language model (fairseq ``transformer_lm``).

    Args:
        config: the architecture; ``n_encoder_layers`` must be 0.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if config.n_encoder_layers:
            raise ValueError("TransformerLM is decoder-only: set n_encoder_layers=0 or use TransformerSeq2Seq")
        self.config = config
        tokens = token_embedding(config.vocab_size, config.d_model, config.pad_id)
        self.decoder = Decoder(tokens, config, cross=False)
        self._build_output(config, tokens)

    def forward(self, tokens: torch.Tensor, cache: DecoderCache | None = None) -> torch.Tensor:
        """Hidden states ``(B, T, d)`` of ``tokens`` ``(B, T)``; ``pad_id`` keys are masked.

        With ``cache`` (from :meth:`new_cache`), ``tokens`` are the next ones after those already
        cached, which are appended.
        """
        return self.decoder(tokens, padding_mask(tokens, self.config.pad_id), cache=cache)

    def loss(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed cross-entropy of the next-token predictions and the number of counted targets.

        Goes through the output MultiMax's fused cross-entropy when there is one, so no softmax over
        ``(B, T, V)`` is materialised for the metric.

        Args:
            tokens: inputs ``(B, T)``.
            targets: ``(B, T)`` next tokens.
            loss_mask: optional ``(B, T)`` bool, False = do not count this target.
            ignore_index: targets with this value are not counted; None = ``config.pad_id``.
            label_smoothing: as in :func:`torch.nn.functional.cross_entropy` (the sum is then the
                smoothed loss, not the NLL).

        Returns:
            ``(sum_loss, count)``: fp32 scalar and int64 scalar; ``sum_loss / count`` is the mean.
        """
        return self.summed_loss(self(tokens), targets, loss_mask, ignore_index, label_smoothing)


class TransformerSeq2Seq(_OutputHead):
    """Encoder-decoder translation model (fairseq ``transformer``, e.g. ``transformer_iwslt_de_en``).

    Args:
        config: the architecture; ``n_encoder_layers`` must be positive.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if not config.n_encoder_layers:
            raise ValueError("TransformerSeq2Seq needs n_encoder_layers > 0; use TransformerLM for an LM")
        self.config = config
        tgt_tokens = token_embedding(config.vocab_size, config.d_model, config.pad_id)
        src_vocab = config.src_vocab_size or config.vocab_size
        src_tokens = tgt_tokens
        if not config.share_embeddings:
            src_tokens = token_embedding(src_vocab, config.d_model, config.pad_id)
        self.encoder = Encoder(src_tokens, config)
        self.decoder = Decoder(tgt_tokens, config, cross=True)
        self._build_output(config, tgt_tokens)

    def source_mask(self, src: torch.Tensor) -> torch.Tensor:
        """``(B, S)`` bool, True for non-padding source tokens."""
        return src != self.config.pad_id

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Memory ``(B, S, d)`` of ``src`` ``(B, S)``; ``src_mask`` ``(B, S)`` defaults to the
        non-``pad_id`` tokens. A fully padded row gives finite (zero-attention) states."""
        return self.encoder(src, none_if_all(self._keep(src, src_mask)))

    def decode(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor | None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """Decoder hidden states ``(B, T, d)``.

        Args:
            tgt_in: decoder inputs ``(B, T)`` (shifted targets); with ``cache``, the new tokens only.
            memory: encoder output ``(B, S, d)``; with a filled cache its keys/values are reused.
            src_mask: ``(B, S)`` bool source mask (True = real token), None = no padding.
            cache: from :meth:`new_cache`, for incremental decoding.
        """
        keep = padding_mask(tgt_in, self.config.pad_id)
        return self.decoder(tgt_in, keep, memory, none_if_all(src_mask), cache)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``decode(tgt_in, encode(src))``: hidden states ``(B, T, d)``."""
        src_mask = self._keep(src, src_mask)
        return self.decode(tgt_in, self.encode(src, src_mask), src_mask)

    def loss(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        targets: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_loss, count)`` of the targets ``(B, T)`` given ``src`` ``(B, S)`` and ``tgt_in``
        ``(B, T)``; the other arguments as in :meth:`TransformerLM.loss`."""
        hidden = self(src, tgt_in, src_mask)
        return self.summed_loss(hidden, targets, loss_mask, ignore_index, label_smoothing)

    def _keep(self, src: torch.Tensor, src_mask: torch.Tensor | None) -> torch.Tensor:
        return self.source_mask(src) if src_mask is None else src_mask
