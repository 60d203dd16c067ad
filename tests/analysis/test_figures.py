"""The Grad-CAM reshape for CLS and GAP heads, and Grad-CAM through the grad-cam package on both."""

import pytest
import torch

from mmlight.analysis.figures import grad_cam_map, vit_reshape
from mmlight.models import ReweightedViT, ViTConfig


@pytest.mark.parametrize("prefix", [0, 1])
def test_reshape_puts_each_patch_at_its_grid_position(prefix):
    h, w, C = 3, 4, 2
    n = prefix + h * w
    tokens = torch.arange(n, dtype=torch.float)[None, :, None].expand(1, n, C)  # token i holds value i
    grid = vit_reshape(prefix, (h, w))(tokens)  # (1, C, h, w)
    assert grid.shape == (1, C, h, w)
    for i in range(h * w):
        assert grid[0, 0, i // w, i % w] == prefix + i  # the CLS token (index 0) is dropped when present


@pytest.mark.parametrize("pool", ["avg", "token"])
def test_grad_cam_on_gap_and_cls_heads(pool):
    torch.manual_seed(0)
    model = ReweightedViT(ViTConfig(variant="vit_micro", img_size=8, patch_size=2, in_chans=1, num_classes=10,
                                    global_pool=pool)).eval()
    vit = model.vit
    heat = grad_cam_map(model, torch.randn(1, 1, 8, 8), vit.blocks[-1].norm1, vit.num_prefix_tokens, (4, 4))
    assert heat.shape == (8, 8)
    assert torch.isfinite(heat).all() and heat.min() >= 0 and heat.max() <= 1


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
