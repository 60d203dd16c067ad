"""Gated attention: each head's attention output multiplied by a sigmoid gate of the layer's input.

    Y' = Y ⊙ sigmoid(X W_g + b_g)

Qiu, Wang, Zheng, Huang, Wen, Yang, Men, Yu, Huang, Huang, Liu, Zhou & Lin (2025), "Gated Attention for
Large Language Models: Non-linearity, Sparsity, and Attention-Sink-Free" (arXiv:2505.06708; used in
Qwen3-Next): the gate sits after scaled dot-product attention and before the output projection (their
position G1), ``X`` is the attention layer's input (the normalised hidden states of the query
positions), and the gate is either one scalar per head (``headwise``) or one value per output channel
(``elementwise``). The gate depends on the query position only, so incremental decoding needs no cache
for it. Its initialisation is the attention layer's query projection's (see :class:`OutputGate`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

#: ``none`` (plain attention), ``headwise`` (one gate per head) or ``elementwise`` (one per channel).
GateKind = Literal["none", "headwise", "elementwise"]


class OutputGate(nn.Linear):
    """``sigmoid(x W_g + b_g)`` shaped to multiply an attention output ``(B, nh, T, hs)``.

    A plain linear layer (``gate.weight``, ``gate.bias``), with its outputs in head-major order, so
    that an elementwise gate has the layout of timm's ``Attention(gated=True)`` gate. The models
    initialise it as their query projection: the released code of the paper (``qiuzh20/gated_attention``,
    ``modeling_qwen3.py``) computes the gate as extra output rows of ``q_proj``, so they get the query
    weights' initialisation and bias.

    Args:
        dim: width of the layer's input ``x``.
        num_heads: attention heads.
        head_dim: width of each head's output.
        kind: ``headwise`` or ``elementwise``.
        bias: give the gate a bias (as the query projection has one or not).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, kind: GateKind, bias: bool = True):
        if kind not in ("headwise", "elementwise"):
            raise ValueError(f"an output gate is 'headwise' or 'elementwise', got {kind!r}")
        super().__init__(dim, num_heads * (1 if kind == "headwise" else head_dim), bias=bias)
        self.num_heads, self.kind = num_heads, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gates in (0, 1) for ``x`` ``(B, T, dim)``: ``(B, nh, T, 1)`` headwise, ``(B, nh, T, hs)`` elementwise."""
        B, T, _ = x.shape
        return torch.sigmoid(super().forward(x)).view(B, T, self.num_heads, -1).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kind={self.kind}"


def output_gate(kind: GateKind, dim: int, num_heads: int, head_dim: int, bias: bool = True) -> OutputGate | None:
    """The gate of an attention layer, or None for ``kind`` ``none`` (nothing added: the layer's
    parameters, and so its checkpoints, are those of plain attention). Arguments as for :class:`OutputGate`."""
    if kind == "none":
        return None
    return OutputGate(dim, num_heads, head_dim, kind, bias)
