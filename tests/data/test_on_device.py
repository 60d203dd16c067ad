"""uint8 batches finished on the device (mmlight.data.on_device) against timm's own RandomErasing and
the worker-side float32 path: the same boxes under one seed, the same pixels outside them, fills
with timm's distribution, and a trainer that hands the steps normalised images."""

import random
import warnings

import lightning as L
import pytest
import torch
from PIL import Image
from timm.data.random_erasing import RandomErasing
from torchvision import transforms as tv

from mmlight.data import ImageShardDataModule
from mmlight.data.image_decode import AugmentGroup, NormalizedBatches, SplitTransform, Uint8Batches
from mmlight.data.on_device import ErasingBoxes, draw_boxes, draw_erasing, erased, normalized, normalized_batch
from tests.helpers.images import DEIT_16, DEIT_LIKE, box_mask, seeded, smooth_jpeg, write_image_shards
from tests.helpers.trainer import quiet_trainer


@pytest.mark.parametrize("max_count", [1, 3])
def test_boxes_are_timms_under_the_same_seed(max_count):
    """timm's RandomErasing in 'const' mode on a tensor of ones leaves its boxes as zeros: under the
    same seed, draw_boxes gives exactly those boxes, and leaves Python's generator where timm does."""
    erasing = RandomErasing(probability=0.6, mode="const", max_count=max_count, device="cpu")
    fired = 0
    for seed in range(300):
        random.seed(seed)
        expected = erasing(torch.ones(3, 23, 31))[0] == 0  # (H, W)
        state = random.getstate()
        random.seed(seed)
        boxes = draw_boxes(erasing, 23, 31)
        assert random.getstate() == state
        assert torch.equal(box_mask(torch.tensor(boxes).view(-1, 4), 23, 31), expected)
        fired += bool(boxes)
    assert 0.5 < fired / 300 < 0.7  # p = 0.6


