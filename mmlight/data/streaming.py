"""Training streams whose order is a function of the seed, and that resume at the next batch.

Every training stream here draws its order from ``(seed, epoch, rank)`` and nothing else: the
seed is ``seed_everything``'s (Lightning's ``PL_GLOBAL_SEED``), the epoch comes from Lightning
(``sampler.set_epoch``), the rank from the trainer. A stream is made of two parts
(:class:`StreamSource`):

* **units**: a cheap, deterministic sequence of batch descriptions (shard draws, tar and ``.npy``
  headers, the shuffle buffer, token-budget batching), computed without decoding anything;
* **materialise**: reads a unit's bytes and decodes and augments them, with Python's, NumPy's and
  torch's CPU random generators seeded from ``(seed, epoch, rank, unit index)``, so crops, flips,
  RandAugment and random erasing are functions of the position too.

Loader worker ``w`` of ``W`` materialises units ``start + w, start + w + W, ...`` of the rank's single
unit sequence, and the DataLoader returns them in index order, so the batches do not depend on the
number of workers. :class:`ResumableLoader` counts the batches it hands to Lightning and exposes
``state_dict``/``load_state_dict``; Lightning saves that state with the fit loop in every checkpoint
(``last.ckpt``, epoch-end and ``hpc_ckpt``) and restores it before the first batch of a resumed run,
which then replays the units up to its position (headers only) and continues with the next batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import lightning as L
import numpy as np
import torch
import webdataset as wds
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmlight.data.shards import TarSamples, group_samples, read_info, tar_index
from mmlight.data.skips import SkipCounter

log = logging.getLogger(__name__)

#: the independent random streams of one (seed, epoch, rank); the numbers are part of the order
PURPOSES = {"shards": 0, "shuffle": 1, "offsets": 2, "batches": 3, "unit": 4, "order": 5}


def run_seed() -> int:
    """The run's seed: ``seed_everything``'s (``PL_GLOBAL_SEED``), 0 when none was set."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def trainer_layout(trainer) -> tuple[int, int]:
    """``(global rank, world size)`` of a trainer; ``(0, 1)`` without one."""
    if trainer is None:
        return 0, 1
    return int(trainer.global_rank), int(trainer.world_size)


class RankRandom:
    """The random streams of one rank in one epoch, each a function of ``(seed, epoch, rank, purpose)``.

    Args:
        seed: the run's seed.
        epoch: the training epoch.
        rank: the global rank.
    """

    def __init__(self, seed: int, epoch: int, rank: int):
        self.seed, self.epoch, self.rank = seed, epoch, rank

    def entropy(self, purpose: str, *position: int, per_rank: bool = True) -> list[int]:
        rank = [self.rank] if per_rank else []
        return [self.seed, self.epoch, *rank, PURPOSES[purpose], *position]

    def python(self, purpose: str, per_rank: bool = True) -> random.Random:
        """A ``random.Random`` for ``purpose`` (fast scalar draws)."""
        word = np.random.SeedSequence(self.entropy(purpose, per_rank=per_rank)).generate_state(2, np.uint64)
        return random.Random(int(word[0]) << 64 | int(word[1]))

    def numpy(self, purpose: str, per_rank: bool = True) -> np.random.Generator:
        """A NumPy generator for ``purpose`` (array draws)."""
        return np.random.default_rng(self.entropy(purpose, per_rank=per_rank))


def seed_global_generators(entropy: list[int], every_device: bool = False) -> None:
    """Seed Python's, NumPy's and torch's global generators from the two 32-bit words of
    ``SeedSequence(entropy)``: Python's and torch's with the 64-bit number they make, NumPy's (whose
    global seed takes 32 bits) with the first.

    Args:
        entropy: the position the draws belong to, e.g. ``[seed, epoch, rank, purpose, unit]``.
        every_device: also seed every GPU's generator (``torch.manual_seed``); else torch's CPU one only.
    """
    high, low = (int(word) for word in np.random.SeedSequence(entropy).generate_state(2, np.uint32))
    random.seed(high << 32 | low)
    np.random.seed(high)
    (torch.manual_seed if every_device else torch.random.default_generator.manual_seed)(high << 32 | low)


