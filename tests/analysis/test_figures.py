"""The Grad-CAM reshape for CLS and GAP heads, and Grad-CAM through the grad-cam package on both."""

import numpy as np
import pytest
import torch

from mmlight.analysis.figures import grad_cam_map, vit_reshape
from mmlight.models import ReweightedViT
from tests.models.test_vit import micro_vit


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

    assert safe("runs/a b:c-1.0") == "runs_a_b_c-1.0"
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
