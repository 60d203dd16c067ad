"""The Grad-CAM reshape for CLS and GAP heads, and Grad-CAM through the grad-cam package on both."""

import numpy as np
import pytest
import torch

from mmlight.analysis import figures
from mmlight.analysis.figures import grad_cam_map, vit_reshape
from mmlight.models import ReweightedViT
from tests.helpers.models import micro_vit


@pytest.mark.parametrize("prefix", [0, 1])
def test_reshape_puts_each_patch_at_its_grid_position(prefix):
    h, w, C = 3, 4, 2
    n = prefix + h * w
    tokens = torch.arange(n, dtype=torch.float)[None, :, None].expand(1, n, C)  # token i holds value i
    grid = vit_reshape(prefix, (h, w))(tokens)  # (1, C, h, w)
    assert grid.shape == (1, C, h, w)
    for i in range(h * w):
        assert grid[0, 0, i // w, i % w] == prefix + i  # the CLS token (index 0) is dropped when present


def reference_grad_cam(model, image: torch.Tensor) -> torch.Tensor:
    """Grad-CAM written from its definition (Selvaraju et al., 2017) on the last block's first norm:
    activations A (the patch tokens, row-major on the patch grid) and gradients G of the predicted
    class's logit; weights a_c = mean of G_c over the grid; map = ReLU(sum_c a_c A_c), scaled to
    [0, 1] (min-max, as the grad-cam package does), bilinearly upsampled to the image (half-pixel
    centres, OpenCV's INTER_LINEAR), scaled to [0, 1] again."""
    vit = model.vit
    saved = {}
    handle = vit.blocks[-1].norm1.register_forward_hook(lambda m, i, out: saved.update(a=out))
    with torch.enable_grad():
        logits = model(image)
        saved["a"].retain_grad()
        logits[0, logits[0].argmax()].backward()
    handle.remove()
    h, w = vit.patch_embed.grid_size
    acts = saved["a"][0, vit.num_prefix_tokens :].detach().double()  # (h*w, C)
    grads = saved["a"].grad[0, vit.num_prefix_tokens :].double()
    cam = torch.relu(acts @ grads.mean(0)).reshape(h, w)  # (h, w)

    def scaled(x):
        x = x - x.min()
        return x / (1e-7 + x.max())

    up = torch.nn.functional.interpolate(
        scaled(cam)[None, None], size=image.shape[-2:], mode="bilinear", align_corners=False
    )[0, 0]
    return scaled(up)


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_grad_cam_on_gap_and_cls_heads_is_grad_cam_by_its_definition(pool):
    """On a GAP head (no prefix token) and a CLS head: the map of the predicted class equals Grad-CAM
    written out from the activations and gradients, so a wrong layer, class, token offset or grid
    orientation shows; the map is not uniform (it would pass a range check whatever it held)."""
    torch.manual_seed(0)
    model = ReweightedViT(micro_vit(global_pool=pool)).eval()
    image = torch.randn(1, 1, 8, 8)
    vit = model.vit
    heat = grad_cam_map(model, image, vit.blocks[-1].norm1, vit.num_prefix_tokens, (4, 4))
    want = reference_grad_cam(model, image)
    assert heat.shape == (8, 8) and heat.max().item() == pytest.approx(1.0, abs=1e-6)
    assert want.std() > 0.1  # a map with structure, so the comparison below means something
    torch.testing.assert_close(heat.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cdf", [False, True])
def test_weight_histograms_draw_the_counts_of_each_site(cdf):
    """Figure 5 plots each bin's count (at least 0.5, for the log axis) at the geometric centre of its
    edges; Figure 8 the fraction of weights below each edge: cumulative counts over the total, by hand."""
    import numpy as np

    from mmlight.analysis.figures import histogram_figure, layers_figure

    edges = [1e-3, 1e-2, 1e-1, 1.0]
    counts = {"blocks.0": [2, 0, 3, 1], "blocks.1": [0, 4, 4, 0]}
    stats = {"histogram_edges": edges, "sites": {site: {"histogram": c} for site, c in counts.items()}}
    for fig in (histogram_figure({"run": stats}, cdf=cdf), layers_figure(stats, cdf=cdf)):
        lines = [line for ax in fig.axes for line in ax.get_lines()]
        assert len(lines) == 2
        for line, c in zip(lines, counts.values()):
            if cdf:
                want_x, want_y = edges, np.cumsum(c) / sum(c)
            else:
                want_x = [(a * b) ** 0.5 for a, b in zip(edges, edges[1:])]
                want_y = [max(n, 0.5) for n in c[1:]]
            np.testing.assert_allclose(line.get_xdata(), want_x, rtol=1e-6)
            np.testing.assert_allclose(line.get_ydata(), want_y, rtol=1e-6)


def lines_of(ax) -> list[tuple[str, list, list]]:
    """``(label, x, y)`` of every line drawn on ``ax``, in drawing order."""
    return [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]


def site(kind: str, layer: int, **metrics) -> dict:
    return {"kind": kind, "layer": layer, "metrics": metrics}


def test_per_layer_lines_are_in_depth_order_per_run_and_kind_from_layer_1():
    from mmlight.analysis.figures import by_kind, per_layer_figure

    stats = {
        "sites": {
            "dec.1.self": site("self", 1, sink_ratio=0.25),
            "dec.0.self": site("self", 0, sink_ratio=0.5),
            "dec.0.cross": site("cross", 0, sink_ratio=0.75),
            "dec.2.self": site("self", 2, sink_ratio=None),  # not known: left out
        }
    }
    assert by_kind(stats, "sink_ratio") == {"self": ([1, 0], [0.25, 0.5]), "cross": ([0], [0.75])}
    fig = per_layer_figure({"run": stats}, ("sink_ratio", "entropy"))
    assert [ax.get_title() for ax in fig.axes if ax.axison] == ["sink_ratio", "entropy"]
    assert lines_of(fig.axes[0]) == [("run", [1, 2], [0.5, 0.25]), ("run cross", [1], [0.75])]
    assert lines_of(fig.axes[1]) == []


def test_sinks_lines_are_the_incoming_share_per_position_with_the_threshold():
    from mmlight.analysis.figures import sinks_figure

    def stats(values):
        return {"sites": {"blocks.0": {"incoming_relative": values}}, "settings": {"sink_eps": 3.0}}

    fig = sinks_figure({"a": stats([4.0, None, 0.5]), "b": stats([1.0] * 40)}, positions=20)
    (label_a, xs_a, ys_a), (label_b, xs_b, ys_b), threshold = lines_of(fig.axes[0])
    assert (label_a, xs_a, ys_a[0], ys_a[2]) == ("a", [0, 1, 2], 4.0, 0.5) and ys_a[1] != ys_a[1]  # None: a gap
    assert (label_b, xs_b, ys_b) == ("b", list(range(20)), [1.0] * 20)
    assert list(threshold[2]) == [3.0, 3.0]


def test_similarity_lines_per_stack_in_depth_order():
    from mmlight.analysis.figures import similarity_figure

    blocks = {
        "enc.1": {"stack": "encoder", "layer": 1, "token_similarity": 0.5},
        "enc.0": {"stack": "encoder", "layer": 0, "token_similarity": 0.25},
        "dec.0": {"stack": "decoder", "layer": 0, "token_similarity": None},
    }
    fig = similarity_figure({"run": {"blocks": blocks}})
    titles = [ax.get_title() for ax in fig.axes if ax.axison]
    assert titles == ["decoder: token similarity", "encoder: token similarity"]
    assert lines_of(fig.axes[0]) == [] and lines_of(fig.axes[1]) == [("run", [1, 2], [0.25, 0.5])]


def test_robustness_panels_start_sink_masking_at_the_plain_metric(tmp_path, monkeypatch):
    from mmlight.analysis import figures

    drawn = []
    original_save = figures.save
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.append(fig) or original_save(fig, out, name))
    rows = [
        ("a", "none", 0, "bleu", 30.0),
        ("a", "sink_masking", 5, "bleu", 20.0),
        ("a", "sink_masking", 1, "bleu", 25.0),
        ("a", "kv_l2", 0.5, "bleu", 10.0),
        ("a", "kv_l2", 0.9, "bleu", 28.0),
        ("a", "kv_streaming", 0.5, "bleu", 12.0),
    ]
    assert figures.robustness(rows, tmp_path) == "robustness.png" and (tmp_path / "robustness.png").is_file()
    sink, kv = [ax for ax in drawn[0].axes if ax.axison]
    assert lines_of(sink) == [("a", [0, 1, 5], [30.0, 25.0, 20.0])]
    assert lines_of(kv) == [("a l2", [0.5, 0.9], [10.0, 28.0]), ("a streaming", [0.5], [12.0])]
    assert (sink.get_xlabel(), kv.get_xlabel(), sink.get_ylabel()) == ("k", "r", "bleu")
    figures.robustness(rows[:3], tmp_path)  # no eviction rows: one panel
    assert len([ax for ax in drawn[1].axes if ax.axison]) == 1


def test_comparisons_write_each_figure_under_its_name_and_labels_are_file_safe(tmp_path, monkeypatch):
    from mmlight.analysis import figures
    from mmlight.analysis.figures import comparisons, safe

    assert safe("runs/a b:c-1.0") == "runs_a_b_c-1.0" and safe("DeiT-S/16 MultiMax") == "DeiT-S_16_MultiMax"
    stats = {
        "sites": {
            "blocks.0": {**site("self", 0, rollout_discrepancy=0.1), "histogram": [1, 2], "incoming_relative": [1.0]}
        },
        "blocks": {"blocks.0": {"stack": "encoder", "layer": 0, "token_similarity": 0.5}},
        "histogram_edges": [0.01, 0.1],
        "settings": {"sink_eps": 3.0},
    }
    drawn = {}
    original_save = figures.save
    monkeypatch.setattr(
        figures, "save", lambda fig, out, name: drawn.setdefault(name, fig) and original_save(fig, out, name)
    )
    names = comparisons({"run": stats}, tmp_path)
    # Figure 5 counts per bin (bin 0 not drawn), Figure 8 the fraction below each edge
    assert lines_of(drawn["fig5_weight_histogram.png"].axes[0])[0][2] == [2.0]
    assert lines_of(drawn["fig8_weight_cdf.png"].axes[0])[0][2] == pytest.approx([1 / 3, 1.0])
    assert lines_of(drawn["fig9_rollout_discrepancy.png"].axes[0]) == [("run", [1], [0.1])]
    assert names == [
        "fig4_token_similarity.png",
        "fig5_weight_histogram.png",
        "fig8_weight_cdf.png",
        "fig9_rollout_discrepancy.png",
        "per_layer_metrics.png",
        "sinks.png",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_the_attention_map_shows_each_heads_weights_of_the_query_patch_over_the_grid(tmp_path, monkeypatch):
    """Figure 7 on an untrained micro ViT (CLS token, 4x4 patches): each head's panel is the recorded
    weights of the query patch's row over the 16 patches, and the default query is the centre patch."""
    from mmlight.analysis import figures
    from mmlight.tasks import ImageClassifier

    torch.manual_seed(0)
    task = ImageClassifier(model=micro_vit(global_pool="token"))
    batch = (torch.randn(2, 1, 8, 8), torch.tensor([3, 5]))
    one = (batch[0][:1], batch[1][:1])
    weights = figures.recorded(task, one)
    assert task.model.training  # restored after the recording
    names = figures.examples(task, batch, "run a", tmp_path)
    assert names == ["fig7_attention_map_run_a.png", "fig6_gradcam_run_a.png"]
    assert all((tmp_path / n).is_file() for n in names)
    seen = []
    monkeypatch.setattr(figures, "grad_cam", lambda task, inputs, *a: seen.append(inputs.image) or "cam")
    assert figures.examples(task, batch, "run", tmp_path)[1] == "cam"
    assert torch.equal(seen[0], batch[0][:1])  # the batch's first sample
    inputs = task.example_inputs(one)
    for query, want_query in ((None, 4 * 4 // 2 + 4 // 2), (5, 5)):
        drawn = {}
        monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault("fig", fig) and name)
        figures.attention_map(task, one, inputs, "run", tmp_path, query)
        sites = sorted(weights, key=lambda s: s.layer)
        axes = drawn["fig"].axes
        heads = weights[sites[0]].shape[0]
        for row, s in enumerate(sites):
            for h in range(heads):
                shown = axes[row * (heads + 1) + h + 1].get_images()[0].get_array()
                want = weights[s][h, 1 + want_query, 1:].reshape(4, 4)
                np.testing.assert_allclose(np.asarray(shown), want.numpy(), rtol=0, atol=0)


# ------------------------------------------------------------------ what each figure shows a reader
# Titles, axis labels, scales, legends and sizes, each written out here: a figure that loses its labels
# or draws on the wrong scale still "works", so only these checks notice.


def visible(fig) -> list:
    return [ax for ax in fig.axes if ax.axison]


def legend_texts(ax) -> tuple[list[str], float]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()], legend.get_texts()[0].get_fontsize()


def integer_ticks(ax) -> bool:
    ax.figure.canvas.draw()
    ticks = ax.get_xticks()
    return len(ticks) > 0 and all(float(t).is_integer() for t in ticks)


def test_grid_lays_out_n_panels_in_rows_and_hides_the_rest():
    from mmlight.analysis.figures import grid

    fig, axes = grid(5)
    assert len(axes) == 5 and len(fig.axes) == 8  # 2 rows of 4, the last 3 hidden
    assert [ax.axison for ax in fig.axes] == [True] * 5 + [False] * 3
    assert list(fig.get_size_inches()) == pytest.approx([4 * 3.2, 2 * 2.6])
    fig, axes = grid(2, cols=3, size=(1.0, 2.0))  # fewer panels than columns: one row of 2
    assert len(fig.axes) == 2 and list(fig.get_size_inches()) == pytest.approx([2.0, 2.0])
    fig, axes = grid(7, cols=3)
    assert len(fig.axes) == 9 and list(fig.get_size_inches()) == pytest.approx([3 * 3.2, 3 * 2.6])


def reference_pixels(fig, dpi: float) -> np.ndarray:
    """The figure after a tight layout, rendered by matplotlib's own PNG writer, as RGB."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    FigureCanvasAgg(fig)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return np.asarray(Image.open(buffer).convert("RGB"))


def labelled_figure():
    from mmlight.analysis.figures import new_figure

    fig = new_figure((3.0, 2.0))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1])
    ax.set(title="a title", xlabel="a long x label", ylabel="a long y label")  # what a tight layout moves
    return fig


def test_to_image_is_the_tight_figure_as_rgb_and_save_writes_it_at_110_dpi(tmp_path):
    from PIL import Image

    from mmlight.analysis.figures import save, to_image

    fig = labelled_figure()
    image = to_image(fig)
    want = reference_pixels(labelled_figure(), dpi=100)
    assert image.dtype == np.uint8 and image.shape == (200, 300, 3)
    np.testing.assert_array_equal(image, want)
    fig.axes[0].set_title("drawn again")  # the image is a copy: a later drawing of the figure leaves it alone
    fig.canvas.draw()
    np.testing.assert_array_equal(image, want)
    assert save(labelled_figure(), tmp_path, "x.png") == "x.png"
    saved = np.asarray(Image.open(tmp_path / "x.png").convert("RGB"))
    assert saved.shape == (220, 330, 3)
    np.testing.assert_array_equal(saved, reference_pixels(labelled_figure(), dpi=110))


def test_similarity_figure_labels_markers_and_integer_layers():
    from mmlight.analysis.figures import similarity_figure

    # two layers per stack: with depths 1 and 2 only, matplotlib's default ticks would be 1.0, 1.2, ...
    blocks = {f"b.{i}": {"stack": f"s{i % 4}", "layer": i // 4, "token_similarity": 0.1 * i} for i in range(8)}
    fig = similarity_figure({"run a": {"blocks": blocks}, "run b": {"blocks": blocks}})
    axes = visible(fig)
    assert len(axes) == 4 and list(fig.get_size_inches()) == pytest.approx([3 * 3.2, 2 * 2.6])
    for ax in axes:
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("layer", "mean pairwise cosine")
        assert legend_texts(ax) == (["run a", "run b"], 7)
        assert {line.get_marker() for line in ax.get_lines()} == {"o"}
        assert integer_ticks(ax)


@pytest.mark.parametrize("cdf", [False, True])
def test_histogram_figures_scales_labels_and_a_run_without_the_site(cdf):
    from mmlight.analysis.figures import histogram_figure, layers_figure

    edges = [1e-3, 1e-2, 1e-1, 1.0]
    sites = {name: {"histogram": [1, 2, 3, 4]} for name in ("blocks.0", "blocks.1")}
    full = {"histogram_edges": edges, "sites": sites}
    partial = {"histogram_edges": edges, "sites": {"blocks.1": sites["blocks.1"]}}
    fig = histogram_figure({"a": full, "b": partial, "c": full}, cdf=cdf)
    axes = visible(fig)
    assert [ax.get_title() for ax in axes] == ["blocks.0", "blocks.1"]
    assert [legend_texts(ax) for ax in axes] == [(["a", "c"], 6), (["a", "b", "c"], 6)]  # b has no blocks.0
    y_label, y_scale = ("fraction below", "linear") if cdf else ("count", "log")
    for ax in axes:
        assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_xscale(), ax.get_yscale()) == (
            "attention weight",
            y_label,
            "log",
            y_scale,
        )
    fig = layers_figure(full, cdf=cdf)
    (ax,) = fig.axes
    assert list(fig.get_size_inches()) == pytest.approx([4.5, 3.2])
    assert legend_texts(ax) == (["blocks.0", "blocks.1"], 6)
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), ax.get_xscale(), ax.get_yscale()) == (
        "",
        "attention weight",
        y_label,
        "log",
        y_scale,
    )


def test_per_layer_figure_panels_labels_markers_and_the_default_metrics():
    from mmlight.analysis.figures import PER_LAYER, per_layer_figure

    metrics = {name: 0.5 for name in PER_LAYER}
    stats = {"sites": {"d.0": site("self", 0, **metrics), "d.1": site("self", 1, **metrics)}}
    fig = per_layer_figure({"run": stats})
    axes = visible(fig)
    assert (
        [ax.get_title() for ax in axes]
        == list(PER_LAYER)
        == [
            "entropy",
            "normalized_entropy",
            "multimodality",
            "sparsity",
            "frac_below_1e-3",
            "frac_zero",
            "max_weight",
            "sink_ratio",
            "rollout_discrepancy",
        ]
    )
    assert list(fig.get_size_inches()) == pytest.approx([3 * 3.2, 3 * 2.6])
    for ax in axes:
        assert (ax.get_xlabel(), ax.get_ylabel(), legend_texts(ax)) == ("layer", "", (["run"], 6))
        assert [line.get_marker() for line in ax.get_lines()] == ["o"]
        assert integer_ticks(ax)


def test_sinks_figure_threshold_line_labels_and_first_32_positions():
    from mmlight.analysis.figures import sinks_figure

    def stats(eps):
        return {"sites": {"blocks.0": {"incoming_relative": [1.0] * 40}}, "settings": {"sink_eps": eps}}

    fig = sinks_figure({"a": stats(2.5), "b": stats(9.0)})  # the first run's threshold is drawn
    (ax,) = visible(fig)
    run_a, run_b, threshold = ax.get_lines()
    assert list(run_a.get_xdata()) == list(range(32)) and run_a.get_marker() == "."
    assert list(threshold.get_ydata()) == [2.5, 2.5]
    assert (threshold.get_color(), threshold.get_linewidth(), threshold.get_linestyle()) == ("k", 0.8, "--")
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("blocks.0", "key position", "incoming / uniform")
    assert legend_texts(ax) == (["a", "b"], 6)


def test_robustness_figure_titles_size_and_markers(tmp_path, monkeypatch):
    from mmlight.analysis import figures

    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.append(fig) or name)
    rows = [
        ("a", "none", 0, "acc", 0.5),
        ("a", "sink_masking", 1, "acc", 0.4),
        ("a", "kv_l2", 0.5, "acc", 0.3),
        ("b", "none", 0, "acc", 0.6),
        ("b", "sink_masking", 1, "acc", 0.2),
    ]
    figures.robustness(rows, tmp_path)
    sink, kv = visible(drawn[0])
    assert list(drawn[0].get_size_inches()) == pytest.approx([2 * 4.5, 3.2])
    assert (sink.get_title(), kv.get_title()) == ("sink masking: top-k keys masked", "KV eviction: keep ratio")
    assert lines_of(sink) == [("a", [0, 1], [0.5, 0.4]), ("b", [0, 1], [0.6, 0.2])]  # each from its own baseline
    assert legend_texts(sink) == (["a", "b"], 6) and legend_texts(kv) == (["a l2"], 6)
    assert {line.get_marker() for ax in (sink, kv) for line in ax.get_lines()} == {"o"}
    assert kv.get_ylabel() == "acc"
    figures.robustness(rows[:2], tmp_path)
    assert list(drawn[1].get_size_inches()) == pytest.approx([4.5, 3.2])


def test_attention_map_panels_titles_query_marker_and_size(tmp_path, monkeypatch):
    """Figure 7's frame around the weights checked above: the input image (mean over channels) first,
    one titled panel per head with the query patch marked, no axes, the run in the title."""
    from mmlight.analysis import figures
    from mmlight.tasks import ImageClassifier

    torch.manual_seed(0)
    task = ImageClassifier(model=micro_vit(global_pool="token", in_chans=3))
    image = torch.randn(1, 3, 8, 8)  # three channels: the panel shows their mean
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault("fig", fig) and name)
    one = (image, torch.tensor([1]))
    figures.attention_map(task, one, task.example_inputs(one), "run a", tmp_path, 6)
    fig = drawn["fig"]
    sites = sorted(figures.recorded(task, one), key=lambda s: s.layer)
    heads = len(fig.axes) // len(sites) - 1
    assert list(fig.get_size_inches()) == pytest.approx([2.1 * (heads + 1), 2.1 * len(sites)])
    assert fig._suptitle.get_text() == "run a: attention of patch 6 (red +)" and fig._suptitle.get_fontsize() == 9
    assert not any(ax.axison for ax in fig.axes)
    for row, s in enumerate(sites):
        first, *head_axes = fig.axes[row * (heads + 1) : (row + 1) * (heads + 1)]
        assert (first.get_title(), first.title.get_fontsize()) == (s.name, 8)
        (shown,) = first.get_images()
        np.testing.assert_allclose(np.asarray(shown.get_array()), image[0].mean(0).numpy(), rtol=1e-6)
        assert shown.get_cmap().name == "gray"
        for h, ax in enumerate(head_axes):
            assert (ax.get_title(), ax.title.get_fontsize()) == (f"head {h}", 8)
            assert ax.get_images()[0].get_cmap().name == "viridis"
            (marker,) = ax.get_lines()  # patch 6 of a 4-wide grid: row 1, column 2
            assert (list(marker.get_xdata()), list(marker.get_ydata())) == ([2], [1])
            assert (marker.get_marker(), marker.get_color(), marker.get_linestyle()) == ("+", "r", "None")


@pytest.mark.parametrize("training", [True, False])
def test_grad_cam_figure_overlays_the_map_on_the_image_and_keeps_the_mode(tmp_path, monkeypatch, training):
    from mmlight.analysis import figures
    from mmlight.tasks import ImageClassifier

    torch.manual_seed(0)
    task = ImageClassifier(model=micro_vit(global_pool="avg", in_chans=2)).train(training)
    image = torch.randn(1, 2, 8, 8)
    inputs = task.example_inputs((image, torch.tensor([0])))
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault(name, fig) and name)
    assert figures.grad_cam(task, inputs, "run/b", tmp_path) == "fig6_gradcam_run_b.png"
    assert task.model.training is training  # Grad-CAM ran in eval mode, then the mode came back
    fig = drawn["fig6_gradcam_run_b.png"]
    assert list(fig.get_size_inches()) == pytest.approx([5.0, 2.6]) and not any(ax.axison for ax in fig.axes)
    assert fig._suptitle.get_text() == "run/b: Grad-CAM of the predicted class" and fig._suptitle.get_fontsize() == 9
    (plain,), (under, heat) = (ax.get_images() for ax in fig.axes)
    for shown in (plain, under):
        np.testing.assert_allclose(np.asarray(shown.get_array()), image[0].mean(0).numpy(), rtol=1e-6)
        assert shown.get_cmap().name == "gray"
    task.eval()
    want = reference_grad_cam(task.model, image)  # the predicted class's map, by its definition above
    np.testing.assert_allclose(np.asarray(heat.get_array()), want.numpy(), atol=1e-5)
    assert (heat.get_cmap().name, heat.get_alpha()) == ("jet", 0.5)


def tiny_translation_batch():
    """One sentence pair with padding on both sides (pad id 1): 4 real source tokens, 3 real target ones."""
    return {
        "src": torch.tensor([[5, 6, 7, 2, 1]]),
        "src_mask": torch.tensor([[True, True, True, True, False]]),
        "tgt_in": torch.tensor([[2, 8, 9, 1]]),
    }


def test_text_heatmaps_show_the_head_mean_over_real_tokens_with_their_words(tmp_path, monkeypatch):
    """Per attention kind of a translation model, one figure: each layer's weights averaged over heads,
    padding rows and columns dropped, the axes labelled with the stacks and the tokens' words (the id where
    the vocabulary has none)."""
    from mmlight.analysis import figures
    from mmlight.nn.attention import record_attention
    from tests.helpers.models import tiny_translator

    task = tiny_translator(12)
    batch = tiny_translation_batch()
    vocab = ["<s>", "<pad>", "</s>", "<unk>", "a", "das", "ist", "gut", "this", "is"]  # ids 10, 11: no word
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault(name, fig) and name)
    names = figures.text_heatmaps(task, batch, task.example_inputs(batch), "run 1", tmp_path, vocab)
    assert names == [
        "attention_heatmap_encoder_self_run_1.png",
        "attention_heatmap_decoder_self_run_1.png",
        "cross_attention_alignment_run_1.png",
    ]
    with torch.no_grad(), record_attention(task.eval()) as recorder:
        task.teacher_forced(batch)
    src_words, tgt_words = ["das", "ist", "gut", "</s>"], ["</s>", "this", "is"]
    expected = {  # file: (site, query stack, key stack, rows kept, columns kept, row words, column words)
        names[0]: ("encoder.layers.0.self_attn", "encoder", "encoder", 4, 4, src_words, src_words),
        names[1]: ("decoder.layers.0.self_attn", "decoder", "decoder", 3, 3, tgt_words, tgt_words),
        names[2]: ("decoder.layers.0.cross_attn", "decoder", "encoder", 3, 4, tgt_words, src_words),
    }
    for name, (site_name, q_stack, k_stack, rows, cols, row_words, col_words) in expected.items():
        fig = drawn[name]
        title = "cross attention alignment" if "cross" in name else f"attention heatmap {q_stack} self"
        assert fig._suptitle.get_text() == f"run 1: {title} (mean over heads)" and fig._suptitle.get_fontsize() == 9
        assert list(fig.get_size_inches()) == pytest.approx([4.2, 3.8])  # one layer: one panel
        (ax,) = visible(fig)
        assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (
            site_name,
            f"key ({k_stack})",
            f"query ({q_stack})",
        )
        (shown,) = ax.get_images()
        want = recorder[site_name][0].weights[0].mean(0)[:rows, :cols]  # (rows, cols): the padding is last
        np.testing.assert_allclose(np.asarray(shown.get_array()), want.numpy(), rtol=1e-5, atol=1e-7)
        assert (shown.get_cmap().name, ax.get_aspect()) == ("viridis", "auto")
        assert [t.get_text() for t in ax.get_xticklabels()] == col_words
        assert [t.get_text() for t in ax.get_yticklabels()] == row_words
        assert {(t.get_fontsize(), t.get_rotation()) for t in ax.get_xticklabels()} == {(5, 90)}
        assert {(t.get_fontsize(), t.get_rotation()) for t in ax.get_yticklabels()} == {(5, 0)}
    # without a vocabulary, or past its end, the ids label the ticks
    drawn.clear()
    figures.text_heatmaps(task, batch, task.example_inputs(batch), "run", tmp_path)
    ax = visible(drawn["cross_attention_alignment_run.png"])[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["5", "6", "7", "2"]
    drawn.clear()
    figures.text_heatmaps(task, batch, task.example_inputs(batch), "run", tmp_path, vocab[:6])
    ax = visible(drawn["cross_attention_alignment_run.png"])[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["das", "6", "7", "</s>"]


def test_text_heatmaps_leave_long_sequences_and_unnamed_stacks_without_words(tmp_path, monkeypatch):
    from mmlight.analysis import figures
    from mmlight.tasks.protocol import ExampleInputs
    from tests.helpers.models import tiny_translator

    task = tiny_translator(12)
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault(name, fig) and name)
    vocab = [f"w{i}" for i in range(12)]

    def ticks(batch, inputs):
        drawn.clear()
        figures.text_heatmaps(task, batch, inputs, "r", tmp_path, vocab)
        (ax,) = visible(drawn["cross_attention_alignment_r.png"])
        return [t.get_text() for t in ax.get_xticklabels()], [t.get_text() for t in ax.get_yticklabels()]

    batch = tiny_translation_batch()
    columns, rows = ticks(batch, ExampleInputs(tokens={"decoder": batch["tgt_in"]}))  # no encoder tokens named
    assert "w5" not in columns and rows == ["w2", "w8", "w9"]
    for length, named in ((40, True), (41, False)):  # up to 40 real tokens get their words
        src = torch.full((1, length + 1), 5)
        src[0, -1] = 1
        long = {**batch, "src": src, "src_mask": src != 1}
        columns, _ = ticks(long, task.example_inputs(long))
        assert (columns == ["w5"] * length) is named


def test_attention_map_of_a_one_layer_network_on_a_wide_patch_grid(tmp_path, monkeypatch):
    """A task of one attention layer (its figure is one row) whose image is 2 x 8 patches: the default
    query is the centre patch of that grid, row 1 and column 4."""
    from collections import namedtuple

    from mmlight.analysis import figures
    from mmlight.tasks.protocol import ExampleInputs

    site = namedtuple("Site", "name layer")("only", 0)
    weights = torch.rand(2, 1 + 16, 1 + 16)  # (nh, CLS + 2 x 8 patches, same)
    monkeypatch.setattr(figures, "recorded", lambda task, batch: {site: weights})
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault("fig", fig) and name)
    inputs = ExampleInputs(image=torch.rand(1, 1, 4, 16), patch_grid=(2, 8), prefix=1)
    assert figures.attention_map(None, None, inputs, "r", tmp_path, None) == "fig7_attention_map_r.png"
    fig = drawn["fig"]
    assert len(fig.axes) == 3 and list(fig.get_size_inches()) == pytest.approx([2.1 * 3, 2.1])
    assert fig._suptitle.get_text() == "r: attention of patch 12 (red +)"
    for h, ax in enumerate(fig.axes[1:]):
        shown = np.asarray(ax.get_images()[0].get_array())
        np.testing.assert_array_equal(shown, weights[h, 1 + 12, 1:].reshape(2, 8).numpy())
        (marker,) = ax.get_lines()
        assert (list(marker.get_xdata()), list(marker.get_ydata())) == ([4], [1])


def test_grad_cam_panels_side_by_side(tmp_path, monkeypatch):
    from mmlight.analysis import figures
    from mmlight.tasks import ImageClassifier

    task = ImageClassifier(model=micro_vit())
    inputs = task.example_inputs((torch.randn(1, 1, 8, 8), torch.tensor([0])))
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault("fig", fig) and name)
    figures.grad_cam(task, inputs, "r", tmp_path)
    left, right = (ax.get_position() for ax in drawn["fig"].axes)
    assert len(drawn["fig"].axes) == 2 and left.y0 == pytest.approx(right.y0) and left.x1 < right.x0  # one row of two


def test_text_heatmaps_of_four_layers_and_a_stack_without_a_mask(tmp_path, monkeypatch):
    """Four decoder layers lay out as rows of three panels in depth order; a stack whose ``query_keep``
    is None keeps every position (here the whole source, its padding included)."""
    from mmlight.analysis import figures
    from mmlight.tasks import Translator
    from tests.helpers.models import tiny_transformer

    torch.manual_seed(0)
    task = Translator(tiny_transformer(vocab_size=12, n_layers=4, n_encoder_layers=1, dropout=0.0))
    batch = tiny_translation_batch()
    masks = task.query_keep(batch)
    monkeypatch.setattr(task, "query_keep", lambda batch: {**masks, "encoder": None})
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault(name, fig) and name)
    figures.text_heatmaps(task, batch, task.example_inputs(batch), "r", tmp_path)
    fig = drawn["cross_attention_alignment_r.png"]
    assert len(fig.axes) == 6 and list(fig.get_size_inches()) == pytest.approx([3 * 4.2, 2 * 3.8])
    axes = visible(fig)
    assert [ax.get_title() for ax in axes] == [f"decoder.layers.{i}.cross_attn" for i in range(4)]
    assert {np.asarray(ax.get_images()[0].get_array()).shape for ax in axes} == {(3, 5)}  # all 5 source positions
    (encoder,) = visible(drawn["attention_heatmap_encoder_self_r.png"])
    assert np.asarray(encoder.get_images()[0].get_array()).shape == (5, 5)


def test_examples_pass_the_query_patch_and_the_vocabulary_on(tmp_path, monkeypatch):
    """``examples`` hands its ``query_patch`` to Figure 7 and its vocabulary to the text heat maps; the
    colour maps are the figures' own, whatever the user's matplotlib style says."""
    import matplotlib

    from mmlight.analysis import figures
    from mmlight.tasks import ImageClassifier
    from tests.helpers.models import tiny_translator

    drawn = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.setdefault(name, fig) and name)
    monkeypatch.setattr(figures, "grad_cam", lambda *args: "cam")
    task = ImageClassifier(model=micro_vit(global_pool="token"))
    with matplotlib.rc_context({"image.cmap": "magma"}):
        figures.examples(task, (torch.randn(2, 1, 8, 8), torch.tensor([1, 2])), "v", tmp_path, query_patch=5)
    fig = drawn["fig7_attention_map_v.png"]
    assert fig._suptitle.get_text() == "v: attention of patch 5 (red +)"
    assert {im.get_cmap().name for ax in fig.axes[1:5] for im in ax.get_images()} == {"viridis"}
    translator = tiny_translator(12)
    vocab = [f"w{i}" for i in range(12)]
    with matplotlib.rc_context({"image.cmap": "magma"}):
        figures.examples(translator, tiny_translation_batch(), "t", tmp_path, vocab=vocab)
    (ax,) = visible(drawn["cross_attention_alignment_t.png"])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["w5", "w6", "w7", "w2"]
    assert ax.get_images()[0].get_cmap().name == "viridis"


def test_layers_figure_draws_counts_unless_asked_for_the_cdf():
    from mmlight.analysis.figures import layers_figure

    stats = {"histogram_edges": [0.1, 1.0], "sites": {"blocks.0": {"histogram": [1, 3]}}}
    assert layers_figure(stats).axes[0].get_ylabel() == "count"


def test_the_extrapolation_figure_draws_each_bucket_at_its_centre_and_names_what_is_past_the_table():
    """Two runs: each bucket at its centre (a bucket without a perplexity left out), one line per defined
    multiple, the end of the training context dashed; the last panel the whole-window perplexity per
    multiple on a log2 axis ticked at every multiple of either run."""
    buckets = [{"start": 0, "stop": 2, "ppl": 3.0}, {"start": 2, "stop": 3, "ppl": 5.0}]
    longer = [*buckets, {"start": 3, "stop": 6, "ppl": 6.0}, {"start": 6, "stop": 6, "ppl": None}]
    first = {
        "context": 3,
        "multiples": {
            1: {"defined": True, "ppl": 4.0, "buckets": buckets},
            2: {"defined": True, "ppl": 5.5, "buckets": longer},
            4: {"defined": False, "reason": "past the table"},
            8: {"defined": False, "reason": "past the table"},
        },
    }
    second = {
        "context": 4,
        "multiples": {
            1: {"defined": True, "ppl": 2.0, "buckets": buckets},
            8: {"defined": True, "ppl": None, "buckets": []},
        },
    }
    fig = figures.extrapolation_figure({"run": first, "other": second})
    panel, other, whole = fig.axes[:3]
    one, two, edge = panel.get_lines()
    assert (one.get_label(), list(one.get_xdata()), list(one.get_ydata())) == ("1x", [0.5, 2.0], [3.0, 5.0])
    assert (two.get_label(), list(two.get_xdata()), list(two.get_ydata())) == ("2x", [0.5, 2.0, 4.0], [3.0, 5.0, 6.0])
    assert one.get_marker() == "."
    assert list(edge.get_xdata()) == [2.5, 2.5] and edge.get_linestyle() == "--" and edge.get_linewidth() == 0.8
    assert edge.get_color() == "k"
    assert list(other.get_lines()[-1].get_xdata()) == [3.5, 3.5]
    assert panel.get_title() == "run (4x, 8x: past the position table)" and other.get_title() == "other"
    assert panel.title.get_fontsize() == 8
    assert (panel.get_xlabel(), panel.get_ylabel(), panel.get_yscale()) == ("position in window", "perplexity", "log")
    assert [t.get_text() for t in panel.get_legend().get_texts()] == ["1x", "2x"]
    assert panel.get_legend().get_texts()[0].get_fontsize() == 6
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in whole.get_lines()}
    assert lines == {"run": ([1, 2], [4.0, 5.5]), "other": ([1], [2.0])}
    assert whole.get_lines()[0].get_marker() == "o"
    assert (whole.get_title(), whole.get_xlabel(), whole.get_ylabel()) == (
        "whole window",
        "x training context",
        "perplexity",
    )
    assert (whole.get_xscale(), whole.get_yscale(), whole.xaxis.get_transform().base) == ("log", "log", 2)
    assert list(whole.get_xticks()) == [1, 2, 4, 8]
    assert [t.get_text() for t in whole.get_xticklabels()] == ["1x", "2x", "4x", "8x"]
    assert [t.get_text() for t in whole.get_legend().get_texts()] == ["run", "other"]
    assert whole.get_legend().get_texts()[0].get_fontsize() == 6
    assert list(fig.get_size_inches()) == [3 * 4.2, 3.2]  # 3 panels of 4.2 x 3.2 inches in a row
    fig = figures.extrapolation_figure({"a": second, "b": second, "c": second})
    assert list(fig.get_size_inches()) == [3 * 4.2, 2 * 3.2]  # 4 panels: 3 to a row


def test_the_massive_figure_draws_the_largest_and_median_magnitude_and_their_ratio_per_block():
    """Two panels side by side; per run, one colour: its largest (solid, o) and median (dashed, .)
    magnitude per block, and their ratio; a block without values is a gap (NaN)."""
    blocks = {
        "b0": {"top_mean": [10.0, 2.0], "median": 1.0, "ratio": 9.0},
        "b1": {"top_mean": [400.0, 3.0], "median": 2.0, "ratio": 250.0},
    }
    empty = {"b0": {"top_mean": [], "median": None, "ratio": None}, "b1": blocks["b1"]}
    fig = figures.massive_figure({"run": {"blocks": blocks}, "other": {"blocks": empty}})
    assert len(fig.axes) == 2 and list(fig.get_size_inches()) == [2 * 4.5, 3.4]
    magnitude, ratio = fig.axes
    top, median, other_top, other_median = magnitude.get_lines()
    assert list(top.get_xdata()) == [1, 2]
    assert list(top.get_ydata()) == [10.0, 400.0] and list(median.get_ydata()) == [1.0, 2.0]
    assert np.isnan(other_top.get_ydata()[0]) and list(other_top.get_ydata())[1:] == [400.0]
    assert np.isnan(other_median.get_ydata()[0]) and np.isnan(ratio.get_lines()[1].get_ydata()[0])
    assert (top.get_linestyle(), top.get_marker(), median.get_linestyle(), median.get_marker()) == ("-", "o", "--", ".")
    assert top.get_color() == median.get_color() == ratio.get_lines()[0].get_color() == "C0"
    assert other_top.get_color() == other_median.get_color() == ratio.get_lines()[1].get_color() == "C1"
    assert [ln.get_label() for ln in magnitude.get_lines()] == [
        "run top 1",
        "run median",
        "other top 1",
        "other median",
    ]
    assert list(ratio.get_lines()[0].get_ydata()) == [9.0, 250.0] and ratio.get_lines()[0].get_label() == "run"
    assert (magnitude.get_title(), magnitude.get_xlabel(), magnitude.get_ylabel(), magnitude.get_yscale()) == (
        "hidden-state magnitude",
        "block (depth order)",
        "|h|",
        "log",
    )
    assert (ratio.get_title(), ratio.get_xlabel(), ratio.get_ylabel(), ratio.get_yscale()) == (
        "largest / median",
        "block (depth order)",
        "ratio",
        "log",
    )
    assert [t.get_text() for t in ratio.get_legend().get_texts()] == ["run", "other"]
    assert ratio.get_legend().get_texts()[0].get_fontsize() == 6
    lines = magnitude.get_lines() + ratio.get_lines()
    assert all(list(line.get_xdata()) == [1, 2] for line in lines)  # blocks numbered from 1 in depth order
    assert [line.get_marker() for line in ratio.get_lines()] == ["o", "o"]
    assert integer_ticks(magnitude) and integer_ticks(ratio)


def test_the_attention_loss_figure_draws_each_method_pooled_beside_its_oracle_per_checkpoint(monkeypatch, tmp_path):
    """Only the rows of layer ``all`` with a loss are drawn, sorted by keep ratio: a solid line per method
    (named without ``kv_``) and the oracle's dotted in its colour; the x axis runs from keep 1 down, the
    top axis is 1 - r. Four checkpoints: three panels to a row."""
    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.append(fig) or name)
    rows = [
        ("a", "kv_l2", 0.9, 0.1, "all", 10, 0.05, 0.02),
        ("a", "kv_l2", 0.5, 0.5, "all", 10, 0.2, 0.1),
        ("a", "kv_l2", 0.5, 0.5, "1", 5, 9.0, 9.0),  # one layer: not drawn
        ("a", "kv_random", 0.5, 0.5, "all", 10, 0.4, 0.1),
        ("a", "kv_none", 1.0, 0.0, "all", 10, None, 0.0),  # no loss: not drawn
        ("only_layers", "kv_l2", 0.5, 0.5, "1", 5, 9.0, 9.0),  # no pooled row: no panel
        *[(label, "kv_l2", 0.7, 0.3, "all", 10, 0.3, 0.25) for label in ("b", "c", "d")],
    ]
    assert figures.attention_loss(rows, tmp_path) == "kv_attention_loss.png"
    (fig,) = drawn
    assert list(fig.get_size_inches()) == [3 * 4.5, 2 * 3.4]
    panel = fig.axes[0]
    l2, l2_oracle, random, random_oracle = panel.get_lines()
    assert (list(l2.get_xdata()), list(l2.get_ydata()), list(l2_oracle.get_ydata())) == (
        [0.5, 0.9],
        [0.2, 0.05],
        [0.1, 0.02],
    )
    assert (list(random.get_xdata()), list(random.get_ydata()), list(random_oracle.get_ydata())) == (
        [0.5],
        [0.4],
        [0.1],
    )
    assert (l2.get_linestyle(), l2.get_marker(), l2_oracle.get_linestyle(), l2_oracle.get_alpha()) == (
        "-",
        "o",
        ":",
        0.8,
    )
    assert l2.get_color() == l2_oracle.get_color() == "C0" and random.get_color() == random_oracle.get_color() == "C1"
    assert [t.get_text() for t in panel.get_legend().get_texts()] == ["l2", "random"]
    assert panel.get_title() == "a\n(dotted: oracle at the same budget)" and panel.title.get_fontsize() == 8
    assert (panel.get_xlabel(), panel.get_ylabel(), panel.xaxis_inverted()) == ("keep ratio r", "attention loss", True)
    assert list(l2_oracle.get_xdata()) == [0.5, 0.9] and list(random_oracle.get_xdata()) == [0.5]
    assert panel.get_legend().get_texts()[0].get_fontsize() == 6
    assert panel.xaxis.get_gridlines()[0].get_alpha() == 0.3
    (top,) = [child for child in panel.child_axes]
    assert top.get_xlabel() == "compression ratio 1 - r" and top.xaxis.label.get_fontsize() == 7
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # lays out the top axis: 1 - r of the bottom one, both ways
    assert sorted(top.get_xlim()) == pytest.approx(sorted(1 - r for r in panel.get_xlim()))
    for c in top.get_xticks():
        at_top, below = top.transData.transform([(c, 0)])[0][0], panel.transData.transform([(1 - c, 0)])[0][0]
        assert at_top == pytest.approx(below)
    assert [ax.get_title().split("\n")[0] for ax in fig.axes if ax.get_lines()] == ["a", "b", "c", "d"]


def test_the_key_norm_figure_draws_each_layer_s_pairs_at_most_3000_of_them_distinct(monkeypatch, tmp_path):
    """A panel per (checkpoint, layer), as many columns as the most layers; a panel of more pairs than
    ``points`` draws that many distinct pairs of its own (norm i with received 2i), the others all of them."""
    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.append(fig) or name)

    def entry(n, r=0.5, rho=-0.25):
        return {
            "norm": [float(i) for i in range(n)],
            "received": [2.0 * i for i in range(n)],
            "pairs": n,
            "pearson": r,
            "spearman": rho,
        }

    results = {"a": {"layers.0": entry(3001), "layers.1": entry(5, 0.123, 0.987)}, "b": {"layers.0": entry(2)}}
    assert figures.key_norm_attention(results, tmp_path) == "key_norm_attention.png"
    (fig,) = drawn
    assert list(fig.get_size_inches()) == [2 * 3.6, 2 * 3.0]
    big, small, other = fig.axes[:3]
    pairs = big.collections[0].get_offsets()
    assert len(pairs) == 3000 and len({float(x) for x in pairs[:, 0]}) == 3000
    assert all(y == 2 * x and 0 <= x <= 3000 for x, y in pairs.tolist())
    assert small.collections[0].get_offsets().tolist() == [[i, 2 * i] for i in range(5)]
    assert other.collections[0].get_offsets().tolist() == [[0, 0], [1, 2]]
    assert small.get_title() == "a layers.1\nr = 0.12, rho = 0.99, n = 5" and small.title.get_fontsize() == 7
    assert other.get_title() == "b layers.0\nr = 0.50, rho = -0.25, n = 2"
    assert (small.get_xlabel(), small.get_ylabel()) == ("key L2 norm", "mean attention received")
    dots = small.collections[0]
    assert list(dots.get_sizes()) == [3] and dots.get_alpha() == 0.4
    figures.key_norm_attention({"a": {"layers.1": entry(5)}}, tmp_path, points=2)
    assert len(drawn[-1].axes[0].collections[0].get_offsets()) == 2
    figures.key_norm_attention({"a": {"layers.1": entry(5)}}, tmp_path, points=5)  # all of them, in order
    assert drawn[-1].axes[0].collections[0].get_offsets().tolist() == [[i, 2 * i] for i in range(5)]
    torch.manual_seed(1)  # the subset is fixed: the global generator's state does not choose it
    figures.key_norm_attention(results, tmp_path)
    torch.manual_seed(2)
    figures.key_norm_attention(results, tmp_path)
    first, again = (fig.axes[0].collections[0].get_offsets().tolist() for fig in drawn[-2:])
    assert first == again == pairs.tolist()


def test_the_massive_figure_cycles_ten_colours_over_the_runs():
    from matplotlib.colors import to_rgba

    run = {"blocks": {"b0": {"top_mean": [4.0], "median": 1.0, "ratio": 4.0}}}
    fig = figures.massive_figure({f"run{i}": run for i in range(12)})
    colours = [to_rgba(line.get_color()) for line in fig.axes[1].get_lines()]
    assert colours == [to_rgba(f"C{i % 10}") for i in range(12)] and colours[11] != colours[10]


def test_the_attention_loss_figure_cycles_ten_colours_over_the_methods_and_their_oracles(monkeypatch, tmp_path):
    from matplotlib.colors import to_rgba

    drawn = []
    monkeypatch.setattr(figures, "save", lambda fig, out, name: drawn.append(fig) or name)
    rows = [("a", f"kv_m{i:02d}", 0.5, 0.5, "all", 10, 0.2, 0.1) for i in range(12)]
    figures.attention_loss(rows, tmp_path)
    colours = [to_rgba(line.get_color()) for line in drawn[0].axes[0].get_lines()]
    assert colours == [to_rgba(f"C{i % 10}") for i in range(12) for _ in (0, 1)]
