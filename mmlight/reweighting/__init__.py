"""Reweighting functions: map scores to weights on the simplex over the last dimension.

``build(name, **kwargs)`` returns an ``nn.Module`` called as ``fn(scores, mask=None)``; ``mask`` is
boolean, broadcastable to ``scores``, True = keep. Names: see :func:`available`.
"""

from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.metrics import entropy, fraction_below, multimodality, sparsity
from mmlight.reweighting.multimax import MultiMax, multimax_sigma
from mmlight.reweighting.registry import available, build, register
from mmlight.reweighting.softmax import Softmax
from mmlight.reweighting.sparse import Entmax15, EvSoftmax, Sparsemax, TopK

__all__ = [
    "Reweighting", "build", "register", "available",
    "Softmax", "MultiMax", "multimax_sigma", "Sparsemax", "Entmax15", "EvSoftmax", "TopK",
    "multimodality", "sparsity", "entropy", "fraction_below",
]
