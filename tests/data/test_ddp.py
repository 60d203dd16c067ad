"""Two CPU processes (gloo DDP) through the real `mmlight` command over shard sets whose shard
counts do not divide evenly between the ranks: no hang, equal step counts on both ranks, every
validation sample counted exactly once, and synced metrics equal to a single-process validation (run in
the test's own process)."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmlight.data.shard_writer import plan_shards, write_shards
from mmlight.data.shards import write_info
from tests.helpers.ddp_probe import run_probed

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart" / "digits_multimax.yaml"


def png_sample(item):
    key, label, seed = item
    pixels = np.random.default_rng(seed).integers(0, 255, (8, 8), dtype=np.uint8)
    pixels[label % 8, :] = 255  # a learnable cue
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buf, format="PNG")
    return {"__key__": key, "png": buf.getvalue(), "cls": str(label)}


def write_uneven_shards(out: Path) -> None:
    """train: 50 samples in 3 shards (20/20/10); val: 23 samples in 3 shards (10/10/3), so rank 0
    reads 2 validation shards and rank 1 one."""
    info = {"classes": [str(c) for c in range(10)], "splits": {}}
    for split, n, per_shard in (("train", 50, 20), ("val", 23, 10)):
        items = [(f"{split}{i:03d}", i % 10, i + (1000 if split == "val" else 0)) for i in range(n)]
        info["splits"][split] = write_shards(plan_shards(split, items, per_shard), out, png_sample)
    write_info(out, info)


def run_on_shards(args, probe_dir, tmp_path, processes):
    """``mmlight ARGS`` on the uneven shards with the probe callback."""
    common = [
        "--config",
        str(QUICKSTART),
        "--data",
        "mmlight.data.ImageShardDataModule",
        "--data.root",
        str(tmp_path / "shards"),
        "--data.batch_size",
        "4",
        "--data.num_workers",
        "0",
        "--data.augment",
        json.dumps(
            {
                "image_size": 8,
                "channels": 1,
                "scale": [0.7, 1.0],
                "hflip": 0.0,
                "color_jitter": None,
                "interpolation": "bilinear",
                "crop_pct": 1.0,
                "mean": [0.5],
                "std": [0.5],
            }
        ),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
    ]
    run_probed([*args[:1], *common, *args[1:]], probe_dir, tmp_path, processes, timeout=300)


@pytest.mark.slow
def test_two_rank_ddp_over_uneven_shards(tmp_path):
    write_uneven_shards(tmp_path / "shards")
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp_dir.mkdir()
    single_dir.mkdir()
    run_on_shards(
        [
            "fit",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            "--trainer.max_epochs",
            "2",
            "--model.init_args.warmup_epochs",
            "0",
        ],
        ddp_dir,
        tmp_path,
        processes=2,
    )
    ranks = [json.loads((ddp_dir / f"rank{r}-fit.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    steps_per_epoch = 50 // (4 * 2)
    assert [r["global_step"] for r in ranks] == [2 * steps_per_epoch] * 2
    assert [r["train_batches"] for r in ranks] == [2 * steps_per_epoch] * 2
    # two validation epochs; rank 0 reads shards 0 and 2 (13 samples), rank 1 shard 1 (10)
    assert [r["val_samples"] for r in ranks] == [2 * 13, 2 * 10]

    checkpoint = next((tmp_path / "runs").rglob("last.ckpt"))  # the final weights (best-*.ckpt may be older)
    run_on_shards(["validate", "--trainer.devices", "1", "--ckpt_path", str(checkpoint)], single_dir, tmp_path, 1)
    single = json.loads((single_dir / "rank0-validate.json").read_text())
    assert single["val_samples"] == 23
    for name in ("val/top1", "val/loss"):
        assert ranks[0]["metrics"][name] == pytest.approx(single["metrics"][name], abs=1e-5), name