def test_worker_and_device_path_equal_the_cpu_path():
    """One seed, one image, 6 copies through the DeiT-like transform: uint8 batch + device step
    against NormalizedBatches (timm's ToTensor, Normalize, RandomErasing 'pixel'). Outside the
    boxes the images agree to float rounding; the CPU path's erased pixels are exactly the boxes."""
    data = smooth_jpeg(61, 47)
    split = SplitTransform(DEIT_16.build(train=True))
    group = AugmentGroup(3, split, copies=6, draft=False)
    erased_rows = kept_rows = 0
    for seed in range(6):
        seeded(seed)
        cpu, cpu_labels = NormalizedBatches(6, split, partial=True).collate(group({"jpg": data, "cls": "4"}))
        seeded(seed)
        images, labels, erasing = Uint8Batches(6, split, partial=True).collate(group({"jpg": data, "cls": "4"}))
        assert images.dtype == torch.uint8 and images.shape == (6, 16, 16, 3)
        device, device_labels = normalized_batch((images, labels, erasing), DEIT_16.mean, DEIT_16.std)
        assert torch.equal(device_labels, cpu_labels) and device.shape == cpu.shape == (6, 3, 16, 16)
        plain = normalized(images, DEIT_16.mean, DEIT_16.std)
        for row in range(6):
            mask = box_mask(erasing.boxes[row], 16, 16)  # (H, W)
            torch.testing.assert_close(device[row][:, ~mask], cpu[row][:, ~mask], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(plain[row][:, ~mask], cpu[row][:, ~mask], atol=1e-6, rtol=1e-6)
            assert torch.equal((cpu[row] != plain[row]).all(0), mask)  # timm's noise fills exactly the box
            assert torch.equal((device[row] != plain[row]).all(0), mask)
            erased_rows += bool(mask.any())
            kept_rows += not mask.any()
    assert erased_rows and kept_rows  # re_prob 0.5: both cases met


def test_fills_follow_timms_modes_and_the_seed():
    """'pixel': N(0, 1) per pixel and channel; 'rand': one N(0, 1) colour per box and channel;
    'const': zeros, a later box painting over an earlier one as in timm. Same seed, same fill."""
    boxes = torch.tensor([[[2, 3, 40, 50], [0, 0, 0, 0]], [[10, 10, 20, 20], [15, 15, 30, 30]]])  # (B=2, K=2, 4)
    base = torch.full((2, 3, 64, 64), 7.0)
    pixel = erased(base.clone(), ErasingBoxes(boxes, "pixel", seed=5))
    inside = pixel[0][:, 2:42, 3:53]
    assert abs(inside.mean().item()) < 0.06 and abs(inside.std().item() - 1) < 0.05  # 6,000 values
    assert (pixel[0][:, 42:] == 7).all() and (pixel[0][:, :, :3] == 7).all()
    assert torch.equal(pixel, erased(base.clone(), ErasingBoxes(boxes, "pixel", seed=5)))
    assert not torch.equal(pixel, erased(base.clone(), ErasingBoxes(boxes, "pixel", seed=6)))
    rand = erased(base.clone(), ErasingBoxes(boxes, "rand", seed=5))
    colour = rand[1][:, 15:45, 15:45]  # the second box, drawn over the first
    assert torch.equal(colour, colour[:, :1, :1].expand_as(colour)) and (colour != 7).all()
    assert torch.equal(rand[1][:, 10:15, 10:15], rand[1][:, 10:11, 10:11].expand(3, 5, 5))
    assert not torch.equal(rand[1][:, 10, 10], colour[:, 0, 0])
    const = erased(base.clone(), ErasingBoxes(boxes, "const", seed=5))
    expected = base.clone()
    for b in range(2):
        for top, left, h, w in boxes[b].tolist():
            expected[b, :, top : top + h, left : left + w] = 0
    assert torch.equal(const, expected)


def test_a_float_batch_passes_through_and_other_tensor_ops_are_refused():
    batch = (torch.randn(2, 3, 4, 4), torch.tensor([0, 1]))
    assert normalized_batch(batch, (0.5,) * 3, (0.5,) * 3) is batch
    from torchvision import transforms as tv

    split = SplitTransform(tv.Compose([tv.ToTensor(), tv.Normalize((0.5,), (0.5,)), tv.RandomErasing()]))
    with pytest.raises(ValueError, match="normalize_on_device=False"):
        Uint8Batches(2, split, partial=True)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_image_shards(tmp_path_factory.mktemp("images"), n=24, corrupt=())


def loaders(root, normalize_on_device: bool, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    data = ImageShardDataModule(
        str(root),
        batch_size=4,
        num_workers=0,
        augment=DEIT_LIKE,
        shuffle_buffer=10,
        repeated_augmentation=2,
        normalize_on_device=normalize_on_device,
        val_split="train",
    )
    return data, list(data.train_dataloader()), list(data.val_dataloader())


def test_datamodule_batches_after_the_transfer_hook_are_the_worker_side_ones(shards, monkeypatch):
    """Same seed: the training batches after ``on_after_batch_transfer`` equal the float32 loader's
    outside the erasing boxes, the boxes being where that loader erased; evaluation batches equal."""
    data, train, val = loaders(shards, True, monkeypatch)
    _, train_float, val_float = loaders(shards, False, monkeypatch)
    assert all(len(batch) == 3 and batch[0].dtype == torch.uint8 for batch in train)
    for batch, (expected, expected_labels) in zip(train, train_float):
        images, labels = data.on_after_batch_transfer(batch, 0)
        plain = normalized(batch[0], DEIT_LIKE.mean, DEIT_LIKE.std)
        assert torch.equal(labels, expected_labels)
        for row in range(4):
            mask = box_mask(batch[2].boxes[row], 16, 16)
            torch.testing.assert_close(images[row][:, ~mask], expected[row][:, ~mask], atol=1e-6, rtol=1e-6)
            assert torch.equal((expected[row] != plain[row]).all(0), mask)
    for batch, (expected, expected_labels) in zip(val, val_float, strict=True):
        assert len(batch) == 2 and batch[0].dtype == torch.uint8
        images, labels = data.on_after_batch_transfer(batch, 0)
        torch.testing.assert_close(images, expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(labels, expected_labels)


class Recorder(L.LightningModule):
    """Records the batches its steps receive; one weight so that fit has something to optimise."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(("train", batch))
        return self.weight * batch[0].mean()

    def validation_step(self, batch, batch_idx):
        self.seen.append(("val", batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("64-true", torch.float64)])
def test_trainer_steps_receive_normalised_float_images(shards, monkeypatch, tmp_path, precision, dtype):
    """Through Lightning, the DataModule's hook runs on every batch: the steps (and callbacks after
    the transfer, such as AttentionStats) see ``(B, C, H, W)`` images in the precision's input
    dtype (Lightning casts inputs before the transfer, when they are still uint8) and labels only."""
    data, _, _ = loaders(shards, True, monkeypatch)
    module = Recorder()
    trainer = quiet_trainer(max_steps=2, limit_val_batches=2, default_root_dir=tmp_path, precision=precision)
    trainer.fit(module, datamodule=data)
    stages = {stage for stage, _ in module.seen}
    assert stages == {"train", "val"}
    low, high = (
        min(-m / s for m, s in zip(DEIT_LIKE.mean, DEIT_LIKE.std)),
        max((1 - m) / s for m, s in zip(DEIT_LIKE.mean, DEIT_LIKE.std)),
    )
    for stage, batch in module.seen:
        assert len(batch) == 2 and batch[0].dtype == dtype and batch[0].shape == (4, 3, 16, 16)
        if stage == "val":  # no erasing noise: every value in the normalised range of 0..255
            assert low - 1e-5 <= batch[0].min() and batch[0].max() <= high + 1e-5


@pytest.mark.parametrize("height, width, max_count", [(23, 31, 3), (3, 200, 2), (40, 5, 1)])
def test_a_batch_of_boxes_is_timms_on_a_batch_under_the_same_seed(height, width, max_count):
    """timm's RandomErasing on a ``(B, C, H, W)`` batch of ones in 'const' mode zeroes its boxes row after
    row: draw_erasing gives exactly those boxes per row, as int64, for wide, tall and thin images (on a
    3-pixel-high image most draws fail timm's fit test and some boxes give up after their 10 attempts)."""
    erasing = RandomErasing(probability=0.7, mode="const", max_count=max_count, device="cpu")
    for seed in range(60):
        random.seed(seed)
        expected = erasing(torch.ones(5, 2, height, width))[:, 0] == 0  # (B, H, W)
        random.seed(seed)
        drawn = draw_erasing(erasing, 5, height, width)
        assert drawn.boxes.dtype == torch.int64 and drawn.boxes.shape == (5, max_count, 4)
        for row in range(5):
            assert torch.equal(box_mask(drawn.boxes[row], height, width), expected[row])


def test_a_boundary_draw_erases_as_timm_does(monkeypatch):
    """Draws exactly on timm's bounds, with ``random()`` equal to the probability (timm still erases) and
    square boxes (aspect ratio e^0): a box one pixel smaller than the 8 x 8 image fits, one of the image's
    size never does (timm's strict ``<``: ten attempts, then no box)."""
    monkeypatch.setattr(random, "random", lambda: 0.5)
    monkeypatch.setattr(random, "uniform", lambda low, high: 0.0 if low < 0 else low)
    for area, side in ((0.75, 7), (1.0, None)):  # round(sqrt(0.75 * 64)) = 7; sqrt(64) = 8
        erasing = RandomErasing(probability=0.5, mode="const", min_area=area, max_area=area, device="cpu")
        random.seed(0)
        expected = erasing(torch.ones(1, 8, 8))[0] == 0
        random.seed(0)
        boxes = draw_boxes(erasing, 8, 8)
        assert [box[2:] for box in boxes] == ([] if side is None else [(side, side)])
        assert torch.equal(box_mask(torch.tensor(boxes).view(-1, 4), 8, 8), expected)


@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
def test_the_boxes_carry_timms_mode_and_a_fill_seed_per_batch(mode):
    """The fill mode is the transform's; the seed is drawn from torch's generator (the same torch seed, the
    same seed) and differs from batch to batch (200 batches, 200 seeds)."""
    erasing = RandomErasing(probability=1.0, mode=mode, device="cpu")
    torch.manual_seed(0)
    seeds = [draw_erasing(erasing, 2, 8, 8).seed for _ in range(200)]
    torch.manual_seed(0)
    assert draw_erasing(erasing, 2, 8, 8).mode == mode and draw_erasing(erasing, 2, 8, 8).seed == seeds[1]
    assert len(set(seeds)) == 200 and all(0 <= seed < 2**63 for seed in seeds)


@pytest.mark.parametrize("mode", ["pixel", "rand", "const"])
def test_erasing_keeps_the_images_dtype(mode):
    """bf16 images stay bf16 (the fill is drawn in the images' dtype, not promoted to float32); pixels
    outside the box are untouched."""
    boxes = torch.tensor([[[1, 2, 3, 4]]])  # (B=1, K=1, 4)
    images = torch.full((1, 3, 6, 8), 0.25, dtype=torch.bfloat16)
    out = erased(images, ErasingBoxes(boxes, mode, seed=1))
    assert out.dtype == torch.bfloat16 and out.shape == images.shape
    mask = box_mask(boxes[0], 6, 8)
    assert (out[0][:, ~mask] == 0.25).all()
    assert (out[0][:, mask] != 0.25).all()


def test_normalized_keeps_the_device_float32_and_the_worker_side_values():
    """On another device (``meta`` stands in for an accelerator) the output is made there; under a float64
    default dtype (Lightning's ``64-true`` sets it) it is still float32 and equal, bit for bit, to the
    worker-side rows; no resize warning from a wrongly shaped ``out``. Mean and std unused elsewhere, so
    the cached constants are made in this test."""
    mean, std = (0.41, 0.52, 0.33), (0.27, 0.21, 0.19)
    images = torch.randint(0, 256, (3, 5, 7, 3), dtype=torch.uint8)  # (B, H, W, C), H != W
    on_meta = normalized(images.to("meta"), mean, std)
    assert on_meta.device.type == "meta" and on_meta.shape == (3, 3, 5, 7) and on_meta.dtype == torch.float32
    split = SplitTransform(tv.Compose([tv.ToTensor(), tv.Normalize(mean, std)]))
    worker = NormalizedBatches(3, split, partial=True)
    rows = torch.stack([worker.collate([(Image.fromarray(image.numpy()), 0)])[0][0] for image in images])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = normalized(images, mean, std)
    finally:
        torch.set_default_dtype(default)
    assert out.dtype == torch.float32 and torch.equal(out, rows)


def test_only_a_uint8_image_batch_is_finished():
    """A list batch of uint8 images is normalised like a tuple; anything else comes back as it is: a
    dict, a bare tensor, a batch whose first item is not a tensor."""
    images, labels = torch.full((2, 4, 4, 3), 255, dtype=torch.uint8), torch.tensor([0, 1])
    out, out_labels = normalized_batch([images, labels], (0.5,) * 3, (0.25,) * 3)
    assert out.shape == (2, 3, 4, 4) and torch.allclose(out, torch.full_like(out, 2.0)) and out_labels is labels
    for batch in ({"images": images}, images, (["a", "b"], images), ("ab", labels)):
        assert normalized_batch(batch, (0.5,) * 3, (0.25,) * 3) is batch


def test_rand_fills_are_a_function_of_the_seed():
    """'rand' colours come from the batch's seeded generator: the same seed gives the same colours whatever
    torch's global generator did, another seed others."""
    boxes = torch.tensor([[[0, 0, 2, 2]], [[1, 1, 2, 2]]])  # (B=2, K=1, 4)
    base = torch.zeros(2, 3, 4, 4)
    torch.manual_seed(0)
    first = erased(base.clone(), ErasingBoxes(boxes, "rand", seed=11))
    torch.manual_seed(1)
    assert torch.equal(first, erased(base.clone(), ErasingBoxes(boxes, "rand", seed=11)))
    assert not torch.equal(first, erased(base.clone(), ErasingBoxes(boxes, "rand", seed=12)))
