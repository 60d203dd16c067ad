"""ShardDataModule's shared plumbing: the pipeline heads for training and evaluation, the fixed-length
training loader, which split each evaluation loader reads, and the cached shard-set info."""

import warnings

import pytest
import webdataset as wds

import mmlight.data.streaming as streaming
from mmlight.data.shards import TarSamples
from mmlight.data.streaming import ShardDataModule


def write_shards(root, counts: list[int]) -> list[str]:
    urls = []
    for i, n in enumerate(counts):
        url = str(root / f"s{i}.tar")
        with wds.TarWriter(url) as writer:
            for j in range(n):
                writer.write({"__key__": f"{i}-{j}", "txt": b"x"})
        urls.append(url)
    return urls


def module(workers: int = 0) -> ShardDataModule:
    return ShardDataModule("unused", num_workers=workers, val_split="valid", test_split="test")


def test_rank_and_world_without_a_trainer():
    assert module()._rank_and_world() == (0, 1) and module()._world_size() == 1


def test_evaluation_reads_each_shard_once_and_training_resamples(tmp_path):
    urls = write_shards(tmp_path, [3, 2, 4])
    data = module()
    stages = data.shard_stages(urls, train=False)
    assert isinstance(stages[0], wds.SimpleShardList) and stages[1:3] == [wds.split_by_node, wds.split_by_worker]
    assert isinstance(stages[-1], TarSamples) and stages[-1].counter is data.skipped
    keys = [s["__key__"] for s in wds.DataPipeline(*stages)]
    assert sorted(keys) == sorted(f"{i}-{j}" for i, n in enumerate([3, 2, 4]) for j in range(n))
    stages = data.shard_stages(urls[:1], train=True)
    assert isinstance(stages[0], wds.ResampledShards) and stages[1] is wds.split_by_node
    assert isinstance(stages[-1], TarSamples) and stages[-1].counter is data.skipped
    endless = iter(wds.DataPipeline(*stages))
    assert [next(endless)["__key__"] for _ in range(7)] == ["0-0", "0-1", "0-2"] * 2 + ["0-0"]


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_fixed_epoch_loader_gives_exactly_steps_batches(tmp_path, workers):
    urls = write_shards(tmp_path, [5])
    data = module(workers)
    endless = wds.DataPipeline(*data.shard_stages(urls, train=True), wds.batched(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # webdataset's with_length() notice is expected and silenced
        loader = data.fixed_epoch_loader(endless, 6)
    assert len(loader) == 6
    assert loader.pipeline[0].persistent_workers == (workers > 0)  # workers are not restarted every epoch
    for _ in range(2):  # every epoch, whatever the workers
        batches = list(loader)
        assert len(batches) == 6
    assert all(len(b["__key__"]) == 2 and isinstance(b["__key__"][0], str) for b in batches)  # not re-batched


class Splits(ShardDataModule):
    def _eval_loader(self, split):
        return split


def test_each_evaluation_loader_reads_its_split():
    data = Splits("unused", num_workers=0, val_split="valid", test_split="test")
    assert (data.val_dataloader(), data.test_dataloader(), data.predict_dataloader()) == ("valid", "test", "test")
    with pytest.raises(NotImplementedError):
        module().val_dataloader()


def test_info_is_read_once(monkeypatch):
    reads = []
    monkeypatch.setattr(streaming, "read_info", lambda root: reads.append(root) or {"root": root})
    data = module()
    assert data._info() == {"root": "unused"} and data._info() is data._info()
    assert reads == ["unused"]


def test_one_global_batch_makes_a_one_step_epoch():
    from types import SimpleNamespace

    data = module()
    data.trainer = SimpleNamespace(global_rank=3, world_size=4)
    assert data.epoch_steps(32, 8, "8 samples") == 1 and data.epoch_steps(63, 8, "8 samples") == 1
    with pytest.raises(ValueError, match=r"^the training split \(31\) is smaller than one global batch \(8 samples x 4 devices\)$"):
        data.epoch_steps(31, 8, "8 samples")
