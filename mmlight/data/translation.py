"""Streaming translation data (IWSLT14 de-en shards from ``mmlight prepare iwslt14``) with token budgets.

Conventions (fairseq's ``LanguagePairDataset`` / ``transformer_iwslt_de_en``):

* the source is the German ids followed by ``</s>``;
* the decoder input starts with ``</s>``, not ``<s>``: fairseq builds ``prev_output_tokens`` by moving
  the target's final ``</s>`` to the front, so ``tgt_in = </s> + target`` and ``tgt_out = target + </s>``
  (``decoder_start_id`` says which id is used);
* a sample's size is ``max(len(src), len(tgt))`` counting the ``</s>`` (fairseq's ``num_tokens``), and
  a batch of ``B`` samples whose largest size is ``L`` obeys ``B * L <= max_tokens``, so both padded
  tensors ``src`` (B, S) and ``tgt_*`` (B, T) hold at most ``max_tokens`` entries;
* a sample longer than ``max_source_positions``/``max_target_positions`` or bigger than ``max_tokens``
  on its own is skipped with a warning that counts the skips of its worker (fairseq would stop with an
  error unless told to skip).

Batches are dicts::

    src (B, S) int64, pad-padded      src_mask (B, S) bool, True = real token
    tgt_in (B, T) int64               tgt_out (B, T) int64        tgt_mask (B, T) bool
    ntokens int (real target tokens incl. </s>)   keys list[str]   ids (B,) int64 (index in the split / file)
"""

from __future__ import annotations

import io
import logging
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader

from mmlight.data.shards import MemberReader, npy_header, split_urls
from mmlight.data.skips import Skipping, is_kept
from mmlight.data.streaming import RankRandom, ShardDataModule, StreamSource, resampled_samples, shuffled
from mmlight.data.vocab import Vocab, VocabAttributes

log = logging.getLogger(__name__)


def array_lengths(sample: dict) -> tuple[int, int]:
    """``(source, target)`` token counts of a sample, without ``</s>``."""
    return len(sample["src"]), len(sample["tgt"])


def sample_size(sample: dict, lengths: Callable[[dict], tuple[int, int]] = array_lengths) -> int:
    """fairseq's ``num_tokens``: the longer side, counting its ``</s>``."""
    return max(lengths(sample)) + 1


def _from_shard(sample: dict) -> dict:
    """Raw shard sample (``.npy`` bytes) -> ``{key, id, src, tgt}``; raises on a corrupt sample."""
    key = sample["__key__"]
    src, tgt = (np.load(io.BytesIO(sample[name]), allow_pickle=False) for name in ("src.npy", "tgt.npy"))
    return {"key": key, "id": int(key.rsplit("-", 1)[1]), "src": src.astype(np.int64), "tgt": tgt.astype(np.int64)}


def budget_batches(
    samples: Iterable[dict],
    max_tokens: int,
    buffer: int,
    shuffle: bool,
    max_source_positions: int = 1024,
    max_target_positions: int = 1024,
    sort: bool = True,
    rng: random.Random | None = None,
    lengths: Callable[[dict], tuple[int, int]] = array_lengths,
    warn: bool = True,
) -> Iterator[list[dict]]:
    """Cut a sample stream into batches with ``len(batch) * max(sample_size) <= max_tokens``.

    ``buffer`` samples are gathered, sorted by size (when ``sort``), cut greedily into budget-bounded
    batches, and those are yielded in shuffled order (when ``shuffle``, drawing from ``rng``); the
    last batches may be small. Samples over the position limits or the budget are skipped, with a
    warning when ``warn``. ``lengths`` gives a sample's ``(source, target)`` token counts (a training
    stream batches references whose lengths come from ``.npy`` headers).
    """
    rng = rng or random.Random()
    skipped = 0

    def cut(pool: list[dict]) -> list[list[dict]]:
        if sort:
            pool.sort(key=lambda s: sample_size(s, lengths))
        batches, batch, longest = [], [], 0
        for s in pool:
            size = sample_size(s, lengths)
            if batch and (len(batch) + 1) * max(longest, size) > max_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(s)
            longest = max(longest, size)
        if batch:
            batches.append(batch)
        if shuffle:
            rng.shuffle(batches)
        return batches

    pool: list[dict] = []
    for s in samples:
        src_len, tgt_len = lengths(s)
        if (
            src_len + 1 > max_source_positions
            or tgt_len + 1 > max_target_positions
            or max(src_len, tgt_len) + 1 > max_tokens
        ):
            skipped += 1
            if warn:
                warnings.warn(
                    f"skipping sample {s.get('key')} ({src_len} source, {tgt_len} target "
                    f"tokens): over max_tokens={max_tokens} or the position limits; "
                    f"{skipped} skipped so far in this worker",
                    stacklevel=2,
                )
            continue
        pool.append(s)
        if len(pool) >= buffer:
            yield from cut(pool)
            pool = []
    if pool:
        yield from cut(pool)


def decoder_start_id(vocab: Vocab) -> int:
    """First decoder input: ``</s>``, as fairseq's ``prev_output_tokens``."""
    return vocab.eos_id


