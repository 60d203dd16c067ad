"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"): a synthetic language-model
task that needs sharp attention, generated in memory from a seed (no files, no downloads).

A sequence holds ``num_pairs`` key-value pairs with distinct keys, then ``num_queries`` queries, each a
key from those pairs followed by its value::

    k1 v1 k2 v2 ... kN vN  q1 a1 q2 a2 ... qQ aQ        (length L = 2N + 2Q)

The model reads ``input = seq[:-1]`` and predicts ``target = seq[1:]``; only the answers are scored.
Batches have the format of :class:`mmlight.data.text.WikiTextDataModule`::

    input (B, T) int64      target (B, T) int64      loss_mask (B, T) bool     with T = L - 1

where ``loss_mask`` is True exactly at the positions whose input token is a query key, i.e. whose
target is an answer value (``Q`` positions per sequence). **Accuracy** = the fraction of scored
positions whose predicted token (argmax) equals the target, i.e. of answers recalled exactly; chance
is ``1 / num_values``.

Token ids: the specials of fairseq/WikiText (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3; none occurs
in the data), then key ``i`` = ``4 + i`` (``"k{i}"``), then value ``j`` = ``4 + num_keys + j`` (``"v{j}"``).
Keys of a sequence are drawn without replacement, values uniformly with replacement; queries are
drawn from the sequence's pairs without replacement when ``num_queries <= num_pairs`` (with
replacement otherwise).
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mmlight.data.streaming import RankRandom, ResumableLoader, StreamDataset, StreamSource, run_seed, trainer_layout
from mmlight.data.vocab import SPECIALS, Vocab, VocabAttributes

SPLITS = ("train", "val", "test")


def mqar_sequences(
    n: int, num_keys: int, num_values: int, num_pairs: int, num_queries: int, rng: np.random.Generator
) -> np.ndarray:
    """``n`` MQAR sequences as an ``(n, 2 * num_pairs + 2 * num_queries)`` int64 array of token ids."""
    keys = np.argsort(rng.random((n, num_keys)), axis=1)[:, :num_pairs]  # distinct keys per row
    values = rng.integers(num_values, size=(n, num_pairs))
    if num_queries <= num_pairs:
        picks = np.argsort(rng.random((n, num_pairs)), axis=1)[:, :num_queries]
    else:
        picks = rng.integers(num_pairs, size=(n, num_queries))
    key_ids = len(SPECIALS) + keys
    value_ids = len(SPECIALS) + num_keys + values
    seq = np.empty((n, 2 * num_pairs + 2 * num_queries), dtype=np.int64)
    seq[:, 0 : 2 * num_pairs : 2] = key_ids
    seq[:, 1 : 2 * num_pairs : 2] = value_ids
    seq[:, 2 * num_pairs :: 2] = np.take_along_axis(key_ids, picks, axis=1)
    seq[:, 2 * num_pairs + 1 :: 2] = np.take_along_axis(value_ids, picks, axis=1)
    return seq


class _Sequences(Dataset):
    """Rows of ``input``/``target``/``loss_mask`` tensors as dicts (collated by the default collate)."""

    def __init__(self, seq: np.ndarray, num_pairs: int):
        seq_t = torch.from_numpy(seq)
        self.input, self.target = seq_t[:, :-1].contiguous(), seq_t[:, 1:].contiguous()
        t = torch.arange(self.input.shape[1])
        row_mask = (t >= 2 * num_pairs) & ((t - 2 * num_pairs) % 2 == 0)  # input is a query key
        self.loss_mask = row_mask.expand_as(self.input).contiguous()

    def __len__(self) -> int:
        return self.input.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input": self.input[i], "target": self.target[i], "loss_mask": self.loss_mask[i]}


