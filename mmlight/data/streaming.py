"""What every shard-streaming DataModule shares: the shard set's ``_info.json``, the rank count,
the corrupt-sample counter, the fixed-length training loader, and val/test/predict on named splits."""

from __future__ import annotations

import warnings

import lightning as L
import webdataset as wds

from mmlight.data.shards import TarSamples, read_info
from mmlight.data.skips import SkipCounter


class ShardDataModule(L.LightningDataModule):
    """Base of the streaming DataModules. Subclasses implement :meth:`train_dataloader` (usually
    through :meth:`fixed_epoch_loader`) and :meth:`_eval_loader`.

    Args:
        root: folder holding the shards and ``_info.json``.
        num_workers: DataLoader worker processes per device.
        val_split: split read by ``validate`` (and during ``fit``).
        test_split: split read by ``test`` and ``predict``.
    """

    def __init__(self, root: str, num_workers: int, val_split: str, test_split: str):
        super().__init__()
        self.root = root
        self.num_workers = num_workers
        self.val_split = val_split
        self.test_split = test_split
        self.info: dict | None = None
        self.skipped = SkipCounter()  # corrupt samples met while streaming, shared with the workers

    def _info(self) -> dict:
        if self.info is None:
            self.info = read_info(self.root)
        return self.info

    def __str__(self) -> str:
        # Lightning's builds (and may iterate) every loader; jsonargparse prints DataModules in messages
        return f"{type(self).__name__}(root={self.root!r})"

    def _rank_and_world(self) -> tuple[int, int]:
        """This process's global rank and the number of ranks (0, 1 outside a trainer)."""
        if self.trainer is None:
            return 0, 1
        return int(self.trainer.global_rank), self._world_size()

    def _world_size(self) -> int:
        return int(self.trainer.world_size) if self.trainer is not None else 1

    def epoch_steps(self, total: int, per_rank_step: int, what: str) -> int:
        """Training steps per epoch, the same on every rank: ``total // (per_rank_step x world size)``.

        Args:
            total: size of the training split (samples or tokens).
            per_rank_step: how much of it one rank's batch takes.
            what: the batch in words for the error, e.g. ``"8 x 512 tokens"``.
        """
        world = self._world_size()
        steps = total // (per_rank_step * world)
        if steps < 1:
            raise ValueError(f"the training split ({total}) is smaller than one global batch "
                             f"({what} x {world} devices)")
        return steps

    def shard_stages(self, urls: list[str], train: bool) -> list:
        """The head of a pipeline: shard URLs -> raw samples (``mmlight.data.shards.TarSamples``).

        Training resamples shards at random, split by node: an endless stream that
        :meth:`fixed_epoch_loader` cuts into equal epochs. Evaluation reads each shard once, split over
        ranks and loader workers. An unreadable shard is counted in :attr:`skipped` and skipped.
        """
        if train:
            return [wds.ResampledShards(urls), wds.split_by_node, TarSamples(self.skipped)]
        return [wds.SimpleShardList(urls), wds.split_by_node, wds.split_by_worker, TarSamples(self.skipped)]

    def fixed_epoch_loader(self, dataset, steps: int) -> wds.WebLoader:
        """A loader of ``dataset`` (already batched) cut into epochs of exactly ``steps`` batches, so
        every DDP rank runs the same number of steps whatever its shards."""
        loader = wds.WebLoader(dataset, batch_size=None, num_workers=self.num_workers,
                               persistent_workers=self.num_workers > 0)
        # with_epoch on the loader counts batches across all workers of this rank (webdataset#250);
        # with_length only reports that count to Lightning (webdataset warns that it does no more).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*with_length\(\) only sets")
            return loader.with_epoch(steps).with_length(steps)

    def _eval_loader(self, split: str):
        raise NotImplementedError

    def val_dataloader(self):
        return self._eval_loader(self.val_split)

    def test_dataloader(self):
        return self._eval_loader(self.test_split)

    def predict_dataloader(self):
        return self._eval_loader(self.test_split)