@contextlib.contextmanager
def seeded_rngs(entropy: list[int]):
    """Seed Python's, NumPy's and torch's CPU global generators from ``entropy`` for the block, then
    put back the states they had: the transforms inside draw from those globals (timm's crops and
    RandAugment from ``random`` and ``np.random``, flips and erasing from torch)."""
    saved = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    seed_global_generators(entropy)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.random.set_rng_state(saved[2])


def resampled_samples(urls: list[str], rng: random.Random, counter: SkipCounter | None) -> Iterator[dict]:
    """Endless sample references of shards drawn uniformly with replacement: webdataset samples whose
    values are ``(offset, size)`` of the member in ``__url__``, read from the tar headers alone.

    An unreadable shard (or the unreadable rest of one) is logged and counted in ``counter`` (None:
    neither, for a worker that replays what another reports); when every shard has failed since the
    last good one, the stream stops with an error naming them, rather than spinning forever.
    """
    failed: set[str] = set()
    while True:
        url = urls[rng.randrange(len(urls))]
        members, broken = [], False
        try:
            for name, offset, size in tar_index(url):
                members.append((name, (offset, size)))
        except (OSError, EOFError, ValueError) as err:
            broken = True
            if counter is not None:
                counter.add()
                log.warning("skipped the rest of shard %s: %s: %s", url, type(err).__name__, err)
        samples = list(group_samples(members, url))
        if broken:  # the sample being read when the shard broke may lack members: dropped, as TarSamples does
            samples = samples[:-1]
        if not samples:
            failed.add(url)
            if len(failed) == len(set(urls)):
                raise RuntimeError(
                    f"no readable sample in any of the {len(failed)} training shards, e.g. {sorted(failed)[:3]}"
                )
            continue
        failed.clear()
        yield from samples


def shuffled(items: Iterable, buffer: int, rng: random.Random) -> Iterator:
    """Shuffle a stream through a buffer of ``buffer`` items (webdataset's ``shuffle``), drawing only
    from ``rng``; ``buffer <= 1`` keeps the order."""
    if buffer <= 1:
        yield from items
        return
    pool: list = []
    for item in items:
        pool.append(item)
        if len(pool) >= buffer:
            k = rng.randrange(len(pool))
            pool[k], pool[-1] = pool[-1], pool[k]
            yield pool.pop()
    while pool:
        k = rng.randrange(len(pool))
        pool[k], pool[-1] = pool[-1], pool[k]
        yield pool.pop()


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of ``size`` items; a short last list is dropped."""
    it = iter(items)
    while len(batch := list(islice(it, size))) == size:
        yield batch


class StreamSource:
    """One rank's training stream in two parts (see the module docstring). Subclasses pickle into
    loader workers."""

    def units(self, rand: RankRandom, count_skips: bool) -> Iterator[Any]:
        """The rank's unit sequence of one epoch (endless or at least ``steps`` long), from headers
        only. ``count_skips``: whether this process reports unreadable shards (one worker does)."""
        raise NotImplementedError

    def materialise(self, unit) -> Any:
        """Read, decode and augment one unit into a batch (the random generators are already seeded)."""
        raise NotImplementedError


class StreamDataset(IterableDataset):
    """Batches ``start .. steps - 1`` of one rank's epoch; worker ``w`` of ``W`` makes batches
    ``start + w, start + w + W, ...``.

    Args:
        source: the stream.
        steps: batches per epoch on this rank.
        seed: the run's seed.
        rank: this process's global rank.
    """

    def __init__(self, source: StreamSource, steps: int, seed: int, rank: int):
        super().__init__()
        self.source, self.steps, self.seed, self.rank = source, steps, seed, rank
        self.epoch = 0
        self.start = 0

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rand = RankRandom(self.seed, self.epoch, self.rank)
        units = self.source.units(rand, count_skips=worker == 0)
        for index, unit in enumerate(islice(units, self.steps)):
            if index < self.start or (index - self.start) % workers != worker:
                continue
            with seeded_rngs(rand.entropy("unit", index)):
                yield self.source.materialise(unit)


class ResumableLoader:
    """The training loader of a :class:`StreamDataset`: ``len()`` is the epoch's batch count, and
    ``state_dict``/``load_state_dict`` hold the position that Lightning saves with the fit loop.

    The position (epoch, batches handed out) is the same on every rank, since every rank runs the
    same number of steps, so rank 0's copy in the checkpoint is every rank's. Resuming with a
    different number of loader workers continues exactly (the order does not depend on it); with a
    different number of ranks, batches per epoch or seed it warns once, naming both layouts, and
    continues at the same epoch and step in the new layout's order.

    Args:
        dataset: the rank's stream.
        num_workers: DataLoader worker processes.
        world_size: number of ranks (recorded in the state).
    """

    def __init__(self, dataset: StreamDataset, num_workers: int, world_size: int):
        self.dataset, self.num_workers, self.world_size = dataset, num_workers, world_size
        self.epoch, self.position = 0, 0
        self._resume: dict | None = None
        self._warned_about: dict | None = None  # the saved layout already warned about

    def __len__(self) -> int:
        return self.dataset.steps

    @property
    def sampler(self):
        """Lightning calls ``loader.sampler.set_epoch(epoch)`` on every training loader before each
        epoch: this is how the stream learns the epoch."""
        return self

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch = epoch

    def __iter__(self) -> Iterator:
        return self._batches()  # a generator: it starts at the first next(), after set_epoch

    def _batches(self) -> Iterator:
        dataset = self.dataset
        dataset.start = 0
        if self._resume is not None and self._resume["epoch"] == dataset.epoch:
            dataset.start = min(self._resume["position"], dataset.steps)
        self._resume = None
        self.epoch, self.position = dataset.epoch, dataset.start
        loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers)
        for batch in loader:
            self.position += 1
            yield batch

    def layout(self) -> dict:
        return {
            "seed": self.dataset.seed,
            "world_size": self.world_size,
            "steps": self.dataset.steps,
            "num_workers": self.num_workers,
        }

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, **self.layout()}

    def load_state_dict(self, state: dict) -> None:
        saved = {k: state.get(k) for k in ("seed", "world_size", "steps")}
        now = {k: v for k, v in self.layout().items() if k in saved}
        if saved != now and saved != self._warned_about:
            self._warned_about = saved
            rank_zero_warn(
                f"resuming a training stream written with {_describe(saved)} under {_describe(now)}: the "
                f"run continues at epoch {state['epoch']}, batch {state['position']}, but the data order "
                "from this point on differs from an uninterrupted run's"
            )
        elif state.get("num_workers") != self.num_workers:
            log.info(
                "resuming with %s loader workers (checkpoint: %s): the order does not depend on them",
                self.num_workers,
                state.get("num_workers"),
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._resume = dict(state)


def _describe(layout: dict) -> str:
    return f"seed {layout['seed']}, {layout['world_size']} rank(s) and {layout['steps']} batches per epoch"


class ShardDataModule(L.LightningDataModule):
    """Base of the streaming DataModules. Subclasses implement :meth:`train_dataloader` (through
    :meth:`resumable_loader`) and :meth:`_eval_loader`.

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
        return trainer_layout(self.trainer)

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
            raise ValueError(
                f"the training split ({total}) is smaller than one global batch ({what} x {world} devices)"
            )
        return steps

    def eval_stages(self, urls: list[str]) -> list:
        """The head of an evaluation pipeline: each shard read once, split over ranks and loader
        workers (``mmlight.data.shards.TarSamples``; an unreadable shard is counted and skipped)."""
        return [wds.SimpleShardList(urls), wds.split_by_node, wds.split_by_worker, TarSamples(self.skipped)]

    def resumable_loader(self, source: StreamSource, steps: int) -> ResumableLoader:
        """The training loader of ``source``: ``steps`` batches per epoch on every rank, in the order
        of ``(seed, epoch, rank)``, resumable at any batch (see :class:`ResumableLoader`)."""
        rank, world = self._rank_and_world()
        return ResumableLoader(StreamDataset(source, steps, run_seed(), rank), self.num_workers, world)

    def _eval_loader(self, split: str):
        raise NotImplementedError

    def val_dataloader(self):
        return self._eval_loader(self.val_split)

    def test_dataloader(self):
        return self._eval_loader(self.test_split)

    def predict_dataloader(self):
        return self._eval_loader(self.test_split)
