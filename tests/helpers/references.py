"""References the tests share: statistics and schedules written out by plain loops."""

from __future__ import annotations

import math

import numpy as np


def naive_m_and_s(x, p, keep, eps_m, eps_s):
    """M and S of one row by a plain loop over the attended keys (no masking tricks)."""
    xs = [float(v) for v, k in zip(x, keep) if k]
    ps = [float(v) for v, k in zip(p, keep) if k]
    mean = sum(xs) / len(xs)
    c = [v - mean for v in xs]
    i_max = max(range(len(c)), key=c.__getitem__)
    relevant = [j for j in range(len(c)) if eps_m < c[j] < c[i_max]]
    m = 1 - sum(ps[i_max] - ps[j] for j in relevant) / len(relevant) if relevant else math.nan
    soft = np.exp(np.array(c) - max(c))
    s_ref = float((soft / soft.sum()).min())
    small = [j for j in range(len(c)) if c[j] < eps_s]
    s = sum(math.exp((s_ref - ps[j]) / s_ref - 1) for j in small) / len(small) if small else math.nan
    return m, s


def lrs(optimizer, scheduler, steps: int) -> list[float]:
    """The learning rate of the first parameter group at each of ``steps`` optimiser steps, as the
    scheduler sets it (stepping the optimiser, then the scheduler, as Lightning does)."""
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen
