"""Counting corrupt samples: the counter adds (across processes), the decode wrapper counts and logs
each failure, and a shard set with several corrupt samples gives the exact count, summed over loader
workers and, through single-process stand-ins for the ranks, over ranks."""

import io
import logging
import multiprocessing
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from mmlight.callbacks import SkippedSamplesMonitor
from mmlight.data import DigitsDataModule, write_digits_shards
from mmlight.data.shards import TarSamples
from mmlight.data.skips import SkipCounter, Skipping, is_kept


def _add_many(counter: SkipCounter, times: int) -> None:
    for _ in range(times):
        counter.add()


def test_counter_adds_across_processes():
    counter = SkipCounter()
    assert counter.value == 0
    counter.add(3)
    counter.add()
    assert counter.value == 4
    context = multiprocessing.get_context("fork")  # how DataLoader workers inherit it on Linux
    workers = [context.Process(target=_add_many, args=(counter, 50)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert counter.value == 104


def _parse_int(sample: dict) -> int:
    return int(sample["txt"])


def test_skipping_counts_logs_and_drops_each_failure(caplog):
    counter = SkipCounter()
    decode = Skipping(_parse_int, counter)
    samples = [
        {"__key__": f"k{i}", "__url__": "shard-7.tar", "txt": text} for i, text in enumerate(["1", "x", "2", "", "3"])
    ]
    with caplog.at_level(logging.WARNING, logger="mmlight.data.skips"):
        decoded = [decode(s) for s in samples]
    assert decoded == [1, None, 2, None, 3]
    assert [d for d in decoded if is_kept(d)] == [1, 2, 3]
    assert is_kept(0) and not is_kept(None)  # a falsy sample is still a sample
    assert counter.value == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "k1" in warnings[0] and "shard-7.tar" in warnings[0] and "ValueError" in warnings[0]
    assert "k3" in warnings[1]


def test_each_unreadable_shard_is_counted(tmp_path):
    counter = SkipCounter()
    good = tmp_path / "good.tar"
    with wds.TarWriter(str(good)) as writer:
        writer.write({"__key__": "a", "txt": b"1"})
    urls = [str(tmp_path / "missing-1.tar"), str(good), str(tmp_path / "missing-2.tar"), {"url": str(good)}]
    got = list(TarSamples(counter)(urls))
    assert [s["__key__"] for s in got] == ["a", "a"] and counter.value == 2


def png(value: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8), value, dtype=np.uint8), mode="L").save(buf, format="PNG")
    return buf.getvalue()


# Per validation shard: (good samples, corrupt samples). Shard i goes to rank i % 2 and, within a
# rank's loader, to worker (i // ranks) % workers.
SHARDS = [(4, 3), (2, 2), (3, 1), (1, 4)]


@pytest.fixture(scope="module")
def corrupt_digits(tmp_path_factory):
    """The digits shard set with its validation split replaced by ``SHARDS``."""
    import json

    root = tmp_path_factory.mktemp("digits")
    write_digits_shards(root)
    info = json.loads((root / "_info.json").read_text())
    for old in root.glob("val-*.tar"):
        old.unlink()
    shards = []
    for i, (good, corrupt) in enumerate(SHARDS):
        kinds = interleave(["corrupt"] * corrupt, ["good"] * good)
        name = f"val-{i:06d}.tar"
        with wds.TarWriter(str(root / name)) as writer:
            for j, kind in enumerate(kinds):
                image = b"\x89PNG cut short" if kind == "corrupt" else png(j)
                writer.write({"__key__": f"s{i}-{j}", "png": image, "cls": str(j % 10)})
        shards.append({"name": name, "num_samples": len(kinds)})
    info["splits"]["val"].update(num_samples=sum(g + c for g, c in SHARDS), shards=shards)
    (root / "_info.json").write_text(json.dumps(info))
    return root


def interleave(a: list, b: list) -> list:
    """a[0], b[0], a[1], b[1], ... then the rest of the longer one."""
    out = [x for pair in zip(a, b) for x in pair]
    return out + a[len(b) :] + b[len(a) :]


def stream(root, workers: int) -> tuple[int, int]:
    """(images delivered, samples skipped) of one pass over the validation split."""
    data = DigitsDataModule(cache_dir=str(root), batch_size=3, num_workers=workers)
    delivered = sum(len(labels) for _, labels in data.val_dataloader())
    return delivered, data.skipped.value


@pytest.mark.parametrize("workers", [0, 2])
def test_several_corrupt_samples_give_the_exact_count_over_workers(corrupt_digits, workers):
    assert stream(corrupt_digits, workers) == (sum(g for g, _ in SHARDS), sum(c for _, c in SHARDS))


def test_counts_of_two_ranks_sum_to_the_split(corrupt_digits, monkeypatch):
    """Each rank (RANK/WORLD_SIZE, which webdataset reads when no process group exists) counts the
    corrupt samples of its own shards; the monitor logs each rank's count for a sum over ranks."""
    logged = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        data = DigitsDataModule(cache_dir=str(corrupt_digits), batch_size=3, num_workers=2)
        delivered = sum(len(labels) for _, labels in data.val_dataloader())
        mine = SHARDS[rank::2]
        assert (delivered, data.skipped.value) == (sum(g for g, _ in mine), sum(c for _, c in mine))
        calls = []
        module = SimpleNamespace(device=torch.device("cpu"), log=lambda *a, **k: calls.append((a, k)))
        trainer = SimpleNamespace(datamodule=data, sanity_checking=False)
        SkippedSamplesMonitor().on_validation_epoch_end(trainer, module)
        (name, value), options = calls[0]
        assert name == "data/skipped_samples" and options == {"reduce_fx": "sum", "sync_dist": True}
        logged.append(value.item())
    assert sum(logged) == sum(c for _, c in SHARDS)
