"""Triton kernels for MultiMax (and plain softmax as their ``ORDER=0`` case).

* :func:`multimax_softmax`: row-wise ``softmax(sigma(scale * x))``, masked (``rowwise.py``);
* :func:`multimax_attention`: FlashAttention-style fused attention with sigma on the scores (``attention.py``);
* :func:`multimax_cross_entropy`: chunked ``cross_entropy(sigma(logits))`` for large vocabularies
  (``cross_entropy.py``).

``sigma.py`` holds the Triton form of sigma shared by all three. Every kernel is tested against the
eager definition in :mod:`mmlight.reweighting`; on a machine without a GPU they run under
``TRITON_INTERPRET=1``. ``runtime.py`` says what they run on without importing Triton; the three
functions are imported (and Triton with them) on first use, so that choosing a backend never
needs Triton. This package imports nothing from the rest of mmlight.
"""

__all__ = ["multimax_softmax", "multimax_attention", "multimax_cross_entropy"]


def __getattr__(name: str):
    if name == "multimax_softmax":
        from mmlight.kernels.rowwise import multimax_softmax as function
    elif name == "multimax_attention":
        from mmlight.kernels.attention import multimax_attention as function
    elif name == "multimax_cross_entropy":
        from mmlight.kernels.cross_entropy import multimax_cross_entropy as function
    else:
        raise AttributeError(f"module 'mmlight.kernels' has no attribute {name!r}")
    # kept in the module: the call sites import it on every forward pass, and a later lookup then
    # finds it without coming here
    globals()[name] = function
    return function
