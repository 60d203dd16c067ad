"""Triton kernels for MultiMax (and plain softmax as their ``ORDER=0`` case).

* :func:`multimax_softmax`: row-wise ``softmax(sigma(scale * x))``, masked (``rowwise.py``);
* :func:`multimax_attention`: FlashAttention-style fused attention with sigma on the scores (``attention.py``);
* :func:`multimax_cross_entropy`: chunked ``cross_entropy(sigma(logits))`` for large vocabularies
  (``cross_entropy.py``).

``sigma.py`` holds the Triton form of sigma shared by all three. Every kernel is tested against the
eager definition in :mod:`mmlight.reweighting`; on a machine without a GPU they run under
``TRITON_INTERPRET=1``. Importing this package imports Triton, so the rest of mmlight imports it
only when the ``triton`` backend is used.
"""

from mmlight.kernels.attention import multimax_attention
from mmlight.kernels.cross_entropy import multimax_cross_entropy
from mmlight.kernels.rowwise import multimax_softmax

__all__ = ["multimax_softmax", "multimax_attention", "multimax_cross_entropy"]
