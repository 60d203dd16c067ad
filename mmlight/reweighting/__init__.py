"""Reweighting functions: map scores to weights on the simplex over the last dimension.

``build(name, **kwargs)`` returns an ``nn.Module`` called as ``fn(scores, mask=None)``; ``mask`` is
boolean, broadcastable to ``scores``, True = keep. Names: see :func:`available`.

Every module of this package is imported here, so a function is added by one new file that
subclasses :class:`Reweighting` and decorates it with ``@register("name")``: configs accept the
name and the generic tests cover it (see docs/architecture.md, "How to extend").
"""

import importlib
import pkgutil
import sys

from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.fused import FusedOps
from mmlight.reweighting.metrics import entropy, fraction_below, multimodality, sparsity
from mmlight.reweighting.multimax import MultiMax, multimax_sigma
from mmlight.reweighting.registry import available, build, register
from mmlight.reweighting.softmax import Softmax
from mmlight.reweighting.sparse import Entmax15, EvSoftmax, Sparsemax, TopK
from mmlight.reweighting.spec import ReweightingSpec

# The modules the lines above did not import, so that a new file's ``@register`` runs with the package.
for _module in pkgutil.iter_modules(__path__):
    if f"{__name__}.{_module.name}" not in sys.modules:
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "Reweighting",
    "ReweightingSpec",
    "FusedOps",
    "build",
    "register",
    "available",
    "Softmax",
    "MultiMax",
    "multimax_sigma",
    "Sparsemax",
    "Entmax15",
    "EvSoftmax",
    "TopK",
    "multimodality",
    "sparsity",
    "entropy",
    "fraction_below",
]
