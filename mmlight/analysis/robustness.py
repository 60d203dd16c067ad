"""Interventions on attention at evaluation, as :class:`AttentionObserver` mask edits, and the runs
that evaluate a task under each (the Devoto thesis protocol).

Which interventions apply, the metric and what its evaluation needs come from the task
(:class:`~mmlight.tasks.protocol.AnalysedTask`):

* :class:`SinkMasking`: in every self-attention layer, the ``k`` keys that receive the most
  attention in that call (per sample; relative to the uniform share, summed over heads and queries)
  are masked for every query.
* :class:`~mmlight.analysis.kv_eviction.KVEviction`: in the causal decoder self-attention from layer
  ``skip_layers`` on, each query keeps its own key and ``ceil(r * n)`` of its ``n`` past keys, chosen
  by a named method (:data:`~mmlight.analysis.kv_eviction.METHODS`). Evaluated teacher-forced (LM) or
  at each step of beam search through the KV cache (translator), this is what each token sees with a
  cache compressed to that budget.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from mmlight.analysis.kv_eviction import KEEP_RATIOS, KVEviction, budget, check_evictable, full_mask, method
from mmlight.nn.attention import AttentionObserver, explicit_weights, observe_attention
from mmlight.reweighting import metrics as M
from mmlight.tasks.protocol import check_analysed_task

__all__ = ["KEEP_RATIOS", "KVEviction", "SinkMasking", "budget", "full_mask", "robustness_rows", "robustness_runs"]

SINK_LEVELS = (1, 5, 10)
#: The eviction methods of the robustness runs by default (``qfilters`` needs calibrated filters).
KV_METHODS = ("l2", "streaming", "expected_attention", "oracle", "random")


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
    trainer,
    task,
    datamodule,
    split: str,
    skip_layers: int = 2,
    progress=None,
    keep_ratios=KEEP_RATIOS,
    kv_methods=KV_METHODS,
    method_options=None,
    attention_losses: list | None = None,
) -> list[tuple]:
    """``(intervention, level, metric, value)`` rows of every intervention that applies to ``task``.

    ``none`` (level 0) is the plain evaluation; then the task's ``interventions``: sink masking at ``k``
    in :data:`SINK_LEVELS`, KV eviction (``kv_<method>`` for each of ``kv_methods``, built with
    ``method_options[method]``) at each of ``keep_ratios`` (the level; the fraction dropped, kvpress's
    compression ratio, is ``1 - level``).
    The metric is the task's ``task_metric``, evaluated inside its ``metric_evaluation`` (whose files go
    to a scratch folder that is deleted afterwards). Each KV eviction run also measures the attention
    loss of its method and of the oracle at the same budget, over the same evaluation: with
    ``attention_losses`` given, ``(intervention, level, *row)`` is appended to it for each row of
    :meth:`~mmlight.analysis.kv_eviction.KVEviction.loss_rows`.
    """
    name = task.task_metric.name
    metric = f"{split}/{name}"
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="mmlight-robustness-") as scratch,
        task.metric_evaluation(split, Path(scratch)),
    ):
        runs = robustness_runs(task, skip_layers, keep_ratios, kv_methods, method_options)
        for intervention, level, observer in runs:
            results = evaluate(trainer, task, datamodule, split, observer)
            if metric not in results:
                raise RuntimeError(f"the {split} run logged no {metric} (it logged {sorted(results)})")
            rows.append((intervention, level, name, results[metric]))
            if attention_losses is not None and isinstance(observer, KVEviction):
                attention_losses += [(intervention, level, *row) for row in observer.loss_rows()]
            if progress is not None:
                progress(1)
    return rows


def robustness_runs(
    task, skip_layers: int = 2, keep_ratios=KEEP_RATIOS, kv_methods=KV_METHODS, method_options=None
) -> list[tuple[str, float, AttentionObserver | None]]:
    """``(intervention, level, observer)`` of every evaluation :func:`robustness_rows` makes for ``task``;
    a ``ValueError`` when ``skip_layers`` leaves no layer to evict in."""
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
        check_evictable(task, skip_layers)
        options = method_options or {}
        for name in kv_methods:
            runs += [
                (f"kv_{name}", r, KVEviction(r, method(name, **options.get(name, {})), skip_layers, measure_loss=True))
                for r in keep_ratios
            ]
    return runs
