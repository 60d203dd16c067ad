"""Massive activations (Sun et al. 2024, "Massive activations in large language models"): the few
hidden-state entries whose magnitude is hundreds to thousands of times the typical one.

Forward hooks on the network's ``blocks()`` read each block's output ``(B, T, d)`` (the hidden state
that the next block reads). Per sample and block, over the sample's real positions (padding left
out) and every feature dimension:

* the median magnitude ``med`` (the lower median of ``|h|``, as :func:`torch.median`);
* the ``top_k`` largest magnitudes, each with its position, token and feature dimension, and its
  ratio to ``med`` of its own sample;
* the count of *massive* entries: magnitude above ``min_magnitude`` and above ``min_ratio * med``
  (the paper's criterion: about 100, and about 1,000 times the median).

Per block, the means over samples (of the median, of the i-th largest magnitude and of the ratio of
the largest to the median) and the ``top_k`` largest entries over all samples are reported.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from mmlight.analysis.batches import batch_size, map_batch
from mmlight.nn.attention import network_of
from mmlight.tasks.inference import evaluating


@dataclass
class MassiveSettings:
    """What :func:`massive_activations` reports.

    Args:
        top_k: the largest entries listed per block (over all samples), and the i-th largest averaged
            over the samples that have an i-th real entry, for ``i <= top_k`` (None where none has).
        min_magnitude: an entry is massive above this magnitude ...
        min_ratio: ... and above this multiple of its sample's median magnitude.
    """

    top_k: int = 5
    min_magnitude: float = 100.0
    min_ratio: float = 1000.0

    def __post_init__(self):
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")


class _BlockSums:
    """Running sums of one block over samples, and its largest entries so far."""

    def __init__(self, block, k: int):
        self.block, self.k = block, k
        self.samples = 0
        self.median = 0.0
        self.ratio = 0.0
        self.ratio_samples = 0  # samples with a median above zero (a ratio is defined)
        self.top_sum = torch.zeros(k, dtype=torch.float64)
        self.top_count = torch.zeros(k, dtype=torch.int64)  # samples that have an i-th real entry
        self.massive = 0
        self.top: list[dict] = []

    def summary(self) -> dict:
        n = self.samples
        return {
            "stack": self.block.stack,
            "layer": self.block.layer,
            "samples": n,
            "median": self.median / n if n else None,
            "top_mean": [s / c if c else None for s, c in zip(self.top_sum.tolist(), self.top_count.tolist())]
            if n
            else [],
            "ratio": self.ratio / self.ratio_samples if self.ratio_samples else None,
            "massive": self.massive,
            "top": self.top,
        }


class MassiveActivations:
    """Forward hooks on ``network.blocks()`` that reduce each block's output to :class:`_BlockSums`.

    Before each forward pass, :meth:`next_batch` says which positions are real and which tokens sit
    there; remove the hooks with :meth:`remove`.

    Args:
        network: the task's network.
        settings: the thresholds and ``top_k``.
    """

    def __init__(self, network, settings: MassiveSettings):
        self.settings = settings
        self.sums = {block.name: _BlockSums(block, settings.top_k) for block in network.blocks()}
        self.keep: dict = {}
        self.tokens: dict = {}
        self.first = 0  # index of the batch's first sample among all samples seen
        self._handles = [
            block.module.register_forward_hook(self._hook(self.sums[block.name])) for block in network.blocks()
        ]

    def next_batch(self, keep: dict, tokens: dict, first: int) -> None:
        """The batch about to run: per stack its ``(B, T)`` real positions (None: all) and token ids."""
        self.keep, self.tokens, self.first = keep, tokens, first

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, sums: _BlockSums):
        def hook(module, args, output):
            self._reduce(sums, output[:, sums.block.prefix :].detach())

        return hook

    def _reduce(self, sums: _BlockSums, hidden: torch.Tensor) -> None:
        B, T, d = hidden.shape
        keep = self.keep.get(sums.block.stack)
        keep = torch.ones(B, T, dtype=torch.bool, device=hidden.device) if keep is None else keep.to(hidden.device)
        mags = hidden.abs().float()  # (B, T, d)
        flat = torch.where(keep[:, :, None], mags, math.nan).reshape(B, T * d)  # (B, T * d), NaN at padding
        median = flat.nanmedian(dim=1).values  # (B,)
        k = min(self.settings.top_k, T * d)
        values, index = torch.nan_to_num(flat, nan=-1.0).topk(k, dim=1)  # (B, k): padding sorts last
        real = keep.any(1)  # (B,) samples with at least one real position
        massive = (mags > self.settings.min_magnitude) & (mags > self.settings.min_ratio * median[:, None, None])
        sums.massive += int((massive & keep[:, :, None]).sum())
        sums.samples += int(real.sum())
        sums.median += float(median[real].double().sum())
        positive = real & (median > 0)
        sums.ratio += float((values[:, 0] / median)[positive].double().sum())
        sums.ratio_samples += int(positive.sum())
        present = real[:, None] & (values >= 0)  # (B, k): a real entry, not the padding stand-in
        sums.top_sum[:k] += torch.where(present, values.double(), 0.0).sum(0).cpu()
        sums.top_count[:k] += present.sum(0).cpu()
        tokens = self.tokens.get(sums.block.stack)
        found = []
        for b in real.nonzero().flatten().tolist():
            for value, at in zip(values[b].tolist(), index[b].tolist()):
                if value < 0:  # a padding entry: the sample has fewer than k real ones
                    continue
                position, dim = divmod(at, d)
                med = float(median[b])
                found.append(
                    {
                        "magnitude": value,
                        "value": float(hidden[b, position, dim]),
                        "ratio": value / med if med > 0 else None,
                        "sample": self.first + b,
                        "position": position,
                        "dim": dim,
                        "token": None if tokens is None else int(tokens[b, position]),
                    }
                )
        sums.top = sorted(sums.top + found, key=lambda e: -e["magnitude"])[: self.settings.top_k]


@torch.no_grad()
def massive_activations(task, batches: list, settings: MassiveSettings | None = None) -> dict:
    """Massive activations of ``task``'s network on ``batches`` (see the module docstring).

    Args:
        task: a task with ``query_keep`` and ``example_inputs`` (:class:`~mmlight.tasks.protocol.AnalysedTask`)
            whose network has ``blocks()``; run in eval mode, the mode restored after.
        batches: CPU batches (moved to the task's device one at a time).
        settings: the thresholds; :class:`MassiveSettings` by default.

    Returns:
        ``{"settings", "blocks": {block: {"stack", "layer", "samples", "median", "top_mean", "ratio",
        "massive", "top": [{"magnitude", "value", "ratio", "sample", "position", "dim", "token"}]}}}``.
    """
    settings = settings or MassiveSettings()
    network, device = network_of(task), task.device
    recorder = MassiveActivations(network, settings)
    seen = 0
    try:
        with evaluating(task):
            for batch in batches:
                batch = map_batch(batch, lambda t: t.to(device))
                recorder.next_batch(task.query_keep(batch), task.example_inputs(batch).tokens, seen)
                task.teacher_forced(batch)
                seen += batch_size(batch)
    finally:
        recorder.remove()
    return {"settings": asdict(settings), "blocks": {name: s.summary() for name, s in recorder.sums.items()}}


def massive_rows(result: dict) -> list[tuple[str, str, float | None]]:
    """``(block, metric, value)`` rows: ``median``, ``top1`` .. ``top{k}`` (means over the samples with as
    many real entries),
    ``ratio`` (mean over samples of the largest magnitude over the median) and ``massive`` (count)."""
    rows = []
    for name, entry in result["blocks"].items():
        rows.append((name, "median", entry["median"]))
        rows += [(name, f"top{i + 1}", v) for i, v in enumerate(entry["top_mean"])]
        rows += [(name, "ratio", entry["ratio"]), (name, "massive", entry["massive"])]
    return rows
