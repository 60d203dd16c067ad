"""ShardDataModule's shared plumbing: the evaluation pipeline head, which split each evaluation
loader reads, the epoch length and the cached shard-set info."""

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


def test_printed_as_its_class_and_root():
    """jsonargparse prints DataModules in its messages: the class and the folder, no loader built."""
    assert str(module()) == "ShardDataModule(root='unused')"


def test_evaluation_reads_each_shard_once(tmp_path):
    """The evaluation head reads every shard once, split by node and worker, counting skips in the
    module's counter (training streams: tests/data/test_streaming.py)."""
    urls = write_shards(tmp_path, [3, 2, 4])
    data = module()
    stages = data.eval_stages(urls)
    assert isinstance(stages[0], wds.SimpleShardList) and stages[1:3] == [wds.split_by_node, wds.split_by_worker]
    assert isinstance(stages[-1], TarSamples) and stages[-1].counter is data.skipped
    keys = [s["__key__"] for s in wds.DataPipeline(*stages)]
    assert sorted(keys) == sorted(f"{i}-{j}" for i, n in enumerate([3, 2, 4]) for j in range(n))


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
    with pytest.raises(
        ValueError, match=r"^the training split \(31\) is smaller than one global batch \(8 samples x 4 devices\)$"
    ):
        data.epoch_steps(31, 8, "8 samples")
