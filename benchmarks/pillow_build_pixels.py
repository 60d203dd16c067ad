"""How far the DeiT training augmentation's pixels move when Pillow-SIMD replaces Pillow.

Pillow-SIMD shortens the augmentation (BENCHMARKS.md, "Image loader"), but its vectorised resampling
rounds differently. Run ``dump`` once in each environment on the same JPEG files, then ``compare``:

    python benchmarks/pillow_build_pixels.py dump --src /tmp/pixels-src --out /tmp/pillow.npz
    /path/to/simd-venv/bin/python benchmarks/pillow_build_pixels.py dump --src /tmp/pixels-src --out /tmp/simd.npz
    python benchmarks/pillow_build_pixels.py compare /tmp/pillow.npz /tmp/simd.npz

``dump`` writes ``--images`` stand-in photographs (``bench_loader.photo_like``) to ``--src`` when it is
missing or empty (never into a folder that holds anything), so the second environment reads the first
one's files. For each image ``i`` it seeds
``random``, NumPy and torch with ``i`` and records three uint8 arrays: the decoded image's checksum,
the RandomResizedCrop alone (crop box drawn by timm, resized by Pillow) and the whole PIL part of the
DeiT transform (crop, flip, RandAugment m9 mstd 0.5). Same seeds, so the same boxes and operations are
drawn in both environments; only the resampling arithmetic differs. ``compare`` writes a JSON record
to ``benchmarks/results/``: per stage, the largest difference in grey levels, the share of values that
differ at all and by more than one level, and the mean of all values in each build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from lightning import seed_everything
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import DEIT, versions, write_fake_imagenet  # noqa: E402
from record_name import record_path  # noqa: E402

from mmlight.data.image_decode import SplitTransform, pillow_build  # noqa: E402

STAGES = ("crop", "augmented")


def augment(path: Path, seed: int, split: SplitTransform) -> dict[str, np.ndarray | str]:
    """The decoded image's SHA-256 and the uint8 pixels after the crop alone and after the PIL ops."""
    image = Image.open(path).convert("RGB")
    decoded = hashlib.sha256(image.tobytes()).hexdigest()
    seed_everything(seed, verbose=False)  # random, NumPy and torch
    crop = split.crop(image)
    seed_everything(seed, verbose=False)  # the same box again, then flip and RandAugment on top of it
    augmented = split.pil_ops(split.crop(image))
    return {"decoded": decoded, "crop": np.asarray(crop), "augmented": np.asarray(augmented)}


def dump(src: Path, out: Path, images: int) -> None:
    if images < 1:
        raise ValueError(f"--images must be >= 1, got {images}")
    if not src.exists() or not any(src.iterdir()):  # never write stand-ins into a folder that holds anything
        write_fake_imagenet(src, images)
    files = sorted(src.glob("train/*/*.JPEG"))[:images]
    if not files:
        raise ValueError(
            f"no train/<wnid>/*.JPEG under {src} (give an ImageNet-layout folder, or an empty one "
            "for generated stand-ins)"
        )
    split = SplitTransform(DEIT.build(train=True))
    rows = [augment(path, seed, split) for seed, path in enumerate(files)]
    np.savez_compressed(
        out,
        build=pillow_build(),
        files=np.array([str(p.relative_to(src)) for p in files]),
        decoded=np.array([r["decoded"] for r in rows]),
        **{stage: np.stack([r[stage] for r in rows]) for stage in STAGES},
    )
    print(f"{pillow_build()}: {len(files)} images -> {out}")


def difference(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Grey-level differences between two uint8 arrays of the same shape."""
    if a.shape != b.shape:
        raise ValueError(f"the dumps hold different shapes: {a.shape} and {b.shape}")
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return {
        "max_levels": int(diff.max(initial=0)),
        "share_differing": float((diff > 0).mean()),
        "share_differing_by_more_than_1": float((diff > 1).mean()),
        "mean_abs_levels": float(diff.mean()),
        "mean_a": float(a.mean()),
        "mean_b": float(b.mean()),
    }


def compare(first: Path, second: Path) -> dict:
    a, b = np.load(first), np.load(second)
    if not np.array_equal(a["files"], b["files"]):
        raise ValueError(f"{first} and {second} were dumped from different images: dump both from one --src")
    record = {
        "op": "pillow_build_pixels",
        "a": str(a["build"]),
        "b": str(b["build"]),
        "images": len(a["files"]),
        "decoded_identical": float(np.mean(a["decoded"] == b["decoded"])),
        **{stage: difference(a[stage], b[stage]) for stage in STAGES},
        **versions(),
    }
    record.pop("pillow")  # the two builds are named in a and b
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dumping = sub.add_parser("dump", help="augment the images with this environment's Pillow")
    dumping.add_argument("--src", type=Path, required=True, help="ImageNet-layout folder; written if empty")
    dumping.add_argument("--out", type=Path, required=True)
    dumping.add_argument("--images", type=int, default=200)
    comparing = sub.add_parser("compare", help="compare two dumps")
    comparing.add_argument("first", type=Path)
    comparing.add_argument("second", type=Path)
    comparing.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "dump":
            dump(args.src, args.out, args.images)
            return
        record = compare(args.first, args.second)
    except ValueError as error:
        raise SystemExit(f"pillow_build_pixels.py: {error}") from None
    builds = [tuple(record[side].rsplit(" ", 1)) for side in ("a", "b")]  # ("Pillow-SIMD", "12.1.1.post0")
    out = args.out or record_path("pillow_build_pixels", "cpu", builds, "json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
