"""Per-layer and per-head attention statistics of a task's model on a fixed set of samples.

:func:`collect_statistics` runs teacher-forced forward passes under an :class:`AttentionObserver`
that reduces every attention call to running sums at once (nothing of size ``T x T`` is kept past a
batch), plus forward hooks on the blocks for the token similarity. The result is a JSON-ready dict;
:func:`metric_rows` flattens it into ``(layer, head, metric, value)`` rows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from mmlight.analysis.batches import batch_size, map_batch
from mmlight.nn.attention import AttentionObserver, network_of, observe_attention
from mmlight.nn.sites import AttentionSite
from mmlight.reweighting import metrics as M
from mmlight.tasks.protocol import check_analysed_task

#: The per-head metrics (one value per head, plus their mean as the per-layer value).
HEAD_METRICS = (
    "entropy",
    "normalized_entropy",
    "multimodality",
    "sparsity",
    "frac_below_1e-3",
    "frac_zero",
    "max_weight",
    "null_mass",
    "frac_zero_mass",
)
#: Per-layer-only metrics.
LAYER_METRICS = ("token_similarity", "rollout_discrepancy", "sink_ratio", "zero_mass_rows")


@dataclass
class Settings:
    """The thresholds of the statistics, written next to every result.

    Args:
        eps_multimodality: M counts keys whose score exceeds the row's mean score by more than this.
        eps_sparsity: S counts keys whose score is below the row's mean score plus this.
        near_zero: the threshold of ``frac_below_1e-3``.
        sink_eps: a key position is a sink when its mean incoming attention exceeds ``sink_eps``
            times the uniform share (ratio form; the mean share over a row's keys is 1).
        top_sinks: how many top sink positions are listed per layer.
        zero_mass: a row whose weights sum to at most this attends to nothing: it counts in the null
            mass and in ``frac_zero_mass``, not in entropy, M and S (defined on the renormalised weights).
    """

    eps_multimodality: float = 0.0
    eps_sparsity: float = 0.0
    near_zero: float = 1e-3
    sink_eps: float = 3.0
    top_sinks: int = 5
    zero_mass: float = 1e-9


@dataclass
class _SiteSums:
    """Running sums of one attention site."""

    site: AttentionSite
    sums: dict = field(default_factory=dict)  # metric -> (nh,) float64 sums
    counts: dict = field(default_factory=dict)  # metric -> (nh,) float64 counts
    histogram: torch.Tensor = field(default_factory=lambda: torch.zeros(len(M.HIST_EDGES), dtype=torch.float64))
    incoming_raw: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    incoming_relative: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    incoming_seen: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    discrepancy: list = field(default_factory=lambda: [0.0, 0])

    def add(self, metric: str, values: torch.Tensor, counted: torch.Tensor) -> None:
        """Add per-row ``values`` ``(B, nh, Tq)`` where ``counted`` and not NaN."""
        ok = counted & ~torch.isnan(values)
        self.sums[metric] = self.sums.get(metric, 0) + torch.where(ok, values, 0.0).sum((0, 2)).cpu()
        self.counts[metric] = self.counts.get(metric, 0) + ok.sum((0, 2)).double().cpu()

    def add_fraction(self, metric: str, hits: torch.Tensor, counted: torch.Tensor) -> None:
        """Add pooled counts: ``hits`` and ``counted`` ``(B, nh, Tq, Tk)`` bool."""
        self.sums[metric] = self.sums.get(metric, 0) + (hits & counted).sum((0, 2, 3)).double().cpu()
        self.counts[metric] = self.counts.get(metric, 0) + counted.sum((0, 2, 3)).double().cpu()

    def add_incoming(self, raw, relative, seen) -> None:
        """Add ``(B, Tk)`` incoming sums, growing the per-position arrays to the longest ``Tk``."""
        n = max(raw.shape[1], len(self.incoming_seen))
        for name, new in (("incoming_raw", raw), ("incoming_relative", relative), ("incoming_seen", seen)):
            old = getattr(self, name)
            grown = torch.zeros(n, dtype=torch.float64)
            grown[: len(old)] += old
            grown[: new.shape[1]] += new.sum(0).cpu()
            setattr(self, name, grown)


class StatsObserver(AttentionObserver):
    """Reduces each attention call to running sums (see the module docstring).

    The reduction can wait: :meth:`record` keeps what it needs (the weights, the scores and the masks
    of the call) and :meth:`flush` reduces everything kept, in order. Once more than ``keep_bytes``
    are kept, :meth:`record` flushes at once, so memory stays bounded; the rest waits for a
    :meth:`flush` later, e.g. on another thread.

    Args:
        settings: the thresholds.
        keep_bytes: how much recorded attention may wait (0: reduce each call as it comes).
    """

    def __init__(self, settings: Settings, keep_bytes: int = 0):
        self.settings, self.keep_bytes = settings, keep_bytes
        self.sites: dict[str, _SiteSums] = {}
        self.query_keep: dict[str, torch.Tensor | None] = {}
        self._scores: dict[str, torch.Tensor] = {}
        self._head_mean: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kept: list[tuple | None] = []  # record() arguments; None ends a batch
        self.kept_bytes = 0

    def edit_mask(self, site, q, k, mask):
        # The scores the reweighting sees (the models use the default scale hs ** -0.5); M and S need them.
        self._scores[site.name] = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, nh, Tq, Tk)
        return mask

    def record(self, site, weights, keep) -> None:
        call = (site, weights.detach(), keep, self._scores.pop(site.name), self.query_keep.get(site.stack))
        self._kept.append(call)
        self.kept_bytes += sum(t.numel() * t.element_size() for t in call[1:] if torch.is_tensor(t))
        if self.kept_bytes > self.keep_bytes:
            self.flush()

    def end_batch(self) -> None:
        self._kept.append(None)

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce every kept call, in the order they were recorded."""
        kept, self._kept, self.kept_bytes = self._kept, [], 0
        for call in kept:
            if call is None:
                self._roll_out()
            else:
                self._reduce(*call)

    def _reduce(self, site, weights, keep, scores, query_keep) -> None:
        s = self.settings
        weights = weights.double()  # once here, not in every metric
        keys = M.attended(weights, keep)  # (B, nh, Tq, Tk)
        rows = M.counted_rows(keys, query_keep)  # (B, nh, Tq)
        sums = self.sites.setdefault(site.name, _SiteSums(site))
        mass = weights.sum(-1)  # (B, nh, Tq): 1 on the simplex, less (or, for sigmoid, more) otherwise
        given = mass > s.zero_mass
        sums.add("null_mass", 1.0 - mass, rows)
        sums.add("frac_zero_mass", (~given).double(), rows)
        # the shape of a row's distribution: on its renormalised weights, where it has any mass
        shaped, p = rows & given, M.renormalised(weights, mass, given)
        nats, centred = M.entropy(p), M.centred_scores(scores, keys)
        sums.add("entropy", nats, shaped)
        sums.add("normalized_entropy", M.normalized_entropy(p, keys, nats), shaped)
        sums.add("multimodality", M.multimodality(centred, p, s.eps_multimodality, keys), shaped)
        sums.add("sparsity", M.sparsity(centred, p, s.eps_sparsity, keys=keys), shaped)
        sums.add("max_weight", M.row_max(weights).double(), rows)
        counted = keys & rows[..., None]
        sums.add_fraction("frac_below_1e-3", weights < s.near_zero, counted)
        sums.add_fraction("frac_zero", weights == 0, counted)
        sums.histogram += M.weight_histogram(weights[counted])
        sums.add_incoming(*M.incoming_attention(weights, keys, rows))
        if site.keys_from == site.stack:  # rollout runs through the self-attention stacks only
            self._head_mean[site.name] = (site, weights.mean(1), rows.any(1))  # site, (B, T, T), (B, T)

    def _roll_out(self) -> None:
        """Roll out each self-attention stack of the batch through its layers and add the discrepancies."""
        stacks: dict[str, list[tuple]] = {}
        for entry in sorted(self._head_mean.values(), key=lambda entry: entry[0].layer):
            stacks.setdefault(entry[0].stack, []).append(entry)
        for entries in stacks.values():
            rolled = M.rollout([single for _, single, _ in entries])
            for (site, single, rows), r in zip(entries, rolled):
                total, n = M.rollout_discrepancy(r, single, rows)
                self.sites[site.name].discrepancy[0] += total
                self.sites[site.name].discrepancy[1] += n
        self._head_mean.clear()


class BlockSimilarity:
    """Forward hooks on a network's ``blocks()``: token similarity at each block's output.

    Args:
        network: the task's network (see :func:`~mmlight.nn.attention.network_of`).
        query_keep: a callable returning the current ``{stack: (B, T) mask}``.
    """

    def __init__(self, network, query_keep):
        self.sums: dict[str, list] = {}
        self.blocks = {block.name: block for block in network.blocks()}
        self._handles = [
            block.module.register_forward_hook(self._hook(block, query_keep)) for block in self.blocks.values()
        ]

    def _hook(self, block, query_keep):
        def hook(module, args, output):
            tokens = output[:, block.prefix :]  # (B, T, d): input positions only (no CLS token)
            sim = M.token_similarity(tokens, query_keep().get(block.stack))
            ok = ~torch.isnan(sim)
            total = self.sums.setdefault(block.name, [0.0, 0])
            total[0] += float(sim[ok].sum())
            total[1] += int(ok.sum())

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def summary(self) -> dict:
        """``{block: {"token_similarity": mean over samples or None, "stack", "layer"}}``."""
        return {
            name: {
                "token_similarity": total / n if n else None,
                "stack": self.blocks[name].stack,
                "layer": self.blocks[name].layer,
            }
            for name, (total, n) in self.sums.items()
        }


@dataclass
class Recording:
    """What :func:`record_statistics` observed: the token similarity, done, and the attention calls
    still to reduce. :meth:`finish` reduces them (on any thread) and returns the statistics."""

    observer: StatsObserver
    blocks: dict  # {block: {"token_similarity": value}}

    def finish(self) -> dict:
        self.observer.flush()
        return summarize(self.observer, self.blocks)


@torch.no_grad()
def record_statistics(
    task, batches: list, settings: Settings = Settings(), progress=None, keep_bytes: int = 0
) -> Recording:
    """Run ``task`` on ``batches`` under a :class:`StatsObserver` that may keep up to ``keep_bytes``
    of attention unreduced for :meth:`Recording.finish`.

    Args:
        task: a task with the members of :class:`~mmlight.tasks.protocol.AnalysedTask` (its network
            is run in eval mode; the mode is restored after).
        batches: CPU batches; moved to the task's device one at a time.
        settings: the thresholds.
        progress: optional callable ``progress(num_samples_done)`` after each batch.
        keep_bytes: how much recorded attention may wait for :meth:`Recording.finish` (0: reduce
            after every batch).
    """
    check_analysed_task(task)  # a clear error for a task that lacks a member
    network, device = network_of(task), task.device
    was_training = network.training
    if was_training:  # the callback records in validation, already in eval mode: skip the module walk
        network.eval()
    observer = StatsObserver(settings, keep_bytes)
    similarity = BlockSimilarity(network, lambda: observer.query_keep)
    try:
        with observe_attention(task, observer):
            for batch in batches:
                batch = map_batch(batch, lambda t: t.to(device))
                observer.query_keep = task.query_keep(batch)
                task.teacher_forced(batch)
                observer.end_batch()
                if progress is not None:
                    progress(batch_size(batch))
    finally:
        similarity.remove()
        if was_training:
            network.train()
    return Recording(observer, similarity.summary())


def collect_statistics(task, batches: list, settings: Settings = Settings(), progress=None) -> dict:
    """Statistics of ``task``'s attention on ``batches`` (e.g. from :func:`first_samples`), reduced
    batch by batch (arguments as for :func:`record_statistics`).

    Returns:
        ``{"settings", "sites": {site: {...}}, "blocks": {block: {"token_similarity": v}}}``.
    """
    return record_statistics(task, batches, settings, progress).finish()


def summarize(observer: StatsObserver, blocks: dict) -> dict:
    """The JSON-ready result of :func:`collect_statistics` from the reduced sums and the blocks'
    token similarity."""
    settings = observer.settings
    sites = {}
    for sums in sorted(observer.sites.values(), key=lambda sums: (sums.site.stack, sums.site.kind, sums.site.layer)):
        site = sums.site.name
        heads = {m: (sums.sums[m] / sums.counts[m]).tolist() for m in HEAD_METRICS}
        heads = {m: [None if math.isnan(v) else v for v in vals] for m, vals in heads.items()}
        layer = {m: pooled(sums.sums[m], sums.counts[m]) for m in HEAD_METRICS}
        seen = sums.incoming_seen
        raw = torch.where(seen > 0, sums.incoming_raw / seen.clamp_min(1), math.nan)
        relative = torch.where(seen > 0, sums.incoming_relative / seen.clamp_min(1), math.nan)
        ratio = M.sink_ratio(relative, settings.sink_eps)
        layer["sink_ratio"] = None if math.isnan(ratio) else ratio
        total, n = sums.discrepancy
        layer["rollout_discrepancy"] = total / n if n else None
        layer["zero_mass_rows"] = int(sums.sums["frac_zero_mass"].sum())
        order = torch.argsort(torch.nan_to_num(relative, nan=-1.0), descending=True)[: settings.top_sinks]
        sites[site] = {
            "kind": sums.site.kind,
            "layer": sums.site.layer,
            "heads": heads,
            "metrics": layer,
            "histogram": sums.histogram.tolist(),
            "incoming_mean": nan_to_none(raw.tolist()),
            "incoming_relative": nan_to_none(relative.tolist()),
            "top_sinks": [
                {"position": int(i), "relative": float(relative[i])} for i in order if not math.isnan(relative[i])
            ],
        }
    return {"settings": asdict(settings), "histogram_edges": M.HIST_EDGES.tolist(), "sites": sites, "blocks": blocks}


def pooled(sums: torch.Tensor, counts: torch.Tensor) -> float | None:
    """The mean over all heads' counted rows, None when there were none."""
    n = float(counts.sum())
    return float(sums.sum()) / n if n else None


def nan_to_none(values: list[float]) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values]


def metric_rows(stats: dict) -> list[tuple[str, int | None, str, float | None]]:
    """``(layer, head, metric, value)`` rows: per head and per layer (head None) for the head metrics,
    per layer for ``rollout_discrepancy`` and ``sink_ratio`` (sites) and ``token_similarity`` (blocks)."""
    rows = []
    for site, entry in stats["sites"].items():
        for metric in HEAD_METRICS:
            rows += [(site, h, metric, v) for h, v in enumerate(entry["heads"][metric])]
            rows.append((site, None, metric, entry["metrics"][metric]))
        rows += [
            (site, None, m, entry["metrics"][m])
            for m in ("rollout_discrepancy", "sink_ratio", "zero_mass_rows")
            if entry["metrics"].get(m) is not None
        ]
    rows += [(block, None, "token_similarity", entry["token_similarity"]) for block, entry in stats["blocks"].items()]
    return rows
