"""Batches as the analysis handles them, whatever the task: their size, a map over their tensors and
the first samples of a split. What a task's batches mean is the task's to say
(:class:`mmlight.tasks.protocol.AnalysedTask`)."""

from __future__ import annotations

import torch


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
        taken.append(map_batch(batch, lambda t, keep=keep: t[:keep].cpu()))
        seen += keep
        if seen == num_samples:
            return taken
    raise ValueError(f"--num_samples {num_samples} is larger than the {split} split, which has {seen} samples")


def teacher_forced_pass(task, batches: list, observer) -> None:
    """Run ``task`` teacher-forced on ``batches`` (CPU batches, moved to the task's device one at a
    time) under the :class:`~mmlight.nn.attention.AttentionObserver` ``observer``, in eval mode and
    without gradients (the network's mode is restored after). Before each batch, ``observer.query_keep``
    is set to the task's per-stack mask of the query positions that count (``task.query_keep``)."""
    from mmlight.nn.attention import network_of, observe_attention

    network = network_of(task)
    was_training = network.training
    network.eval()
    try:
        with torch.no_grad(), observe_attention(task, observer):
            for batch in batches:
                batch = map_batch(batch, lambda t: t.to(task.device))
                observer.query_keep = task.query_keep(batch)
                task.teacher_forced(batch)
    finally:
        network.train(was_training)
