"""Figures of the attention analysis (matplotlib, Agg): comparisons of several checkpoints in the
style of the paper's Figures 4, 5, 8 and 9, per-example attention maps (Figure 7), Grad-CAM
(Figure 6), text heat maps, the robustness curves, the KV eviction's attention loss and the key norm
against received attention (Devoto thesis, Fig. 4.2).

Every ``*_figure`` function returns a matplotlib figure (the callback sends them to TensorBoard);
:func:`comparisons`, :func:`examples`, :func:`robustness`, :func:`attention_loss` and
:func:`key_norm_attention` write PNGs and return their names.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from mmlight.analysis.batches import map_batch
from mmlight.nn.attention import network_of, record_attention
from mmlight.reweighting.metrics import cdf_from_histogram

PER_LAYER = (
    "entropy",
    "normalized_entropy",
    "multimodality",
    "sparsity",
    "frac_below_1e-3",
    "frac_zero",
    "max_weight",
    "sink_ratio",
    "rollout_discrepancy",
)


def new_figure(figsize: tuple[float, float]):
    """An empty figure outside pyplot's global state: drawing one is safe on any thread (the training
    callback draws on a background thread), and nothing needs closing."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def to_image(fig) -> np.ndarray:
    """The rendered figure as an ``(H, W, 3)`` uint8 array (what TensorBoard's ``add_image`` takes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    fig.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def safe(label: str) -> str:
    """A label usable in a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def grid(n: int, cols: int = 4, size: tuple[float, float] = (3.2, 2.6)):
    """``n`` axes in a grid (extra axes hidden)."""
    cols = max(1, min(cols, n))
    rows = -(-n // cols)
    fig = new_figure((size[0] * cols, size[1] * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return fig, list(axes.flat)[:n]


def save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    return name


# ------------------------------------------------------------------ comparisons of checkpoints


def by_kind(stats: dict, metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{kind: (layers, values)}`` of a per-layer site metric, None values left out."""
    found: dict[str, tuple[list[int], list[float]]] = {}
    for entry in stats["sites"].values():
        value = entry["metrics"].get(metric)
        if value is not None:
            xs, ys = found.setdefault(entry["kind"], ([], []))
            xs.append(entry["layer"])
            ys.append(value)
    return found


def similarity_figure(results: dict[str, dict]):
    """Figure 4: token similarity at each block's output against depth, one line per run (or epoch)."""
    stacks = sorted({e["stack"] for stats in results.values() for e in stats["blocks"].values()})
    fig, axes = grid(len(stacks), cols=3)
    for ax, stack in zip(axes, stacks):
        for label, stats in results.items():
            points = sorted(
                (e["layer"], e["token_similarity"])
                for e in stats["blocks"].values()
                if e["stack"] == stack and e["token_similarity"] is not None
            )
            if points:
                ax.plot([p[0] + 1 for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set(title=f"{stack}: token similarity", xlabel="layer", ylabel="mean pairwise cosine")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
    return fig


def plot_weight_histogram(ax, edges: list[float], counts: list[int], label: str, cdf: bool) -> None:
    """One line of :func:`~mmlight.reweighting.metrics.weight_histogram` counts on ``ax``: the fraction of
    the weights below each edge (``cdf``), or the count per bin at the bin's geometric centre on a log
    scale (bin 0, the weights below 1e-8, is not drawn)."""
    edges, counts = torch.tensor(edges), torch.tensor(counts)
    if cdf:
        ax.plot(edges, cdf_from_histogram(counts), label=label)
    else:
        ax.plot((edges[:-1] * edges[1:]).sqrt(), counts[1:].clamp_min(0.5), label=label)
        ax.set_yscale("log")


def histogram_figure(results: dict[str, dict], cdf: bool = False):
    """Figure 5 (log-log histogram of the weights per layer) or Figure 8 (their CDF)."""
    sites = list(next(iter(results.values()))["sites"])
    fig, axes = grid(len(sites))
    for ax, site in zip(axes, sites):
        for label, stats in results.items():
            entry = stats["sites"].get(site)
            if entry is None:
                continue
            plot_weight_histogram(ax, stats["histogram_edges"], entry["histogram"], label, cdf)
        ax.set_xscale("log")
        ax.set(title=site, xlabel="attention weight", ylabel="fraction below" if cdf else "count")
        ax.legend(fontsize=6)
    return fig


def layers_figure(stats: dict, cdf: bool = False):
    """One run's weight histogram (or CDF) with one line per layer in a single panel: the cheap
    form the training callback draws."""
    fig = new_figure((4.5, 3.2))
    ax = fig.subplots()
    for site, entry in stats["sites"].items():
        plot_weight_histogram(ax, stats["histogram_edges"], entry["histogram"], site, cdf)
    ax.set_xscale("log")
    ax.set(xlabel="attention weight", ylabel="fraction below" if cdf else "count")
    ax.legend(fontsize=6)
    return fig


def per_layer_figure(results: dict[str, dict], metrics=PER_LAYER):
    """Each per-layer metric against depth: one line per run and attention kind."""
    fig, axes = grid(len(metrics), cols=3)
    for ax, metric in zip(axes, metrics):
        for label, stats in results.items():
            for kind, (xs, ys) in by_kind(stats, metric).items():
                order = sorted(range(len(xs)), key=xs.__getitem__)
                ax.plot(
                    [xs[i] + 1 for i in order],
                    [ys[i] for i in order],
                    marker="o",
                    label=label if kind == "self" else f"{label} {kind}",
                )
        ax.set(title=metric, xlabel="layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=6)
    return fig


def sinks_figure(results: dict[str, dict], positions: int = 32):
    """Mean incoming attention per key position (as a multiple of the uniform share), per layer."""
    sites = list(next(iter(results.values()))["sites"])
    fig, axes = grid(len(sites))
    for ax, site in zip(axes, sites):
        for label, stats in results.items():
            entry = stats["sites"].get(site)
            if entry is not None:
                values = [math.nan if v is None else v for v in entry["incoming_relative"][:positions]]
                ax.plot(range(len(values)), values, marker=".", label=label)
        ax.axhline(next(iter(results.values()))["settings"]["sink_eps"], color="k", lw=0.8, ls="--")
        ax.set(title=site, xlabel="key position", ylabel="incoming / uniform")
        ax.legend(fontsize=6)
    return fig


def comparisons(results: dict[str, dict], out: Path) -> list[str]:
    """Write the comparison figures of several runs; returns their file names."""
    written = [
        save(similarity_figure(results), out, "fig4_token_similarity.png"),
        save(histogram_figure(results), out, "fig5_weight_histogram.png"),
        save(histogram_figure(results, cdf=True), out, "fig8_weight_cdf.png"),
        save(per_layer_figure(results, ("rollout_discrepancy",)), out, "fig9_rollout_discrepancy.png"),
        save(per_layer_figure(results), out, "per_layer_metrics.png"),
        save(sinks_figure(results), out, "sinks.png"),
    ]
    return written


def robustness(rows: list[tuple], out: Path) -> str:
    """The task metric against the intervention level, one panel per intervention family."""
    families = {"sink_masking": "sink masking: top-k keys masked", "kv": "KV eviction: keep ratio"}
    fig, axes = grid(len(families) if any(r[1].startswith("kv_") for r in rows) else 1, cols=2, size=(4.5, 3.2))
    baselines = {r[0]: r[4] for r in rows if r[1] == "none"}
    for ax, (family, title) in zip(axes, families.items()):
        for label in dict.fromkeys(r[0] for r in rows):
            methods = sorted({r[1] for r in rows if r[0] == label and r[1].startswith(family)})
            for method in methods:
                pts = sorted((r[2], r[4]) for r in rows if r[0] == label and r[1] == method)
                if family == "sink_masking":
                    pts = [(0, baselines[label])] + pts
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    label=label if family == "sink_masking" else f"{label} {method[3:]}",
                )
        ax.set(title=title, xlabel="k" if family == "sink_masking" else "r", ylabel=rows[0][3])
        ax.legend(fontsize=6)
    return save(fig, out, "robustness.png")


def attention_loss(rows: list[tuple], out: Path) -> str:
    """The attention loss pooled over the evicted layers against the keep ratio, one panel per
    checkpoint: a solid line per method, and dotted in the same colour the oracle's at the same
    budget on the same calls (its lower bound); the top axis is kvpress's compression ratio, 1 - r.

    Args:
        rows: ``(checkpoint, intervention, keep_ratio, compression_ratio, layer, rows,
            attention_loss, oracle_loss)`` as ``kv_attention_loss.csv``; those of layer ``all`` are drawn.
    """
    pooled = [r for r in rows if r[4] == "all" and r[6] is not None]
    labels = list(dict.fromkeys(r[0] for r in pooled))
    fig, axes = grid(len(labels), cols=3, size=(4.5, 3.4))
    for ax, label in zip(axes, labels):
        methods = list(dict.fromkeys(r[1] for r in pooled if r[0] == label))
        for i, method in enumerate(methods):
            pts = sorted((r[2], r[6], r[7]) for r in pooled if r[0] == label and r[1] == method)
            x = [p[0] for p in pts]
            ax.plot(x, [p[1] for p in pts], marker="o", color=f"C{i % 10}", label=method.removeprefix("kv_"))
            ax.plot(x, [p[2] for p in pts], linestyle=":", color=f"C{i % 10}", alpha=0.8)
        ax.set(title=f"{label}\n(dotted: oracle at the same budget)", xlabel="keep ratio r", ylabel="attention loss")
        ax.title.set_fontsize(8)
        ax.invert_xaxis()
        top = ax.secondary_xaxis("top", functions=(lambda r: 1 - r, lambda c: 1 - c))
        top.set_xlabel("compression ratio 1 - r", fontsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return save(fig, out, "kv_attention_loss.png")


def key_norm_attention(results: dict[str, dict[str, dict]], out: Path, points: int = 3000) -> str:
    """Key L2 norm against the mean attention the key receives from later queries (Devoto thesis,
    Fig. 4.2), one row of panels per checkpoint, one panel per causal decoder layer, with Pearson's r
    and Spearman's rho in the title; at most ``points`` pairs drawn per panel (a fixed random subset).

    Args:
        results: checkpoint -> site -> :func:`~mmlight.analysis.key_norms.key_norm_attention`'s entry.
    """
    panels = [(label, site, entry) for label, sites in results.items() for site, entry in sites.items()]
    cols = max(len(sites) for sites in results.values())
    fig, axes = grid(len(panels), cols=cols, size=(3.6, 3.0))
    generator = torch.Generator().manual_seed(0)
    for ax, (label, site, entry) in zip(axes, panels):
        norm, received = torch.tensor(entry["norm"]), torch.tensor(entry["received"])
        if len(norm) > points:
            pick = torch.randperm(len(norm), generator=generator)[:points]
            norm, received = norm[pick], received[pick]
        ax.scatter(norm.numpy(), received.numpy(), s=3, alpha=0.4)
        r, rho = (entry[k] for k in ("pearson", "spearman"))
        ax.set_title(f"{label} {site}\nr = {r:.2f}, rho = {rho:.2f}, n = {entry['pairs']}", fontsize=7)
        ax.set(xlabel="key L2 norm", ylabel="mean attention received")
    return save(fig, out, "key_norm_attention.png")


# ------------------------------------------------------------------ single examples


def examples(task, batch, label: str, out: Path, query_patch: int | None = None, vocab=None) -> list[str]:
    """The per-example figures of one checkpoint on the first sample of ``batch``: attention maps and
    Grad-CAM when the task's example inputs are an image, text heat maps otherwise."""
    one = map_batch(batch, lambda t: t[:1].to(task.device))
    inputs = task.example_inputs(one)
    if inputs.image is not None:
        return [attention_map(task, one, inputs, label, out, query_patch), grad_cam(task, inputs, label, out)]
    return text_heatmaps(task, one, inputs, label, out, vocab)


@torch.no_grad()
def recorded(task, batch) -> dict:
    """``{site record: (nh, Tq, Tk)}`` head weights of one teacher-forced pass on a one-sample batch."""
    network = network_of(task)
    was_training = network.training
    network.eval()
    with record_attention(task) as recorder:
        task.teacher_forced(batch)
    network.train(was_training)
    return {recorder.site(name): recorder[name][0].weights[0].float().cpu() for name in recorder.sites()}


def attention_map(task, batch, inputs, label: str, out: Path, query_patch: int | None) -> str:
    """Figure 7: per layer and head, the attention of one query patch over the patch grid.

    Args:
        batch: a one-sample batch; ``inputs`` is the task's ``example_inputs`` of it.
    """
    weights = recorded(task, batch)
    image, prefix, grid_hw = inputs.image, inputs.prefix, inputs.patch_grid
    n = grid_hw[0] * grid_hw[1]
    query = n // 2 + grid_hw[1] // 2 if query_patch is None else query_patch  # checked by analyze
    sites = sorted(weights, key=lambda site: site.layer)
    heads = weights[sites[0]].shape[0]
    fig = new_figure((2.1 * (heads + 1), 2.1 * len(sites)))
    axes = fig.subplots(len(sites), heads + 1, squeeze=False)
    for row, site in zip(axes, sites):
        row[0].imshow(image[0].float().mean(0).cpu(), cmap="gray")
        qy, qx = divmod(query, grid_hw[1])
        row[0].set_title(site.name, fontsize=8)
        for h in range(heads):
            attn = weights[site][h, prefix + query, prefix:].reshape(grid_hw)
            row[h + 1].imshow(attn, cmap="viridis")
            row[h + 1].plot(qx, qy, "r+")
            row[h + 1].set_title(f"head {h}", fontsize=8)
        for ax in row:
            ax.axis("off")
    fig.suptitle(f"{label}: attention of patch {query} (red +)", fontsize=9)
    return save(fig, out, f"fig7_attention_map_{safe(label)}.png")


def vit_reshape(prefix: int, grid_hw: tuple[int, int]):
    """grad-cam's ``reshape_transform`` for timm ViT tokens ``(B, prefix + N, C)`` -> ``(B, C, h, w)``.
    grad-cam's own recipe drops exactly one CLS token; a GAP-head model has none (``prefix`` = 0)."""

    def reshape(tokens: torch.Tensor) -> torch.Tensor:
        patches = tokens[:, prefix:, :]
        return patches.reshape(patches.shape[0], grid_hw[0], grid_hw[1], patches.shape[2]).permute(0, 3, 1, 2)

    return reshape


def grad_cam_map(model, image: torch.Tensor, layer, prefix: int, grid_hw: tuple[int, int]) -> torch.Tensor:
    """Grad-CAM ``(H, W)`` in [0, 1] of the class ``model`` predicts for ``image`` ``(1, C, H, W)``, at
    ``layer``, whose output tokens are ``prefix`` tokens and a row-major ``grid_hw`` of patches."""
    from pytorch_grad_cam import GradCAM

    with (
        torch.enable_grad(),
        GradCAM(model=model, target_layers=[layer], reshape_transform=vit_reshape(prefix, grid_hw)) as cam,
    ):
        return torch.from_numpy(cam(input_tensor=image.float(), targets=None)[0])


def grad_cam(task, inputs, label: str, out: Path) -> str:
    """Figure 6: Grad-CAM over the input image of the task's ``example_inputs``."""
    image, network = inputs.image, network_of(task)
    was_training = network.training
    network.eval()
    heat = grad_cam_map(network, image, inputs.cam_layer, inputs.prefix, inputs.patch_grid)
    network.train(was_training)
    fig = new_figure((5, 2.6))
    ax = fig.subplots(1, 2)
    ax[0].imshow(image[0].float().mean(0).cpu(), cmap="gray")
    ax[1].imshow(image[0].float().mean(0).cpu(), cmap="gray")
    ax[1].imshow(heat, cmap="jet", alpha=0.5)
    for a in ax:
        a.axis("off")
    fig.suptitle(f"{label}: Grad-CAM of the predicted class", fontsize=9)
    return save(fig, out, f"fig6_gradcam_{safe(label)}.png")


def text_heatmaps(task, batch, inputs, label: str, out: Path, vocab=None) -> list[str]:
    """Head-averaged attention of one sequence per layer, one figure per attention kind (for a
    translation model: encoder self, decoder self, and the cross-attention alignment).

    Args:
        batch: a one-sample batch; ``inputs`` is the task's ``example_inputs`` of it.
    """
    weights = recorded(task, batch)
    keep = {stack: None if m is None else m[0].cpu() for stack, m in task.query_keep(batch).items()}
    tokens = {stack: ids[0] for stack, ids in inputs.tokens.items()}
    written = []
    for kind in dict.fromkeys(site.kind for site in weights):
        sites = sorted((site for site in weights if site.kind == kind), key=lambda site: site.layer)
        fig, axes = grid(len(sites), cols=3, size=(4.2, 3.8))
        q_stack, k_stack = sites[0].stack, sites[0].keys_from
        for ax, site in zip(axes, sites):
            q_ok, k_ok = keep.get(q_stack), keep.get(k_stack)
            attn = weights[site].mean(0)
            if q_ok is not None:
                attn = attn[q_ok]
            if k_ok is not None:
                attn = attn[:, k_ok]
            ax.imshow(attn, cmap="viridis", aspect="auto")
            ax.set(title=site.name, xlabel=f"key ({k_stack})", ylabel=f"query ({q_stack})")
            for axis, stack, ok in ((ax.set_xticks, k_stack, k_ok), (ax.set_yticks, q_stack, q_ok)):
                if stack not in tokens:  # the task names no tokens for this stack: no tick labels
                    continue
                ids = tokens[stack] if ok is None else tokens[stack][ok.to(tokens[stack].device)]
                if len(ids) <= 40:
                    names = [vocab[i] if vocab is not None and i < len(vocab) else str(i) for i in ids.tolist()]
                    axis(range(len(names)), names, fontsize=5, rotation=90 if axis == ax.set_xticks else 0)
        name = "cross_attention_alignment" if kind == "cross" else f"attention_heatmap_{kind}"
        fig.suptitle(f"{label}: {name.replace('_', ' ')} (mean over heads)", fontsize=9)
        written.append(save(fig, out, f"{name}_{safe(label)}.png"))
    return written


# ------------------------------------------------------------------ language-model analyses


def extrapolation_figure(results: dict[str, dict]):
    """Length extrapolation (:func:`~mmlight.analysis.extrapolation.length_extrapolation`): per run,
    perplexity against the position in the window, one line per multiple of the training context
    (each point a bucket, at its centre); a last panel gives the whole-window perplexity per multiple."""
    fig, axes = grid(len(results) + 1, cols=3, size=(4.2, 3.2))
    for ax, (label, result) in zip(axes, results.items()):
        for m, entry in result["multiples"].items():
            if entry["defined"]:
                points = [((b["start"] + b["stop"] - 1) / 2, b["ppl"]) for b in entry["buckets"] if b["ppl"]]
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=f"{m}x")
        ax.axvline(result["context"] - 0.5, color="k", lw=0.8, ls="--")  # the end of the training context
        undefined = [f"{m}x" for m, e in result["multiples"].items() if not e["defined"]]
        note = f" ({', '.join(undefined)}: past the position table)" if undefined else ""
        ax.set(title=f"{label}{note}", xlabel="position in window", ylabel="perplexity", yscale="log")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=6)
    ax = axes[-1]
    for label, result in results.items():
        points = [(m, e["ppl"]) for m, e in result["multiples"].items() if e["defined"] and e["ppl"]]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    multiples = sorted({m for result in results.values() for m in result["multiples"]})
    ax.set(title="whole window", xlabel="x training context", ylabel="perplexity", yscale="log")
    ax.set_xscale("log", base=2)
    ax.set_xticks(multiples, [f"{m}x" for m in multiples])
    ax.minorticks_off()
    ax.legend(fontsize=6)
    return fig


def massive_figure(results: dict[str, dict]):
    """Massive activations (:func:`~mmlight.analysis.massive.massive_activations`) against depth, one
    colour per run: the mean largest magnitude (solid) and median magnitude (dashed) of each block's
    output, and their ratio."""
    fig, axes = grid(2, cols=2, size=(4.5, 3.4))
    for i, (label, result) in enumerate(results.items()):
        blocks = list(result["blocks"].values())
        depth = range(1, len(blocks) + 1)
        colour = f"C{i % 10}"
        top = [b["top_mean"][0] if b["top_mean"] else math.nan for b in blocks]
        median = [math.nan if b["median"] is None else b["median"] for b in blocks]
        ratio = [math.nan if b["ratio"] is None else b["ratio"] for b in blocks]
        axes[0].plot(depth, top, marker="o", color=colour, label=f"{label} top 1")
        axes[0].plot(depth, median, marker=".", ls="--", color=colour, label=f"{label} median")
        axes[1].plot(depth, ratio, marker="o", color=colour, label=label)
    axes[0].set(title="hidden-state magnitude", xlabel="block (depth order)", ylabel="|h|", yscale="log")
    axes[1].set(title="largest / median", xlabel="block (depth order)", ylabel="ratio", yscale="log")
    for ax in axes:
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=6)
    return fig
