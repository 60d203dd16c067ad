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
