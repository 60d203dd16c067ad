"""Resumable, parallel shard writing shared by every ``mmlight prepare`` dataset and the generated
quick-start sets.

A dataset's preparation cuts its raw data into :class:`ShardJob` s (a shard name plus a picklable
list of *items*, e.g. file paths) and gives a module-level function that turns one item into a
webdataset sample, or into a :class:`Skipped` record when the item is bad. :func:`write_shards` then

* writes each shard to ``<name>.tmp`` and renames it into place (:func:`~mmlight.data.shards.atomic_write`),
  followed by a ``<name>.done.json``
  record (sample count, checksum, skipped items), so a killed run never leaves a shard that looks
  finished;
* on a rerun verifies every shard that has a record (its items, size and SHA-256) and skips it, so
  rerunning a finished preparation only reads, an interrupted one loses nothing already written, and a
  shard whose items changed (other raw data, another cleaning rule) is written again;
* runs shards in ``workers`` processes with a progress bar;
* logs every skipped item with its path and reason, and returns them for ``_info.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import webdataset as wds
from tqdm import tqdm

from mmlight.data.shards import atomic_write, sha256, write_text_atomic

log = logging.getLogger(__name__)
DONE_SUFFIX = ".done.json"


@dataclass
class Skipped:
    """A raw item left out of the shards: where it came from and why."""

    path: str
    reason: str


@dataclass
class ShardJob:
    """One shard to write.

    Args:
        name: file name of the shard, e.g. ``train-000003.tar``.
        items: picklable descriptions of its samples, in order, passed one by one to the dataset's
            ``make_sample`` function.
    """

    name: str
    items: list[Any] = field(default_factory=list)


SampleMaker = Callable[[Any], "dict | Skipped"]


def plan_shards(split: str, items: list[Any], per_shard: int) -> list[ShardJob]:
    """Cut ``items`` into consecutive shards of ``per_shard`` items named ``{split}-{i:06d}.tar``."""
    if per_shard < 1:
        raise ValueError(f"samples per shard must be >= 1, got {per_shard}")
    return [
        ShardJob(f"{split}-{i // per_shard:06d}.tar", items[i : i + per_shard]) for i in range(0, len(items), per_shard)
    ]


def items_digest(items: list[Any]) -> str:
    """SHA-256 of the items' ``repr``: what a shard was written from (paths, labels, text pairs), so that a
    rerun on changed items writes the shard again even when their count is the same."""
    return hashlib.sha256(repr(items).encode()).hexdigest()


def _finished(out_dir: Path, job: ShardJob) -> dict | None:
    """The shard's record if the shard on disk is complete, intact and written from the job's items, else
    None. A record of an older mmlight without ``items_sha256`` is judged by the item count alone."""
    record_path = out_dir / (job.name + DONE_SUFFIX)
    shard = out_dir / job.name
    if not (record_path.is_file() and shard.is_file()):
        return None
    record = json.loads(record_path.read_text())
    if record.get("num_items") != len(job.items) or shard.stat().st_size != record.get("bytes"):
        return None
    digest = items_digest(job.items)
    if record.get("items_sha256", digest) != digest:
        log.info("shard %s was written from other items; writing it again", shard)
        return None
    if sha256(shard) != record["sha256"]:
        log.warning("shard %s does not match its checksum; writing it again", shard)
        return None
    return record


def _write_one(job: ShardJob, out_dir: Path, make_sample: SampleMaker) -> dict:
    """Write one shard atomically and its record; return the record."""
    shard = out_dir / job.name
    skipped: list[dict] = []
    count = 0
    # A fixed member mtime makes a shard a function of its samples alone: a rewritten shard is
    # byte-identical, so checksums in _info.json do not change when a run resumes.
    with atomic_write(shard) as tmp, wds.TarWriter(str(tmp), mtime=0.0) as writer:
        for item in job.items:
            sample = make_sample(item)
            if isinstance(sample, Skipped):
                skipped.append({"path": sample.path, "reason": sample.reason})
                continue
            writer.write(sample)
            count += 1
    record = {
        "name": job.name,
        "num_samples": count,
        "num_items": len(job.items),
        "items_sha256": items_digest(job.items),
        "skipped": skipped,
        "bytes": shard.stat().st_size,
        "sha256": sha256(shard),
    }
    write_text_atomic(out_dir / (job.name + DONE_SUFFIX), json.dumps(record))
    return record


def _run_job(job: ShardJob, out_dir: Path, make_sample: SampleMaker) -> tuple[dict, bool]:
    record = _finished(out_dir, job)
    if record is not None:
        return record, False
    return _write_one(job, out_dir, make_sample), True


def write_shards(
    jobs: list[ShardJob], out_dir: Path, make_sample: SampleMaker, workers: int = 1, desc: str = "shards"
) -> dict:
    """Write (or verify and keep) every shard of one split; return the split's ``_info.json`` entry.

    Args:
        jobs: the shards of the split, from :func:`plan_shards` or the dataset's own plan.
        out_dir: the shard set folder.
        make_sample: module-level function, item -> webdataset sample dict (with ``__key__``) or
            :class:`Skipped`; it runs in worker processes, so it must be picklable.
        workers: processes; 1 writes in this process.
        desc: progress-bar label.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict] = {}
    written = 0
    with tqdm(total=len(jobs), desc=desc, unit="shard") as bar:
        if workers > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                futures = [pool.submit(_run_job, job, out_dir, make_sample) for job in jobs]
                for future in futures:
                    record, fresh = future.result()
                    records[record["name"]] = record
                    written += fresh
                    bar.update()
        else:
            for job in jobs:
                record, fresh = _run_job(job, out_dir, make_sample)
                records[record["name"]] = record
                written += fresh
                bar.update()
    skipped = [s for job in jobs for s in records[job.name]["skipped"]]
    for s in skipped:
        log.warning("skipped %s: %s", s["path"], s["reason"])
    log.info(
        "%s: %d shards written, %d verified and kept, %d items skipped",
        desc,
        written,
        len(jobs) - written,
        len(skipped),
    )
    shards = [{k: records[job.name][k] for k in ("name", "num_samples", "sha256")} for job in jobs]
    return {
        "num_samples": sum(s["num_samples"] for s in shards),
        "num_skipped": len(skipped),
        "skipped": skipped,
        "shards": shards,
    }
