"""Independent NumPy references for the reweighting functions, one row at a time.

Written from the definitions, without the package's masking helpers or the ``entmax`` library, so
that a test compares two separate derivations.
"""

import numpy as np


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def sparsemax(z):
    """Projection onto the simplex (sort-based, Held et al. 1974)."""
    u = np.sort(z)[::-1]
    css = np.cumsum(u)
    k = np.arange(1, len(z) + 1)
    support = u - (css - 1) / k > 0
    k_max = k[support][-1]
    tau = (css[k_max - 1] - 1) / k_max
    return np.maximum(z - tau, 0)


def entmax15(z, iters=200):
    """1.5-entmax by bisection on tau: p_i = max(z_i / 2 - tau, 0) ** 2 sums to 1."""
    z = z / 2
    lo, hi = z.max() - 1.0, z.max()  # at tau = max - 1 the largest term alone is 1
    for _ in range(iters):
        tau = (lo + hi) / 2
        if (np.maximum(z - tau, 0) ** 2).sum() >= 1:
            lo = tau
        else:
            hi = tau
    return np.maximum(z - (lo + hi) / 2, 0) ** 2


def evsoftmax(z):
    w = (z >= z.mean()).astype(float) * np.exp(z - z.max())
    return w / w.sum()


def topk(z, k):
    keep = z >= np.sort(z)[::-1][min(k, len(z)) - 1]
    e = np.where(keep, np.exp(z - z.max()), 0.0)
    return e / e.sum()


def multimax_sigma_piecewise(x, b, d, t_b, t_d):
    """First-order sigma in the paper's Eq. 5 form (slopes t_b below b, t_d above d)."""
    return np.where(x < b, t_b * x + (1 - t_b) * b, np.where(x > d, t_d * x + (1 - t_d) * d, x))


def apply_masked(fn, scores, mask):
    """Apply a row function to the kept entries of each row; masked entries get 0, empty rows 0."""
    scores = np.asarray(scores, dtype=np.float64)
    out = np.zeros_like(scores)
    flat_s = scores.reshape(-1, scores.shape[-1])
    flat_m = np.broadcast_to(mask, scores.shape).reshape(-1, scores.shape[-1])
    flat_o = out.reshape(-1, scores.shape[-1])
    for row, (s, m) in enumerate(zip(flat_s, flat_m)):
        m = m & np.isfinite(s)
        if m.any():
            flat_o[row, m] = fn(s[m])
    return out


def check_compile_backend(module, scores, mask):
    """``module`` on the ``compile`` backend equals its eager reference, forward and input gradient."""
    import torch

    x = scores.clone().requires_grad_()
    module.backend = "compile"
    got = module(x, mask)
    (got * torch.linspace(-1, 1, got.shape[-1])).sum().backward()
    module.backend = "reference"
    x_ref = scores.clone().requires_grad_()
    want = module(x_ref, mask)
    (want * torch.linspace(-1, 1, want.shape[-1])).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-6, rtol=1e-5)
