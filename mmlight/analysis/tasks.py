"""What the analysis needs to know about each task: how to run a teacher-forced forward pass on one
of its batches, which query positions are real, and which metric the robustness runs report."""

from __future__ import annotations

from typing import Literal

import torch

Kind = Literal["image", "lm", "nmt"]

#: The task metric of the robustness runs and whether larger is better.
TASK_METRIC: dict[str, tuple[str, bool]] = {"image": ("top1", True), "lm": ("ppl", False), "nmt": ("bleu", True)}


def task_kind(task) -> Kind:
    """``image``, ``lm`` or ``nmt`` for an mmlight task; a clear error for anything else."""
    from mmlight.tasks import ImageClassifier, LanguageModel, Translator

    for cls, kind in ((ImageClassifier, "image"), (LanguageModel, "lm"), (Translator, "nmt")):
        if isinstance(task, cls):
            return kind
    raise TypeError(f"attention analysis supports ImageClassifier, LanguageModel and Translator, not {type(task).__name__}")


def query_keep(task, batch) -> dict[str, torch.Tensor | None]:
    """Real (non-padding) query positions ``(B, T)`` per stack: ``encoder`` and ``decoder``; the ViT
    has no padding. Cross-attention queries are decoder positions."""
    kind = task_kind(task)
    if kind == "image":
        return {}
    pad = task.model.config.pad_id
    if kind == "lm":
        return {"decoder": batch["input"] != pad}
    return {"encoder": batch["src_mask"], "decoder": batch["tgt_in"] != pad}


@torch.no_grad()
def teacher_forced(task, batch) -> None:
    """One forward pass of ``task.model`` on ``batch`` (no beam search, no metric updates)."""
    kind = task_kind(task)
    if kind == "image":
        task.model(batch[0])
    elif kind == "lm":
        task.model(batch["input"])
    else:
        task.model(batch["src"], batch["tgt_in"], batch["src_mask"])


def batch_size(batch) -> int:
    """Samples in a batch (a tuple/list whose first item is a tensor, or a dict of tensors)."""
    first = batch[0] if isinstance(batch, (tuple, list)) else next(v for v in batch.values() if torch.is_tensor(v))
    return int(first.shape[0])


def map_batch(batch, fn):
    """Apply ``fn`` to every tensor of a (nested) batch of tuples, lists and dicts."""
    if torch.is_tensor(batch):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_batch(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_batch(v, fn) for v in batch)
    return batch


def first_samples(loader, num_samples: int, split: str) -> list:
    """The first ``num_samples`` samples of ``loader`` as a list of batches (the last one cut), on the
    CPU. Raises a ``ValueError`` naming the split's size when it holds fewer."""
    taken, seen = [], 0
    for batch in loader:
        n = batch_size(batch)
        if n == 0:
            continue
        keep = min(n, num_samples - seen)
        taken.append(map_batch(batch, lambda t: t[:keep].cpu()))
        seen += keep
        if seen == num_samples:
            return taken
    raise ValueError(f"--num_samples {num_samples} is larger than the {split} split, which has {seen} samples")
