"""ShardDataModule: the fixed epoch length shared by the streaming DataModules."""

from types import SimpleNamespace

import pytest

from mmlight.data.streaming import ShardDataModule


def test_epoch_steps_divides_by_the_ranks_and_refuses_less_than_one_batch():
    data = ShardDataModule("unused", num_workers=0, val_split="val", test_split="test")
    assert data.epoch_steps(100, 8, "8 samples") == 12  # one process: 100 // 8
    data.trainer = SimpleNamespace(global_rank=1, world_size=4)
    assert data._rank_and_world() == (1, 4)
    assert data.epoch_steps(100, 8, "8 samples") == 3  # 100 // (8 x 4)
    with pytest.raises(ValueError, match=r"\(100\) is smaller than one global batch \(32 samples x 4 devices\)"):
        data.epoch_steps(100, 32, "32 samples")