class RecallStream(StreamSource):
    """Training batches of in-memory sequences: a permutation of the rows per epoch, drawn from
    ``(seed, epoch)`` alone and shared by the ranks, cut into global batches of which rank ``r`` of
    ``R`` takes ``r, r + R, ...`` (as a ``DistributedSampler`` would).

    Args:
        data: the training rows.
        batch_size: rows per batch.
        rank: this rank.
        world_size: number of ranks.
    """

    def __init__(self, data: _Sequences, batch_size: int, rank: int, world_size: int):
        self.data, self.batch_size, self.rank, self.world_size = data, batch_size, rank, world_size

    def units(self, rand: RankRandom, count_skips: bool):
        order = rand.numpy("order", per_rank=False).permutation(len(self.data))
        for batch in range(self.rank, len(order) // self.batch_size, self.world_size):
            yield order[batch * self.batch_size : (batch + 1) * self.batch_size]

    def materialise(self, unit: np.ndarray) -> dict:
        rows = torch.from_numpy(unit)
        return {
            "input": self.data.input[rows],
            "target": self.data.target[rows],
            "loss_mask": self.data.loss_mask[rows],
        }


class RecallDataModule(VocabAttributes, L.LightningDataModule):
    """MQAR sequences generated in memory (see the module docstring for the format and accuracy).

    Each split is drawn from its own random stream, ``numpy.random.default_rng([seed, k])`` with
    ``k`` = 0, 1, 2 for train, val, test, so the splits are independent and a seed fixes them all.

    Args:
        num_keys: number of distinct key tokens in the vocabulary.
        num_values: number of distinct value tokens in the vocabulary (chance accuracy 1/num_values).
        num_pairs: key-value pairs per sequence (distinct keys, so at most ``num_keys``).
        num_queries: queries per sequence, each a key of the sequence's pairs followed by its value.
        train_size: training sequences (at least ``batch_size``; partial batches are dropped).
        val_size: validation sequences.
        test_size: test sequences (also what ``predict`` reads).
        batch_size: sequences per batch (per device).
        seed: seed of all three splits (a non-negative integer).
        num_workers: DataLoader worker processes (0: load in the main process).
    """

    def __init__(
        self,
        num_keys: int = 32,
        num_values: int = 32,
        num_pairs: int = 8,
        num_queries: int = 8,
        train_size: int = 20000,
        val_size: int = 1000,
        test_size: int = 1000,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        for name, value in (
            ("num_keys", num_keys),
            ("num_values", num_values),
            ("num_pairs", num_pairs),
            ("num_queries", num_queries),
            ("train_size", train_size),
            ("val_size", val_size),
            ("test_size", test_size),
            ("batch_size", batch_size),
        ):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_pairs > num_keys:
            raise ValueError(
                f"num_pairs={num_pairs} distinct keys per sequence need num_keys >= num_pairs, got num_keys={num_keys}"
            )
        if train_size < batch_size:
            raise ValueError(
                f"train_size={train_size} is smaller than one batch (batch_size={batch_size}); "
                "partial training batches are dropped, so no step would run"
            )
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        self.num_keys, self.num_values = num_keys, num_values
        self.num_pairs, self.num_queries = num_pairs, num_queries
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self._data: dict[str, _Sequences] = {}

    def __str__(self) -> str:
        # Lightning's would build (and may iterate) every loader; jsonargparse prints DataModules in messages
        return (
            f"{type(self).__name__}(num_keys={self.num_keys}, num_values={self.num_values}, num_pairs={self.num_pairs})"
        )

    # ------------------------------------------------------------------ vocabulary
    def load_vocab(self) -> Vocab:
        """Id -> token: the four specials, ``k0 .. k{num_keys-1}``, ``v0 .. v{num_values-1}``."""
        return Vocab(
            SPECIALS + tuple(f"k{i}" for i in range(self.num_keys)) + tuple(f"v{j}" for j in range(self.num_values))
        )

    @property
    def seq_len(self) -> int:
        """Model input length ``T = 2 * num_pairs + 2 * num_queries - 1``."""
        return 2 * self.num_pairs + 2 * self.num_queries - 1

    # ------------------------------------------------------------------ data
    def sequences(self, split: str) -> np.ndarray:
        """The full token sequences of ``split`` (``train``, ``val`` or ``test``), shape (N, T + 1)."""
        if split not in SPLITS:
            raise KeyError(f"unknown split {split!r}; the splits are {SPLITS}")
        rng = np.random.default_rng([self.seed, SPLITS.index(split)])
        return mqar_sequences(self.sizes[split], self.num_keys, self.num_values, self.num_pairs, self.num_queries, rng)

    def dataset(self, split: str) -> Dataset:
        """``split`` as a map-style dataset of ``{"input", "target", "loss_mask"}`` rows (built once)."""
        if split not in self._data:
            self._data[split] = _Sequences(self.sequences(split), self.num_pairs)
        return self._data[split]

    def setup(self, stage: str | None = None) -> None:
        needed = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}
        for split in needed.get(stage, SPLITS):
            self.dataset(split)

    def _eval_loader(self, split: str) -> DataLoader:
        """``split`` in order, the last partial batch kept (training reads :meth:`train_dataloader`)."""
        return DataLoader(self.dataset(split), batch_size=self.batch_size, num_workers=self.num_workers)

    def train_dataloader(self) -> ResumableLoader:
        """Batches in an order fixed by the seed and epoch, resumable at any batch (:class:`RecallStream`)."""
        rank, world = trainer_layout(self.trainer)
        steps = self.sizes["train"] // (self.batch_size * world)
        if steps < 1:
            raise ValueError(
                f"train_size={self.sizes['train']} is smaller than one global batch "
                f"({self.batch_size} x {world} devices)"
            )
        stream = RecallStream(self.dataset("train"), self.batch_size, rank, world)
        return ResumableLoader(StreamDataset(stream, steps, run_seed(), rank), self.num_workers, world)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
