"""A BPE'd German-English corpus -> the translation shard set that :class:`TranslationDataModule`
streams: ``dict.txt``, shards and ``_info.json`` beside the BPE ``code`` file. Written by
``mmlight prepare iwslt14`` (both raw layouts) and by the generated translation quick start.

The joint dictionary ``dict.txt`` is built from the training text of both sides
(:func:`mmlight.data.vocab.build_dictionary`). Each sentence pair is one sample::

    {"__key__": "train-0000042", "src.npy": int32 ids (de), "tgt.npy": int32 ids (en),
     "src.txt": BPE'd German text, "tgt.txt": BPE'd English text}

with no BOS/EOS stored; a token missing from the dictionary is ``<unk>``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from mmlight.data.shard_writer import plan_shards, write_shards
from mmlight.data.shards import write_info
from mmlight.data.tokenizers import TOKENIZER
from mmlight.data.vocab import UNK_ID, Tokenizer, build_dictionary, load_dictionary, vocab_entry, write_dictionary

log = logging.getLogger(__name__)

SRC_LANG, TGT_LANG = "de", "en"
BPE_FILE, DICT_FILE = "code", "dict.txt"
SAMPLES_PER_SHARD = 10_000

#: ``{split: (German lines, English lines)}``, BPE'd, line-aligned.
ParallelText = dict[str, tuple[list[str], list[str]]]


def make_sample(item: tuple) -> dict:
    """``(key, de_bpe, en_bpe, de_ids, en_ids)`` -> webdataset sample (module level: picklable)."""
    key, de, en, de_ids, en_ids = item
    return {
        "__key__": key,
        "src.npy": np.asarray(de_ids, dtype=np.int32),
        "tgt.npy": np.asarray(en_ids, dtype=np.int32),
        "src.txt": de,
        "tgt.txt": en,
    }


def write_translation_shards(
    texts: ParallelText,
    out: Path,
    *,
    layout: str,
    bpe_merges: int,
    skipped: dict[str, list[dict]] | None = None,
    cleaning: dict | None = None,
    samples_per_shard: int = SAMPLES_PER_SHARD,
    workers: int = 1,
) -> dict:
    """Write ``dict.txt``, every split's shards and ``_info.json`` into ``out``; return the info.

    Args:
        texts: the BPE'd splits; ``train`` must be among them (the dictionary is built from it).
        out: the shard set folder; the BPE ``code`` file must already be there.
        layout: how the raw corpus was laid out (recorded in ``_info.json``).
        bpe_merges: merge operations of the codes (recorded in ``_info.json``).
        skipped: per split, the pairs left out before this step (``{"path", "reason"}``), logged and
            listed in ``_info.json`` before the shard writer's own skips.
        cleaning: counts of the corpus cleaning, recorded in ``_info.json`` as ``cleaning``.
        samples_per_shard: sentence pairs per shard file.
        workers: shard-writing processes.
    """
    skipped = skipped or {}
    write_dictionary(build_dictionary(texts["train"]), out / DICT_FILE)
    index = {tok: i for i, tok in enumerate(load_dictionary(out / DICT_FILE))}

    splits = {}
    for split, (de_lines, en_lines) in texts.items():
        items, num_tokens = [], 0
        for i, (de, en) in enumerate(zip(de_lines, en_lines)):
            de_ids = [index.get(t, UNK_ID) for t in de.split()]
            en_ids = [index.get(t, UNK_ID) for t in en.split()]
            num_tokens += max(len(de_ids), len(en_ids)) + 1  # + </s>, as the DataModule counts
            items.append((f"{split}-{i:07d}", de, en, de_ids, en_ids))
        entry = write_shards(
            plan_shards(split, items, samples_per_shard), out, make_sample, workers, desc=f"iwslt14 {split}"
        )
        before = skipped.get(split, [])
        for s in before:
            log.warning("skipped %s: %s", s["path"], s["reason"])
        entry["skipped"] = before + entry["skipped"]
        entry["num_skipped"] = len(entry["skipped"])
        entry["num_tokens"] = num_tokens
        splits[split] = entry

    tokenizer = Tokenizer(moses=True, src_lang=SRC_LANG, tgt_lang=TGT_LANG, version=TOKENIZER)
    info = {
        "dataset": "iwslt14",
        "layout": layout,
        "vocab": vocab_entry(DICT_FILE, "dict", len(index), tokenizer, bpe_file=BPE_FILE, bpe_merges=bpe_merges),
        "cleaning": cleaning or {},
        "splits": splits,
    }
    return write_info(out, info)
