"""What the benchmarks that train share: the ``mmlight fit`` command line of a config, and the scalars a
fit logged to TensorBoard.

``fit_command`` runs the CLI through the interpreter (``python -m mmlight.cli``), so it needs no
``mmlight`` script on the PATH (an installation with ``--target`` has none). ``read_scalars`` reads
every event file under a run's folder (one per ``version_*`` or per resumed fit).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path


def fit_command(config: str | Path, options: Mapping[str, str] = {}, extra: Iterable[str] = ()) -> list[str]:
    """``python -m mmlight.cli fit --config CONFIG`` followed by ``options`` and ``extra``.

    Args:
        config: the config file.
        options: ``{"--trainer.max_steps": "300", ...}``, each flag followed by its value.
        extra: further arguments as they are (flags without a value, overrides built elsewhere).
    """
    argv = [sys.executable, "-m", "mmlight.cli", "fit", "--config", str(config)]
    return argv + [a for pair in options.items() for a in pair] + list(extra)


def read_scalars(run_dir: Path, tags: Iterable[str] | None = None) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value), ...]`` of every event file under ``run_dir`` (a file or a folder), in the
    order they were written; only ``tags`` when given (a tag never logged maps to ``[]``).

    Args:
        run_dir: an event file, or a folder searched for ``events.out.tfevents*`` recursively.
        tags: the scalar tags wanted; None: all.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = Path(run_dir)
    files = [run_dir] if run_dir.is_file() else sorted(run_dir.rglob("events.out.tfevents*"))
    scalars: dict[str, list[tuple[int, float]]] = {tag: [] for tag in tags or ()}
    for path in files:
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every point
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            if tags is None or tag in scalars:
                scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars
