"""Word-level language-model data (WikiText-103) from the shard set of ``mmlight prepare wikitext103``.

Training streams resampled shards and cuts each stored chunk of the token stream into contiguous
blocks; evaluation slides a window with a stated context over the whole validation/test stream, so
every token is scored exactly once (``fairseq-eval-lm --context-window``).

Batches are dicts:

* ``input`` (B, T) int64 token ids, ``target`` (B, T) int64 the next token of each input position;
* ``loss_mask`` (B, T) bool, True where the target is scored (all True in training; in evaluation
  False on the context part of a window and on padding);
* evaluation only: ``start`` (B,) int64, the position in the split's token stream of ``target[:, 0]``
  (so ``target[b, t]`` is stream token ``start[b] + t`` wherever ``loss_mask[b, t]``).

Padding (a short last evaluation window) uses :attr:`WikiTextDataModule.pad_id` in ``input`` and
``target``, with ``loss_mask`` False.

Perplexity per word = ``exp(sum of -log p(target) over scored targets / number of scored targets)``,
summed over the whole split (accumulate the two sums per rank and all-reduce them once at the end of
the epoch; don't average per-batch perplexities, and don't make collective calls per step, since
ranks may run different numbers of evaluation batches). As in fairseq, the end-of-line symbol
``</s>`` that ends every line is a token and is scored, and the first token of a split is predicted
from ``</s>`` (the end of the "previous line"), so the number of scored targets equals the split's
``num_tokens`` in ``_info.json``.
"""

from __future__ import annotations

import io
import logging
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from mmlight.data.shards import MemberReader, npy_header, split_urls
from mmlight.data.streaming import RankRandom, ShardDataModule, StreamSource, batched, resampled_samples, shuffled
from mmlight.data.vocab import VocabAttributes

log = logging.getLogger(__name__)


def block_starts(length: int, block_size: int, rng: random.Random, random_offset: bool = True) -> range:
    """Starts of the contiguous blocks of ``block_size + 1`` tokens cut from a chunk of ``length``
    tokens (consecutive blocks share one token, so every target of the chunk after the offset is
    trained on); ``input = block[:-1]``, ``target = block[1:]``.

    With ``random_offset`` the chunk starts at an offset in ``[0, block_size)`` drawn from ``rng``, so
    block boundaries differ from epoch to epoch; tokens before the offset and after the last full
    block are not used in that pass.
    """
    start = rng.randrange(block_size) if random_offset else 0
    return range(start, length - block_size, block_size)


class BlockStream(StreamSource):
    """Training batches of a token shard set: resampled shards, every chunk cut into blocks at a
    random offset (:func:`block_starts`; a chunk's length comes from its ``.npy`` header), a shuffle
    buffer of block references, batches of ``batch_size``; only the blocks' own bytes are read when
    a batch is materialised.

    Args:
        urls: training shards.
        block_size: tokens per sample.
        batch_size: blocks per batch.
        shuffle_buffer: blocks held in the shuffle buffer (0: none).
        counter: where unreadable chunks are counted.
    """

    def __init__(self, urls: list[str], block_size: int, batch_size: int, shuffle_buffer: int, counter):
        self.urls, self.block_size, self.batch_size, self.shuffle_buffer = urls, block_size, batch_size, shuffle_buffer
        self.counter = counter
        self.reader = MemberReader()

    def _header(self, chunk: dict, count_skips: bool) -> tuple | None:
        """``(dtype, number of tokens, data offset)`` of a chunk's ``ids.npy``; None, counted and logged,
        when its header does not parse."""
        try:
            dtype, shape, data = npy_header(self.reader, chunk["__url__"], *chunk["ids.npy"])
        except Exception as err:  # a corrupt header may raise anything from numpy's parser
            if count_skips:
                self.counter.add()
                log.warning(
                    "skipped corrupt chunk %s in %s: %s: %s",
                    chunk["__key__"],
                    chunk["__url__"],
                    type(err).__name__,
                    err,
                )
            return None
        return dtype, int(np.prod(shape)), data

    def _readable_chunks(self, chunks: Iterator[dict], count_skips: bool) -> Iterator[tuple[dict, tuple]]:
        """The chunks whose header parses, with their headers (every one of them, short ones included:
        each draws its block offset, which keeps the seeded stream as it was).

        A chunk is usable when it also holds more than ``block_size`` tokens. A shard is drawn whole, so an
        unusable chunk seen twice since the last usable one means its shard has none; once every shard is
        such, the stream stops with an error naming them instead of drawing forever."""
        seen: set[tuple[str, str]] = set()  # (shard, key) of the unusable chunks since the last usable one
        barren: set[str] = set()
        for chunk in chunks:
            if "ids.npy" not in chunk:
                continue
            header = self._header(chunk, count_skips)
            if header is not None and header[1] > self.block_size:
                seen.clear()
                barren.clear()
            else:
                identity = (chunk["__url__"], chunk["__key__"])
                if identity in seen:
                    barren.add(chunk["__url__"])
                    if len(barren) == len(set(self.urls)):
                        raise RuntimeError(
                            f"no chunk of more than block_size={self.block_size} tokens with a readable header in "
                            f"any of the {len(barren)} training shards, e.g. {sorted(barren)[:3]}: prepare the "
                            "data again (mmlight prepare wikitext103)"
                        )
                seen.add(identity)
            if header is not None:
                yield chunk, header

    def units(self, rand: RankRandom, count_skips: bool):
        chunks = resampled_samples(self.urls, rand.python("shards"), self.counter if count_skips else None)
        offsets = rand.python("offsets")
        blocks = (
            (chunk["__url__"], data + s * dtype.itemsize, dtype)
            for chunk, (dtype, length, data) in self._readable_chunks(chunks, count_skips)
            for s in block_starts(length, self.block_size, offsets)
        )
        return batched(shuffled(blocks, self.shuffle_buffer, rand.python("shuffle")), self.batch_size)

    def materialise(self, unit: list[tuple]) -> dict:
        samples = []
        for url, offset, dtype in unit:
            block = np.frombuffer(self.reader.read(url, offset, (self.block_size + 1) * dtype.itemsize), dtype)
            block = block.astype(np.int64)
            samples.append({"input": block[:-1], "target": block[1:]})
        return collate_blocks(samples)


def collate_blocks(samples: list[dict]) -> dict:
    """Stack training blocks into a batch."""
    inputs = torch.from_numpy(np.stack([s["input"] for s in samples]))
    targets = torch.from_numpy(np.stack([s["target"] for s in samples]))
    return {"input": inputs, "target": targets, "loss_mask": torch.ones_like(targets, dtype=torch.bool)}


def eval_windows(num_tokens: int, block_size: int, context: int) -> list[tuple[int, int, int]]:
    """The evaluation windows over a stream of ``num_tokens`` targets, as ``(start, first, stop)``.

    Window ``k`` holds targets ``stream[start:start + block_size]`` (cut at ``num_tokens``) and scores
    ``stream[first:stop]``: the first window scores all of its targets, every later one only its last
    ``block_size - context`` targets, each of which is predicted from at least ``context + 1`` tokens
    (``context`` tokens before its immediate predecessor). Consecutive windows' scored ranges tile
    ``[0, num_tokens)``.
    """
    if not 0 <= context < block_size:
        raise ValueError(f"eval_context must be in [0, eval_block_size), got {context} with block {block_size}")
    stride = block_size - context
    windows = []
    start = 0
    while True:
        first = 0 if start == 0 else start + context
        if first >= num_tokens:
            break
        windows.append((start, first, min(start + block_size, num_tokens)))
        start += stride
    return windows


class EvalWindows(IterableDataset):
    """Batches of evaluation windows over an in-memory token stream for one rank.

    Rank ``r`` of ``W`` takes windows ``r, r + W, ...``; batches are formed from those in order.

    Args:
        stream: the split's token ids in order.
        block_size: window length.
        context: tokens of context (see :func:`eval_windows`).
        batch_size: windows per batch (the last batch may be smaller).
        pad_id: id used to pad a short window.
        eos_id: the token the first target of the stream is predicted from.
        rank: this rank.
        world_size: number of ranks.
    """

    def __init__(
        self,
        stream: np.ndarray,
        block_size: int,
        context: int,
        batch_size: int,
        pad_id: int,
        eos_id: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        self.stream = np.concatenate([[eos_id], np.asarray(stream, dtype=np.int64)])  # input of target j: [j]
        self.block_size = block_size
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.windows = eval_windows(len(stream), block_size, context)[rank::world_size]

    def __len__(self) -> int:
        return (len(self.windows) + self.batch_size - 1) // self.batch_size

    def _window(self, start: int, first: int, stop: int):
        n = stop - start
        inputs = np.full(self.block_size, self.pad_id, dtype=np.int64)
        targets = np.full(self.block_size, self.pad_id, dtype=np.int64)
        mask = np.zeros(self.block_size, dtype=bool)
        inputs[:n] = self.stream[start:stop]
        targets[:n] = self.stream[start + 1 : stop + 1]
        mask[first - start : n] = True
        return inputs, targets, mask

    def __iter__(self):
        for b in range(0, len(self.windows), self.batch_size):
            part = self.windows[b : b + self.batch_size]
            inputs, targets, masks = zip(*(self._window(*w) for w in part))
            yield {
                "input": torch.from_numpy(np.stack(inputs)),
                "target": torch.from_numpy(np.stack(targets)),
                "loss_mask": torch.from_numpy(np.stack(masks)),
                "start": torch.tensor([w[0] for w in part], dtype=torch.int64),
            }


def read_stream(root: str | Path, info: dict, split: str) -> np.ndarray:
    """A split's whole token stream, reassembled in order from its shards (checked against ``num_tokens``)."""
    chunks: dict[str, np.ndarray] = {}
    for url in split_urls(root, info, split):
        with tarfile.open(url) as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".ids.npy"):
                    key = member.name[: -len(".ids.npy")]
                    chunks[key] = np.load(io.BytesIO(tar.extractfile(member).read()), allow_pickle=False)
    keys = sorted(chunks)
    if keys != [f"{i:06d}" for i in range(len(keys))]:
        raise ValueError(f"split {split!r} of {root} does not hold consecutive chunks 000000..")
    stream = np.concatenate([chunks[k] for k in keys]) if keys else np.zeros(0, np.uint32)
    expected = info["splits"][split]["num_tokens"]
    if len(stream) != expected:
        raise ValueError(f"split {split!r} of {root} has {len(stream)} tokens, _info.json says {expected}")
    return stream.astype(np.int64)


class WikiTextDataModule(VocabAttributes, ShardDataModule):
    """Word-level language modelling on a WikiText-103 shard set (see the module docstring for the
    batch format and how to compute perplexity).

    Training reads resampled shards (in an order fixed by the seed, epoch and rank, resumable at any
    batch: :class:`BlockStream`), cuts every chunk into contiguous blocks, shuffles them in a buffer
    and batches them without partial batches; an epoch is fixed to
    ``num_train_tokens // (block_size * batch_size * world_size)`` steps on every
    rank, so DDP ranks never wait for each other. Validation and test slide a window with a stated
    context over the whole split, split across ranks by window index, every token scored once.

    Args:
        root: folder of the shard set (``_info.json``, ``vocab.txt``, shards).
        block_size: training tokens per sample (fairseq's ``tokens_per_sample``, 512 in the
            ``transformer_lm`` WikiText-103 recipe).
        batch_size: samples (blocks or windows) per device batch.
        num_workers: DataLoader worker processes per device for training (evaluation reads the small
            split into memory and runs in the main process).
        eval_block_size: evaluation window length; None means ``block_size``.
        eval_context: tokens of context for evaluation (fairseq-eval-lm ``--context-window``): every
            window after the first scores only its last ``eval_block_size - eval_context`` targets, each
            predicted from at least ``eval_context + 1`` tokens. None means 0 (non-overlapping windows,
            fairseq's default); e.g. 400 with 512-token windows gives better-conditioned scores at
            ~4.4x the evaluation cost. Must be smaller than the window.
        shuffle_buffer: training blocks held in the shuffle buffer (0 disables shuffling).
        train_split: name of the training split in ``_info.json``.
        val_split: name of the validation split.
        test_split: name of the split that ``test`` and ``predict`` read.
    """

    def __init__(
        self,
        root: str,
        block_size: int = 512,
        batch_size: int = 8,
        num_workers: int = 2,
        eval_block_size: int | None = None,
        eval_context: int | None = None,
        shuffle_buffer: int = 4096,
        train_split: str = "train",
        val_split: str = "valid",
        test_split: str = "test",
    ):
        super().__init__(root, num_workers, val_split, test_split)
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"block_size and batch_size must be >= 1, got {block_size} and {batch_size}")
        self.block_size = block_size
        self.batch_size = batch_size
        self.eval_block_size = block_size if eval_block_size is None else eval_block_size
        self.eval_context = 0 if eval_context is None else eval_context
        if not 0 <= self.eval_context < self.eval_block_size:
            raise ValueError(
                f"eval_context must be in [0, eval_block_size={self.eval_block_size}), got {self.eval_context}"
            )
        self.shuffle_buffer = shuffle_buffer
        self.train_split = train_split
        self._streams: dict[str, np.ndarray] = {}

    @property
    def num_train_tokens(self) -> int:
        return int(self._info()["splits"][self.train_split]["num_tokens"])

    def train_steps(self) -> int:
        """Training steps per epoch on every rank; an error, before any work, when no chunk of the
        training shards is long enough for one block (the resampled stream would wait forever)."""
        longest = min(int(self._info().get("chunk_tokens", self.num_train_tokens)), self.num_train_tokens)
        if longest <= self.block_size:
            raise ValueError(
                f"the training chunks of {self.root} hold at most {longest} tokens, and a block of "
                f"block_size={self.block_size} needs {self.block_size + 1}: lower block_size, or prepare "
                "the data again with longer chunks (mmlight.data.prepare.wikitext.prepare's chunk_tokens)"
            )
        return self.epoch_steps(
            self.num_train_tokens, self.block_size * self.batch_size, f"{self.batch_size} x {self.block_size} tokens"
        )

    # -- loaders ----------------------------------------------------------------------------------
    def train_dataloader(self):
        stream = BlockStream(
            split_urls(self.root, self._info(), self.train_split),
            self.block_size,
            self.batch_size,
            self.shuffle_buffer,
            self.skipped,
        )
        return self.resumable_loader(stream, self.train_steps())

    def stream(self, split: str) -> np.ndarray:
        """A split's whole token stream (int64), read once and kept in memory."""
        if split not in self._streams:
            self._streams[split] = read_stream(self.root, self._info(), split)
        return self._streams[split]

    def eval_dataset(self, split: str) -> EvalWindows:
        """This rank's evaluation windows of ``split``."""
        rank, world = self._rank_and_world()
        return EvalWindows(
            self.stream(split),
            self.eval_block_size,
            self.eval_context,
            self.batch_size,
            self.pad_id,
            self.eos_id,
            rank,
            world,
        )

    def _eval_loader(self, split: str) -> DataLoader:
        return DataLoader(self.eval_dataset(split), batch_size=None, num_workers=0)
