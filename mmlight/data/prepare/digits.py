"""The quick-start digits (shipped inside scikit-learn) through the same shard writer; no ``--src``."""

from __future__ import annotations

from pathlib import Path

from mmlight.data.digits import write_digits_shards

NEEDS_SRC = False


def prepare(src: Path | None, out: Path, workers: int) -> dict:
    """Write the digits ``train``/``val`` shards (the quick start's fixed split) into ``out``."""
    return write_digits_shards(out)