def source_sample(sample_id: int, ids: list[int]) -> dict:
    """A sample of source ids alone (no target), as :func:`collate` takes it: raw text to translate."""
    return {
        "key": f"line-{sample_id:07d}",
        "id": sample_id,
        "src": np.asarray(ids, dtype=np.int64),
        "tgt": np.zeros(0, dtype=np.int64),
    }


def collate(batch: list[dict], pad_id: int, eos_id: int, start_id: int) -> dict:
    """Pad a list of ``{"src", "tgt", "key", "id"}`` samples into the batch dict (see the module doc)."""
    n = len(batch)
    s_len = max(len(b["src"]) for b in batch) + 1
    t_len = max(len(b["tgt"]) for b in batch) + 1
    src = torch.full((n, s_len), pad_id, dtype=torch.int64)
    tgt_in = torch.full((n, t_len), pad_id, dtype=torch.int64)
    tgt_out = torch.full((n, t_len), pad_id, dtype=torch.int64)
    for i, b in enumerate(batch):
        s, t = torch.as_tensor(b["src"], dtype=torch.int64), torch.as_tensor(b["tgt"], dtype=torch.int64)
        src[i, : len(s)] = s
        src[i, len(s)] = eos_id
        tgt_in[i, 0] = start_id
        tgt_in[i, 1 : len(t) + 1] = t
        tgt_out[i, : len(t)] = t
        tgt_out[i, len(t)] = eos_id
    src_mask = torch.zeros((n, s_len), dtype=torch.bool)
    tgt_mask = torch.zeros((n, t_len), dtype=torch.bool)
    for i, b in enumerate(batch):
        src_mask[i, : len(b["src"]) + 1] = True
        tgt_mask[i, : len(b["tgt"]) + 1] = True
    return {
        "src": src,
        "src_mask": src_mask,
        "tgt_in": tgt_in,
        "tgt_out": tgt_out,
        "tgt_mask": tgt_mask,
        "ntokens": int(tgt_mask.sum()),
        "keys": [b["key"] for b in batch],
        "ids": torch.tensor([b["id"] for b in batch], dtype=torch.int64),
    }


def _batch_stage(src: Iterable[dict], **kwargs) -> Iterator[list[dict]]:
    yield from budget_batches(src, **kwargs)


def ref_lengths(ref: dict) -> tuple[int, int]:
    """``(source, target)`` token counts of a sample reference of :class:`BudgetStream`."""
    return ref["src_len"], ref["tgt_len"]


class BudgetStream(StreamSource):
    """Training batches of a translation shard set: resampled shards, a shuffle buffer of sample
    references (with lengths from the ``.npy`` headers), token-budget batches of them
    (:func:`budget_batches`); a batch's samples are read and collated only when materialised.

    Args:
        urls: training shards.
        shuffle_buffer: samples held in the shuffle buffer (also the bucketing buffer).
        batching: keyword arguments of :func:`budget_batches` (``max_tokens``, ``buffer``, the limits).
        collate_fn: list of samples -> batch dict.
        counter: where unreadable samples are counted.
    """

    def __init__(self, urls: list[str], shuffle_buffer: int, batching: dict, collate_fn, counter):
        self.urls, self.shuffle_buffer, self.batching, self.collate_fn = urls, shuffle_buffer, batching, collate_fn
        self.counter = counter
        self.reader = MemberReader()

    def _with_lengths(self, refs: Iterable[dict], count_skips: bool) -> Iterator[dict]:
        for ref in refs:
            try:
                lengths = [
                    int(np.prod(npy_header(self.reader, ref["__url__"], *ref[name])[1]))
                    for name in ("src.npy", "tgt.npy")
                ]
            except Exception as err:  # a missing member or a corrupt header
                if count_skips:
                    self.counter.add()
                    log.warning(
                        "skipped corrupt sample %s in %s: %s: %s",
                        ref.get("__key__"),
                        ref.get("__url__"),
                        type(err).__name__,
                        err,
                    )
                continue
            yield {**ref, "key": ref["__key__"], "src_len": lengths[0], "tgt_len": lengths[1]}

    def units(self, rand: RankRandom, count_skips: bool):
        refs = resampled_samples(self.urls, rand.python("shards"), self.counter if count_skips else None)
        refs = shuffled(self._with_lengths(refs, count_skips), self.shuffle_buffer, rand.python("shuffle"))
        return budget_batches(
            refs, shuffle=True, rng=rand.python("batches"), lengths=ref_lengths, warn=count_skips, **self.batching
        )

    def materialise(self, unit: list[dict]) -> dict:
        samples = [
            _from_shard(
                {
                    "__key__": ref["__key__"],
                    **{name: self.reader.read(ref["__url__"], *ref[name]) for name in ("src.npy", "tgt.npy")},
                }
            )
            for ref in unit
        ]
        return self.collate_fn(samples)


