"""What the rest of mmlight asks of a task, as two protocols, so that nothing switches on the type of a task:
:class:`TrainedTask`, what the throughput logs and the ``compile`` option read during training, and
:class:`AnalysedTask`, what ``mmlight analyze``, its robustness runs and the ``AttentionStats`` callback read.

A task satisfies them by having their members; nothing is registered. Its
network (the task itself or its ``.model``, see :func:`~mmlight.nn.attention.network_of`) names its
attention layers with ``attention_sites()`` (:class:`~mmlight.nn.sites.AttentionSite` records by
name) and its blocks with ``blocks()`` (:class:`~mmlight.nn.sites.Block` records).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn

from mmlight.nn.attention import network_of
from mmlight.tasks.compiling import CompiledCalls

#: The interventions of the robustness runs: ``sink_masking`` (every task) and ``kv_eviction`` (a task
#: with a causal decoder, scored token by token or decoding through its KV cache, where evicting past
#: keys is what a compressed cache does).
Intervention = Literal["sink_masking", "kv_eviction"]


@dataclass(frozen=True)
class TaskMetric:
    """The evaluation metric that the robustness runs report.

    Args:
        name: logged as ``{split}/{name}`` by ``trainer.validate`` (``val``) and ``trainer.test`` (``test``).
        higher_is_better: the metric's direction (accuracy, BLEU: True; perplexity: False).
    """

    name: str
    higher_is_better: bool


@dataclass(frozen=True)
class ExampleInputs:
    """What the per-example figures show of a batch's inputs; text fills ``tokens``, vision ``image``.

    Args:
        tokens: per stack, the token ids ``(B, T)`` at its positions (labelled with the data's vocabulary).
        image: the images ``(B, C, H, W)`` that the task's network maps to class scores.
        patch_grid: ``(rows, cols)`` of the image's patches, row-major after ``prefix`` tokens.
        prefix: tokens before the patches (a CLS token).
        cam_layer: the layer Grad-CAM reads (its output is ``(B, prefix + rows * cols, d)``).
    """

    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    image: torch.Tensor | None = None
    patch_grid: tuple[int, int] | None = None
    prefix: int = 0
    cam_layer: nn.Module | None = None


@runtime_checkable
class AnalysedTask(Protocol):
    """The members a task needs for attention analysis and robustness runs.

    ``task_metric`` and ``interventions`` may be class attributes. Every method takes a batch as the
    task's DataModule yields it (after ``on_after_batch_transfer``), already on the task's device.
    """

    #: the metric the robustness runs report (a :class:`TaskMetric`)
    task_metric: TaskMetric
    #: the interventions the task supports: ``sink_masking``, and ``kv_eviction`` for a causal decoder
    interventions: tuple[Intervention, ...]

    def teacher_forced(self, batch) -> None:
        """One forward pass of the network on ``batch``, teacher-forced (no decoding, no metric
        updates); the caller turns gradients off and observes the attention calls."""

    def query_keep(self, batch) -> dict[str, torch.Tensor | None]:
        """Per stack (an ``AttentionSite.stack``), the ``(B, T)`` bool mask of the query positions that
        count (False for padding); a stack left out, or None, counts every position."""

    def example_inputs(self, batch) -> ExampleInputs:
        """The inputs of ``batch`` as the per-example figures draw them."""

    def metric_evaluation(self, split: str, scratch: Path) -> AbstractContextManager:
        """A context in which ``trainer.validate``/``trainer.test`` of ``split`` logs the task metric
        over the whole split, under whatever observer is active; files that the evaluation writes go
        under ``scratch``. The task's hyperparameters are left as they are."""


@runtime_checkable
class TrainedTask(Protocol):
    """The members a task needs for the throughput logs (:class:`~mmlight.callbacks.Throughput`, on by
    default) and the ``compile`` option; a task without them trains, but logs no samples/s, tokens/s or MFU
    and warns once per fit.
    """

    #: True when batches hold tokens (tokens/s is logged), False for images
    counts_tokens: bool
    #: the network's calls under the task's ``compile`` option: ``CompiledCalls(compile, network)`` built in
    #: ``__init__`` from an argument ``compile: CompileOption = False`` (:mod:`mmlight.tasks.compiling`)
    compiled: CompiledCalls

    def batch_counts(self, batch) -> tuple[int, int | None]:
        """``(samples, tokens)`` of a training batch (tokens None when ``counts_tokens`` is False)."""

    def training_loss(self, batch, network: nn.Module) -> torch.Tensor:
        """``network``'s training loss on ``batch``, uncompiled: what the FLOP count of a step traces, on a
        meta-device copy of the network."""


def protocol_members(protocol: type = AnalysedTask) -> list[str]:
    """The names a task must have: the attributes and methods of ``protocol``."""
    return [name for name in {**protocol.__annotations__, **vars(protocol)} if not name.startswith("_")]


def check_analysed_task(task) -> None:
    """A ``TypeError`` naming what ``task`` lacks for attention analysis, before any work."""
    missing = [name for name in protocol_members() if not hasattr(task, name)]
    try:
        network = network_of(task)
    except TypeError as err:
        missing.append(f"attention_sites() ({err})")
    else:
        missing += [f"{name}() on {type(network).__name__}" for name in ("blocks",) if not hasattr(network, name)]
    if missing:
        raise TypeError(
            f"{type(task).__name__} lacks what attention analysis needs: {', '.join(missing)} "
            "(see mmlight.tasks.protocol.AnalysedTask)"
        )
