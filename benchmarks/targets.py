"""The performance targets of the MultiMax kernels: the one definition, which ``report.py`` judges a GPU
run's records against and ``tools/render_docs.py`` renders into BENCHMARKS.md and docs/kernels.md.

Every ratio is measured against a baseline timed in the same run, on the same inputs (bf16).
"""

from __future__ import annotations

from typing import NamedTuple


class Target(NamedTuple):
    """One target.

    Args:
        label: what is measured, as the tables name it.
        bound: the ratio or share that meets it.
        at_most: True when the measured value must be at most ``bound``, False when at least.
    """

    label: str
    bound: float
    at_most: bool = True


#: Keys are what ``report.py`` measures; ``attention`` keys are (op, causal length or 0 for any, direction).
TARGETS: dict[str, Target] = {
    "attention_fwd": Target("attention (256, 6, 197, 64) forward / SDPA flash", 1.2),
    "attention_bwd": Target("attention (256, 6, 197, 64) backward / SDPA flash", 1.5),
    "causal_1024_fwd": Target("causal attention N = 1,024 forward / SDPA flash", 1.3),
    "causal_1024_bwd": Target("causal attention N = 1,024 backward / SDPA flash", 2.0),
    "causal_4096_fwd": Target("causal attention N = 4,096 forward / SDPA flash", 1.3),
    "causal_4096_bwd": Target("causal attention N = 4,096 backward / SDPA flash", 2.0),
    "step": Target("DeiT-small step, MultiMax tuned / softmax (SDPA flash), eager", 1.05),
    "cross_entropy": Target("MultiMax cross-entropy fw + bw / F.cross_entropy (best setting)", 0.5),
    "rowwise": Target("row-wise forward, best config, of the measured copy bandwidth", 0.7, at_most=False),
}