class TranslationDataModule(VocabAttributes, ShardDataModule):
    """Streams a translation shard set (``mmlight prepare iwslt14``) in token-budget batches.

    Training reads resampled shards in an order fixed by the seed, epoch and rank, resumable at any
    batch (:class:`BudgetStream`), for a fixed number of batches per epoch,
    ``num_tokens(train) // (max_tokens * world_size)`` where ``num_tokens`` sums the sample sizes
    of the split (``_info.json``), so every DDP rank runs the same number of steps. Padding makes real
    batches hold fewer than ``max_tokens`` sizes, so an "epoch" sees somewhat fewer samples than the
    split holds; it is an approximate epoch. Validation and test read each shard once, split by node and
    DataLoader worker, so each sample is seen exactly once over all ranks (ranks may get different
    numbers of batches). Predict reads ``src_file`` (raw German, one sentence per line) when given,
    else the test split.

    Args:
        root: folder holding the shards, ``_info.json``, ``dict.txt`` and the BPE ``code``.
        max_tokens: token budget per batch: batch size x largest sample size (longer side + ``</s>``).
        num_workers: DataLoader worker processes per device.
        max_source_positions: longest source (with ``</s>``) kept; longer samples are skipped.
        max_target_positions: longest target (with ``</s>``) kept; longer samples are skipped.
        bucket_buffer: samples gathered, sorted by length and cut into batches at a time.
        src_file: raw German text file for ``predict`` (tokenised, lowercased and BPE'd like the data).
        train_split: name of the training split in ``_info.json``.
        val_split: name of the validation split.
        test_split: name of the test split (also predicted when ``src_file`` is None).
    """

    def __init__(
        self,
        root: str,
        max_tokens: int = 4096,
        num_workers: int = 2,
        max_source_positions: int = 1024,
        max_target_positions: int = 1024,
        bucket_buffer: int = 2000,
        src_file: str | None = None,
        train_split: str = "train",
        val_split: str = "valid",
        test_split: str = "test",
    ):
        super().__init__(root, num_workers, val_split, test_split)
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        if bucket_buffer < 1:
            raise ValueError(f"bucket_buffer must be >= 1, got {bucket_buffer}")
        self.max_tokens = max_tokens
        self.max_source_positions = max_source_positions
        self.max_target_positions = max_target_positions
        self.bucket_buffer = bucket_buffer
        self.src_file = src_file
        self.train_split = train_split

    @property
    def decoder_start_id(self) -> int:
        """First decoder input (:func:`decoder_start_id`)."""
        return decoder_start_id(self.vocab)

    # ------------------------------------------------------------------ loaders
    def _batching(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "buffer": self.bucket_buffer,
            "max_source_positions": self.max_source_positions,
            "max_target_positions": self.max_target_positions,
        }

    def _collate(self):
        return partial(collate, pad_id=self.pad_id, eos_id=self.eos_id, start_id=self.decoder_start_id)

    def _eval_pipeline(self, urls: list[str]) -> wds.DataPipeline:
        batches = partial(_batch_stage, shuffle=False, **self._batching())
        return wds.DataPipeline(
            *self.eval_stages(urls),
            wds.map(Skipping(_from_shard, self.skipped)),
            wds.select(is_kept),
            batches,
            wds.map(self._collate()),
        )

    def train_steps(self) -> int:
        """Batches per rank per epoch: the split's summed sample sizes // (max_tokens x world size)."""
        num_tokens = self._info()["splits"][self.train_split]["num_tokens"]
        return self.epoch_steps(num_tokens, self.max_tokens, f"{self.max_tokens} tokens")

    def train_dataloader(self):
        stream = BudgetStream(
            split_urls(self.root, self._info(), self.train_split),
            self.bucket_buffer,
            self._batching(),
            self._collate(),
            self.skipped,
        )
        return self.resumable_loader(stream, self.train_steps())

    def _eval_loader(self, split: str):
        dataset = self._eval_pipeline(split_urls(self.root, self._info(), split))
        return wds.WebLoader(dataset, batch_size=None, num_workers=self.num_workers)

    def predict_dataloader(self):
        """Batches of ``src_file`` in file order (``ids`` = 0-based line numbers; ``tgt_*`` empty), or the
        test split."""
        if self.src_file is None:
            return self._eval_loader(self.test_split)
        with open(self.src_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
        samples = [source_sample(i, self.encode(line)) for i, line in enumerate(lines)]
        for s in samples:  # every line must come back: a too-long one is an error here, not a skip
            if len(s["src"]) + 1 > min(self.max_source_positions, self.max_tokens):
                raise ValueError(
                    f"{self.src_file}:{s['id'] + 1} has {len(s['src']) + 1} tokens with </s>, over "
                    f"max_tokens={self.max_tokens} or max_source_positions={self.max_source_positions}"
                )
        batches = [
            collate(b, self.pad_id, self.eos_id, self.decoder_start_id)
            for b in budget_batches(
                samples,
                self.max_tokens,
                buffer=len(samples) or 1,
                shuffle=False,
                max_source_positions=self.max_source_positions,
                max_target_positions=self.max_target_positions,
                sort=False,
            )
        ]
        return DataLoader(batches, batch_size=None, shuffle=False)
