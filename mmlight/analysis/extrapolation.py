"""Length extrapolation of a language model: teacher-forced perplexity at multiples of its training
context, overall and by position within the window.

The evaluation stream is the split's tokens in order, as the task's evaluation batches give them
(:func:`stream_from_batches`: each position's input, target and whether it is scored). For each
multiple ``m`` of the training context ``L``, the same first ``N`` positions of the stream are cut
into windows of ``m * L`` positions and each window runs on its own from its first token (nothing
carried across windows), so every multiple scores the same tokens and the perplexities compare
directly. The position of a token is its index in its window; a bucket of ``s`` positions holds
positions ``[i * s, min((i + 1) * s, m * L))``.

A model whose positions are a learned table cannot embed a position past it: a multiple whose window
is longer is reported as not defined, with the reason. Sinusoidal positions are a function of the
position, and are evaluated past the model's table as fairseq's sinusoidal embedding does (the table
is extended for the evaluation and put back after it). Rotary positions (``rope``) and no positions
(``none``, NoPE) have no table at all: every multiple is evaluated. The rule that applied is stated in
the result (``position_rule``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmlight.models.transformer import TokenPositionEmbedding, sinusoidal_table
from mmlight.nn.attention import network_of
from mmlight.tasks.inference import evaluating

#: The multiples of the training context evaluated by default.
MULTIPLES = (1, 2, 4, 8)
#: Positions whose logits are formed at once (bounds the ``(positions, vocabulary)`` logits in memory).
LOGIT_CHUNK = 1024


@dataclass(frozen=True)
class Stream:
    """A split's positions in order.

    Args:
        inputs: ``(N,)`` the token read at each position.
        targets: ``(N,)`` the token predicted there.
        scored: ``(N,)`` bool, whether the prediction counts (the task's loss mask).
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    scored: torch.Tensor

    def __len__(self) -> int:
        return self.inputs.shape[0]


def stream_from_batches(batches: Iterable[dict], pad_id: int, num_positions: int) -> Stream:
    """The first ``num_positions`` positions (or all there are) of the evaluation batches
    ``{input, target, loss_mask[, start]}``, row after row, padding (``input == pad_id``) left out.

    Rows of a stream cut into windows carry ``start``, the stream index of their first position
    (:class:`mmlight.data.text.EvalWindows`); positions an earlier row already held (the context of
    overlapping windows) are left out, so each position of the stream appears once. Rows without it
    (independent sequences, e.g. the recall task's) follow one another.
    """
    parts: list[tuple[torch.Tensor, ...]] = []
    have, covered = 0, 0
    for batch in batches:
        starts = batch.get("start")
        for b in range(batch["input"].shape[0]):
            keep = batch["input"][b] != pad_id  # (T,)
            if starts is not None:
                index = int(starts[b]) + torch.arange(keep.shape[0])  # (T,) stream index of each position
                keep &= index >= covered
                covered = max(covered, int(index[keep].max()) + 1) if keep.any() else covered
            parts.append((batch["input"][b][keep], batch["target"][b][keep], batch["loss_mask"][b][keep]))
            have += int(keep.sum())
            if have >= num_positions:
                return Stream(*(torch.cat(p)[:num_positions].cpu() for p in zip(*parts)))
    if not parts:
        return Stream(*(torch.zeros(0, dtype=d) for d in (torch.int64, torch.int64, torch.bool)))
    return Stream(*(torch.cat(p).cpu() for p in zip(*parts)))


def position_embeddings(network: nn.Module) -> list[TokenPositionEmbedding]:
    return [m for m in network.modules() if isinstance(m, TokenPositionEmbedding)]


def position_limit(network: nn.Module) -> int | None:
    """The longest window ``network`` can embed: the size of its smallest learned position table;
    None when its positions are a function of the position (no limit)."""
    tables = [m.positions.num_embeddings for m in position_embeddings(network) if m.positions is not None]
    return min(tables) if tables else None


def position_rule(network: nn.Module) -> str:
    """How ``network``'s positions bound the evaluated windows, one sentence per kind of position it has."""
    rules = {
        "learned": "learned position table of {n} positions: a longer window is not defined",
        "sinusoidal": "sinusoidal positions: the table is extended to the window, every multiple evaluated",
        "rope": "rotary positions (no table): every multiple evaluated",
        "none": "no position embedding (NoPE): every multiple evaluated",
    }
    kinds = {m.kind: m.max_positions for m in position_embeddings(network)}
    return "; ".join(rules[kind].format(n=n) for kind, n in kinds.items())


@contextmanager
def positions_up_to(network: nn.Module, length: int) -> Iterator[None]:
    """Sinusoidal position tables of ``network`` extended to ``length`` positions for the block (the
    same function of the position, further out), and put back after it."""
    saved = []
    for module in position_embeddings(network):
        if module.kind == "sinusoidal" and module.max_positions < length:
            saved.append((module, module.sinusoid, module.max_positions))
            module.sinusoid = sinusoidal_table(length, module.sinusoid.shape[1]).to(module.sinusoid.device)
            module.max_positions = length
    try:
        yield
    finally:
        for module, table, limit in saved:
            module.sinusoid, module.max_positions = table, limit


def bucket_bounds(length: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the position buckets of a window of ``length``: ``size`` positions each,
    the last one shorter when ``size`` does not divide ``length``."""
    if length < 1 or size < 1:
        raise ValueError(f"window length and bucket size must be >= 1, got {length} and {size}")
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def perplexity(nll: float, count: int) -> float | None:
    """``exp(nll / count)``; None for no scored token."""
    return math.exp(nll / count) if count else None


def buckets(nll: torch.Tensor, count: torch.Tensor, size: int) -> list[dict]:
    """Per-position NLL sums and scored counts ``(W,)`` pooled into buckets of ``size`` positions."""
    rows = []
    for start, stop in bucket_bounds(nll.shape[0], size):
        total, n = float(nll[start:stop].sum()), int(count[start:stop].sum())
        rows.append({"start": start, "stop": stop, "nll": total, "count": n, "ppl": perplexity(total, n)})
    return rows


@torch.no_grad()
def position_nll(network: nn.Module, stream: Stream, length: int, per_batch: int, progress=None):
    """Summed NLL (float64) and scored count ``(length,)`` per window position, over the windows of
    ``length`` positions that tile ``stream`` (whose length is a multiple of ``length``).

    Args:
        network: a :class:`~mmlight.models.TransformerLM` (hidden states from ``network(tokens)``,
            scores from ``network.logits``).
        per_batch: windows per forward pass.
        progress: optional callable ``progress(windows_done)`` after each forward pass.
    """
    device = next(network.parameters()).device
    inputs, targets, scored = (t.view(-1, length) for t in (stream.inputs, stream.targets, stream.scored))
    nll = torch.zeros(length, dtype=torch.float64)
    count = torch.zeros(length, dtype=torch.int64)
    for first in range(0, inputs.shape[0], per_batch):
        rows = slice(first, first + per_batch)
        hidden = network(inputs[rows].to(device))  # (b, W, d)
        mask = scored[rows]  # (b, W)
        position = torch.arange(length).expand_as(mask)[mask]  # (n,)
        picked, wanted = hidden[mask.to(device)], targets[rows][mask].to(device)  # (n, d), (n,)
        for at in range(0, picked.shape[0], LOGIT_CHUNK):
            logits = network.logits(picked[at : at + LOGIT_CHUNK]).float()  # (c, V)
            token_nll = F.cross_entropy(logits, wanted[at : at + LOGIT_CHUNK], reduction="none")  # (c,)
            nll.index_add_(0, position[at : at + LOGIT_CHUNK], token_nll.double().cpu())
        count += mask.sum(0)
        if progress is not None:
            progress(mask.shape[0])
    return nll, count


def length_extrapolation(
    task,
    stream: Stream,
    context: int,
    multiples=MULTIPLES,
    bucket: int | None = None,
    progress=None,
) -> dict:
    """Perplexity of ``task``'s language model at each multiple of ``context`` on ``stream``.

    Args:
        task: a language-model task (its network is run in eval mode, without gradients).
        stream: the evaluation positions (:func:`stream_from_batches`); the longest whole number of
            windows of the largest multiple is used, the same positions for every multiple.
        context: the training context ``L`` (tokens per training sample).
        multiples: the window lengths, as multiples of ``L``.
        bucket: positions per bucket; None is a quarter of ``L`` (rounded up).
        progress: optional callable ``progress(windows_done)``.

    Returns:
        ``{"context", "bucket", "positions", "scored", "limit", "position_rule", "multiples": {m: {...}}}``
        (``limit`` the longest window the positions allow, None for no limit; ``position_rule`` the
        rule that applied, :func:`position_rule`); each multiple
        has ``length``, ``defined`` and ``reason`` (why not, or None), and where defined ``nll``,
        ``count``, ``ppl`` and ``buckets`` (each ``start``, ``stop``, ``nll``, ``count``, ``ppl``).
    """
    if context < 1 or not multiples or any(m < 1 for m in multiples):
        raise ValueError(f"context and every multiple must be >= 1, got {context} and {list(multiples)}")
    bucket = -(-context // 4) if bucket is None else bucket
    network = network_of(task)
    limit = position_limit(network)
    longest = context * max(multiples)
    used = len(stream) // longest * longest
    if used == 0:
        raise ValueError(
            f"the evaluation stream holds {len(stream)} positions, fewer than one window of {max(multiples)} x "
            f"{context} = {longest}: lower the multiples or use a longer split"
        )
    part = Stream(stream.inputs[:used], stream.targets[:used], stream.scored[:used])
    defined = [m for m in multiples if limit is None or m * context <= limit]
    result = {
        "context": context,
        "bucket": bucket,
        "positions": used,
        "scored": int(part.scored.sum()),
        "limit": limit,
        "position_rule": position_rule(network),
        "multiples": {},
    }
    widest = context * max(defined) if defined else 0
    with evaluating(task), positions_up_to(network, widest):
        for m in multiples:
            length = m * context
            entry: dict = {"length": length, "defined": m in defined, "reason": None}
            if m not in defined:
                entry["reason"] = f"the model's learned position table holds {limit} positions, fewer than {length}"
            else:
                nll, count = position_nll(network, part, length, max(1, widest // length), progress)
                total, n = float(nll.sum()), int(count.sum())
                entry.update(nll=total, count=n, ppl=perplexity(total, n), buckets=buckets(nll, count, bucket))
            result["multiples"][m] = entry
    return result


def extrapolation_rows(result: dict) -> list[tuple]:
    """``(multiple, length, part, start, stop, count, ppl)`` rows: per multiple, the whole ``window``
    (positions 0 to the length) then each ``bucket``; a multiple that is not defined has one ``window``
    row with no count and no perplexity."""
    rows = []
    for m, entry in result["multiples"].items():
        if not entry["defined"]:
            rows.append((m, entry["length"], "window", 0, entry["length"], None, None))
            continue
        rows.append((m, entry["length"], "window", 0, entry["length"], entry["count"], entry["ppl"]))
        rows += [(m, entry["length"], "bucket", b["start"], b["stop"], b["count"], b["ppl"]) for b in entry["buckets"]]
    return rows
