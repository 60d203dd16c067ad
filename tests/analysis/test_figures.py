"""The Grad-CAM reshape for CLS and GAP heads, and Grad-CAM through the grad-cam package on both."""

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
