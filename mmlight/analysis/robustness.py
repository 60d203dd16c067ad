"""Interventions on attention at evaluation, as :class:`AttentionObserver` mask edits, and the runs
that evaluate a task under each (the Devoto thesis protocol).

Which interventions apply, the metric and what its evaluation needs come from the task
(:class:`~mmlight.tasks.protocol.AnalysedTask`):

* :class:`SinkMasking`: in every self-attention layer, the ``k`` keys that receive the most
  attention in that call (per sample; relative to the uniform share, summed over heads and queries)
  are masked for every query.
* :class:`KVEviction`: in the causal decoder self-attention from layer ``skip_layers`` on, each
  query keeps its own key and ``ceil(r * n)`` of its ``n`` past keys: those of **lowest** L2 norm
  (``l2``, Devoto et al. 2024) or the first 4 plus the most recent (``streaming``, StreamingLLM).
  Evaluated teacher-forced (LM) or at each step of beam search through the KV cache (translator),
  this is what each token sees with a cache compressed to that budget.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from mmlight.nn.attention import AttentionObserver, explicit_weights, observe_attention
from mmlight.reweighting import metrics as M
from mmlight.tasks.protocol import check_analysed_task

SINK_LEVELS = (1, 5, 10)
KEEP_RATIOS = (1.0, 0.9, 0.7, 0.5, 0.3, 0.1)
STREAMING_START = 4


def full_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``mask`` expanded to ``(B, nh, Tq, Tk)`` (all True for None)."""
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ones(shape, dtype=torch.bool, device=q.device) if mask is None else mask.expand(shape)


def budget(n: torch.Tensor, ratio: float) -> torch.Tensor:
    """``ceil(ratio * n)`` without float noise (``0.7 * 10`` is 7.000000000000001)."""
    return torch.ceil(n.double() * ratio - 1e-9).long()


class SinkMasking(AttentionObserver):
    """Mask the top-``k`` sink keys of each sample in every self-attention layer (the weights the
    sinks are chosen from are computed with the site's own reweighting module).

    Args:
        k: keys masked per sample and layer.
    """

    def __init__(self, k: int):
        self.k = k

    def edit_mask(self, site, q, k, mask):
        if site.keys_from != site.stack:  # cross-attention: its keys are another stack's positions
            return mask
        keys = full_mask(q, k, mask)  # (B, nh, Tq, Tk)
        reweight = site.module
        weights = explicit_weights(q, k, reweight, keys, q.shape[-1] ** -0.5, reweight.backend)
        _, relative, _ = M.incoming_attention(weights, keys, keys.any(-1))  # (B, Tk)
        top = relative.topk(min(self.k, relative.shape[1]), dim=-1).indices  # (B, k)
        sinks = torch.zeros_like(relative, dtype=torch.bool).scatter_(1, top, True)
        return keys & ~sinks[:, None, None, :]


class KVEviction(AttentionObserver):
    """Evict past keys in causal decoder self-attention (see the module docstring).

    Args:
        ratio: keep ratio ``r`` of the past keys.
        method: ``l2`` (lowest key norm kept) or ``streaming`` (first 4 plus the most recent).
        skip_layers: layers ``0 .. skip_layers - 1`` keep every key.
    """

    def __init__(self, ratio: float, method: str = "l2", skip_layers: int = 2):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"keep ratio must be in (0, 1], got {ratio}")
        if method not in ("l2", "streaming"):
            raise ValueError(f"eviction method must be 'l2' or 'streaming', got {method!r}")
        self.ratio, self.method, self.skip_layers = ratio, method, skip_layers

    def edit_mask(self, site, q, k, mask):
        if site.kind != "decoder_self" or site.layer < self.skip_layers:
            return mask
        keys = full_mask(q, k, mask)  # (B, nh, Tq, Tk)
        q_len, k_len = q.shape[2], k.shape[2]
        own = torch.arange(k_len, device=q.device) == (k_len - q_len + torch.arange(q_len, device=q.device))[:, None]
        past = keys & ~own  # (B, nh, Tq, Tk)
        n_keep = budget(past.sum(-1, keepdim=True), self.ratio)  # (B, nh, Tq, 1)
        if self.method == "l2":
            norms = k.norm(dim=-1)[:, :, None, :].expand_as(past)  # (B, nh, Tq, Tk)
            order = torch.where(past, norms, math.inf).argsort(dim=-1, stable=True)
            rank = order.argsort(dim=-1)  # 0 = lowest norm among the past keys
            kept = past & (rank < n_keep)
        else:
            from_start = past.long().cumsum(-1) - 1  # 0 = the oldest past key
            from_end = past.sum(-1, keepdim=True) - 1 - from_start  # 0 = the newest past key
            start = n_keep.clamp(max=STREAMING_START)
            kept = past & ((from_start < start) | (from_end < n_keep - start))
        return (keys & own) | kept


def evaluate(trainer, task, datamodule, split: str, observer: AttentionObserver | None) -> dict[str, float]:
    """Run ``trainer.validate``/``trainer.test`` on the whole split, under ``observer`` if given (inside
    the task's ``metric_evaluation``, which the caller enters)."""
    run = trainer.validate if split == "val" else trainer.test
    if observer is None:
        results = run(task, datamodule=datamodule, verbose=False)
    else:
        with observe_attention(task, observer):
            results = run(task, datamodule=datamodule, verbose=False)
    return {k: float(v) for k, v in (results[0] if results else {}).items()}


def robustness_rows(
    trainer, task, datamodule, split: str, skip_layers: int = 2, progress=None, keep_ratios=KEEP_RATIOS
) -> list[tuple]:
    """``(intervention, level, metric, value)`` rows of every intervention that applies to ``task``.

    ``none`` (level 0) is the plain evaluation; then the task's ``interventions``: sink masking at ``k``
    in :data:`SINK_LEVELS`, KV eviction (``kv_l2`` and ``kv_streaming``) at each of ``keep_ratios``.
    The metric is the task's ``task_metric``, evaluated inside its ``metric_evaluation`` (whose files go
    to a scratch folder that is deleted afterwards).
    """
    name = task.task_metric.name
    metric = f"{split}/{name}"
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="mmlight-robustness-") as scratch,
        task.metric_evaluation(split, Path(scratch)),
    ):
        for intervention, level, observer in robustness_runs(task, skip_layers, keep_ratios):
            results = evaluate(trainer, task, datamodule, split, observer)
            if metric not in results:
                raise RuntimeError(f"the {split} run logged no {metric} (it logged {sorted(results)})")
            rows.append((intervention, level, name, results[metric]))
            if progress is not None:
                progress(1)
    return rows


def robustness_runs(
    task, skip_layers: int = 2, keep_ratios=KEEP_RATIOS
) -> list[tuple[str, float, AttentionObserver | None]]:
    """``(intervention, level, observer)`` of every evaluation :func:`robustness_rows` makes for ``task``."""
    check_analysed_task(task)
    unknown = set(task.interventions) - {"sink_masking", "kv_eviction"}
    if unknown:
        raise ValueError(
            f"{type(task).__name__}.interventions names unknown interventions {sorted(unknown)}; "
            "known: sink_masking, kv_eviction"
        )
    runs: list[tuple[str, float, AttentionObserver | None]] = [("none", 0, None)]
    if "sink_masking" in task.interventions:
        runs += [("sink_masking", k, SinkMasking(k)) for k in SINK_LEVELS]
    if "kv_eviction" in task.interventions:
        for method in ("l2", "streaming"):
            runs += [(f"kv_{method}", r, KVEviction(r, method, skip_layers)) for r in keep_ratios]
    return runs
