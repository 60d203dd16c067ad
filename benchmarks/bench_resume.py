"""Resume overhead of a training stream: the time a resumed run spends reaching its data position.

A resumed rank replays its unit sequence up to the saved batch (shard draws, tar headers, shuffle
buffer, batching) without reading or decoding any image. This script measures that replay on
generated shards with ImageNet's layout and sizes, and, in the same run, what decoding and
augmenting the same number of samples would cost instead (DeiT's training transform on
ImageNet-sized JPEGs), and writes JSON lines under ``benchmarks/results/``.

    python benchmarks/bench_resume.py                        # ImageNet epoch, 1 and 8 ranks
    python benchmarks/bench_resume.py --epoch-samples 20000 --ranks 1   # a quick look

The replay shards are sparse files: real tar headers with ``--jpeg-bytes`` of unwritten data per
image, so ImageNet's file layout costs no disk. The headers are read through the page cache (the
same few shards are drawn again and again), so this is the warm-cache cost; on a cold network file
system each 512-byte header is a small read at a new offset.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import platform
import tarfile
import tempfile
import time
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from bench_loader import DEIT  # beside this script, which Python puts on sys.path
from PIL import Image
from record_name import record_path

from mmlight.data.image_decode import AugmentGroup, SplitTransform
from mmlight.data.images import ImageStream
from mmlight.data.skips import SkipCounter
from mmlight.data.streaming import RankRandom


def write_sparse_shard(path: Path, first: int, samples: int, jpeg_bytes: int) -> None:
    """A tar of ``samples`` (``.jpg`` of ``jpeg_bytes`` unwritten bytes, ``.cls``) with real headers."""
    with open(path, "wb") as f:
        for i in range(first, first + samples):
            for ext, data in (("jpg", None), ("cls", str(i % 1000).encode())):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = jpeg_bytes if data is None else len(data)
                f.write(info.tobuf(format=tarfile.USTAR_FORMAT))
                if data is None:
                    f.seek(info.size + (-info.size % 512), io.SEEK_CUR)  # a hole: no disk used
                else:
                    f.write(data + b"\0" * (-len(data) % 512))
        f.write(b"\0" * 1024)
        f.truncate()


def write_jpeg_shard(path: Path, samples: int, seed: int = 0) -> None:
    """A real shard of ImageNet-sized JPEGs (smooth random content, 500x375, quality 90)."""
    rng = np.random.default_rng(seed)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            small = rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(small).resize((500, 375), Image.BICUBIC).save(buf, format="JPEG", quality=90)
            for ext, data in (("jpg", buf.getvalue()), ("cls", str(i % 1000).encode())):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def replay_seconds(urls: list[str], batches: int, batch_size: int, shuffle_buffer: int) -> float:
    """Seconds to replay ``batches`` units of one rank's stream (what a resume skips)."""
    stream = ImageStream(urls, batch_size, shuffle_buffer, 1, decode=None, counter=SkipCounter())
    start = time.perf_counter()
    for _ in islice(stream.units(RankRandom(0, 0, 0), count_skips=False), batches):
        pass
    return time.perf_counter() - start


def decode_seconds_per_sample(url: str, samples: int, batch_size: int) -> float:
    """Seconds per sample to read, decode and augment real JPEGs (one process)."""
    decode = AugmentGroup(3, SplitTransform(DEIT.build(train=True)))
    stream = ImageStream([url], batch_size, 1, 1, decode, SkipCounter())
    units = stream.units(RankRandom(0, 0, 0), count_skips=False)
    stream.materialise(next(units))  # warm-up
    start, done = time.perf_counter(), 0
    while done < samples:
        stream.materialise(next(units))
        done += batch_size
    return (time.perf_counter() - start) / done


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epoch-samples", type=int, default=1_281_167, help="training samples per epoch (ImageNet)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8], help="ranks sharing the epoch")
    parser.add_argument("--batch-size", type=int, default=128, help="per-rank batch")
    parser.add_argument("--shuffle-buffer", type=int, default=5000, help="ImageShardDataModule's default")
    parser.add_argument("--shards", type=int, default=20, help="sparse shards drawn from (resampled)")
    parser.add_argument("--per-shard", type=int, default=1281, help="samples per shard (1,001 shards for ImageNet)")
    parser.add_argument("--jpeg-bytes", type=int, default=110_000, help="mean ImageNet JPEG size")
    parser.add_argument("--decode-samples", type=int, default=128, help="samples decoded for the comparison")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON lines file (default: results/resume-cpu-<versions>-<date>-<time>)"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        urls = []
        for s in range(args.shards):
            urls.append(str(Path(tmp) / f"train-{s:06d}.tar"))
            write_sparse_shard(Path(urls[-1]), s * args.per_shard, args.per_shard, args.jpeg_bytes)
        jpegs = Path(tmp) / "jpegs.tar"
        write_jpeg_shard(jpegs, args.decode_samples + args.batch_size)
        decode_s = decode_seconds_per_sample(str(jpegs), args.decode_samples, args.batch_size)
        for ranks in args.ranks:
            steps = args.epoch_samples // (args.batch_size * ranks)
            skipped = steps - 1  # the worst case: resumed just before the epoch's last batch
            seconds = replay_seconds(urls, skipped, args.batch_size, args.shuffle_buffer)
            samples = skipped * args.batch_size
            records.append(
                {
                    "bench": "resume_replay",
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "device": f"{platform.machine()} CPU, 1 thread",
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "ranks": ranks,
                    "batch_size": args.batch_size,
                    "shuffle_buffer": args.shuffle_buffer,
                    "epoch_samples": args.epoch_samples,
                    "skipped_batches": skipped,
                    "skipped_samples": samples,
                    "replay_s": round(seconds, 2),
                    "replay_us_per_sample": round(seconds / samples * 1e6, 2),
                    "decode_ms_per_sample": round(decode_s * 1e3, 2),
                    "decode_s_for_skipped": round(decode_s * samples, 1),
                    "replay_over_decode": round(seconds / (decode_s * samples), 5),
                }
            )
            print(json.dumps(records[-1]))
    out = args.out or record_path("resume", "cpu", [("torch", torch.__version__)], "jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
