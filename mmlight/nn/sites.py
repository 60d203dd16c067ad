"""Typed records of a model's attention layers and blocks, as monitoring and analysis see them.

A site's ``name`` (``blocks.3``, ``decoder.layers.1.cross_attn``) is a label for people and logs;
code that needs the kind, the stack or the depth of a layer reads these fields, never the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

#: ``self`` (a single stack, e.g. the ViT), ``encoder_self``, ``decoder_self`` (causal) or ``cross``.
SiteKind = Literal["self", "encoder_self", "decoder_self", "cross"]


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One attention layer of a model.

    Args:
        name: the stable label reported in logs and files.
        kind: what the layer attends over (:data:`SiteKind`).
        stack: whose positions the queries are (``blocks``, ``encoder``, ``decoder``): the key of
            the task's ``query_keep`` masks.
        layer: depth within its stack, from 0.
        module: the layer's reweighting module (what :func:`~mmlight.nn.attention.attention` receives).
        key_stack: whose positions the keys are; None = ``stack`` (self-attention).
        gate: the layer's output gate (:class:`~mmlight.nn.gate.OutputGate`), None without one; its
            output ``(B, nh, Tq, 1|hs)`` is the gate values of the call.
    """

    name: str
    kind: SiteKind
    stack: str
    layer: int
    module: nn.Module
    key_stack: str | None = None
    gate: nn.Module | None = None

    @property
    def keys_from(self) -> str:
        """The stack whose positions the keys are."""
        return self.stack if self.key_stack is None else self.key_stack


@dataclass(frozen=True, eq=False)
class Block:
    """One transformer block, whose output tokens the token similarity is measured on.

    Args:
        name: the stable label (``blocks.3``, ``encoder.layers.0``).
        stack: whose positions its tokens are.
        layer: depth within its stack, from 0.
        module: the block; a forward hook reads its output ``(B, prefix + T, d)``.
        prefix: leading tokens that are no input position (a CLS token), left out of the similarity.
    """

    name: str
    stack: str
    layer: int
    module: nn.Module
    prefix: int = 0


def reweighting_modules(sites: dict[str, AttentionSite], output: nn.Module | None) -> dict[str, nn.Module]:
    """A network's ``reweighting_sites()``: each site's reweighting module by name, plus ``output``
    (the modulation of the logits) when there is one."""
    return {**{name: site.module for name, site in sites.items()}, **({"output": output} if output is not None else {})}


def sites_by_name(sites: list[AttentionSite]) -> dict[str, AttentionSite]:
    """``{site.name: site}`` in the given order; a duplicate name is an error."""
    named = {site.name: site for site in sites}
    if len(named) != len(sites):
        raise ValueError(f"attention site names repeat: {[site.name for site in sites]}")
    return named
