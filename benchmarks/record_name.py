"""The one naming pattern of the record files in ``benchmarks/results/``:

    <benchmark>-<device>-<versions>-<YYYYMMDD>[-<tag>].<ext>

``benchmark`` is the script's measurement (``loader``, ``multimax``, ``reweighting_step_time``...),
``device`` the hardware it ran on (``cpu``, ``h100``), ``versions`` the major.minor versions the figures
depend on (``torch2.14_pillow13``), the date the day of the run (UTC), and the optional ``tag`` tells
apart the runs of one day (the time ``HHMM``, or a configuration such as ``lm`` or ``figures_off``).
Each part is lower-case letters, digits, ``_`` and (in the versions) ``.``; ``-`` only separates them.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

PATTERN = re.compile(
    r"(?P<benchmark>[a-z0-9_]+)-(?P<device>[a-z0-9_]+)-(?P<versions>[a-z0-9_.]+)-(?P<date>\d{8})"
    r"(?:-(?P<tag>[a-z0-9_]+))?\.(?P<ext>jsonl|json|md)"
)


def version_part(name: str, version: str) -> str:
    """``torch``, ``2.14.1+cu130`` -> ``torch2.14``: the name, lower-case and alphanumeric, and the major.minor.

    Args:
        name: the package (``torch``, ``Pillow-SIMD``).
        version: its version string; only the leading ``major.minor`` is kept.
    """
    match = re.match(r"\d+(?:\.\d+)?", version)
    if match is None:
        raise ValueError(f"version {version!r} of {name!r} does not start with a number")
    return re.sub(r"[^a-z0-9]", "", name.lower()) + match.group(0)


def device_name() -> str:
    """``torch.cuda.get_device_name()``, or ``"cpu (<processor>)"`` without CUDA."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or 'unknown'})"


def device_part(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA GeForce RTX 3090`` -> ``3090``; a name that starts
    with ``cpu`` (or has no model number) -> ``cpu``.

    Args:
        name: the device as ``torch.cuda.get_device_name`` gives it, or ``"cpu ..."``.
    """
    model = re.search(r"\b[A-Za-z]*\d+[A-Za-z]*\b", name)
    return "cpu" if name.lower().startswith("cpu") or model is None else model.group(0).lower()


def newest(paths: list[Path]) -> Path:
    """The record whose name says it is the latest: the latest date, then the latest tag (``HHMM`` tags
    sort as times of day), so that two runs of one day are not picked between at random.

    Args:
        paths: record files whose names follow :data:`PATTERN`.
    """

    def when(path: Path) -> tuple[str, str]:
        match = PATTERN.fullmatch(path.name)
        if match is None:
            raise ValueError(f"{path.name!r} does not follow the results' naming pattern {PATTERN.pattern}")
        return match["date"], match["tag"] or ""

    return max(paths, key=when)


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU as a CPU benchmark's record names it: ``x86_64, AMD EPYC 9654 96-Core Processor, 2 cores``.

    The model name comes from Linux's ``cpuinfo`` (``platform.processor()`` there says only ``x86_64``);
    elsewhere, or where it has none, the architecture and core count stand alone.

    Args:
        cpuinfo: the file to read the model name from.
    """
    text = cpuinfo.read_text() if cpuinfo.is_file() else ""
    models = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
    return ", ".join([platform.machine(), *models[:1], f"{os.cpu_count()} cores"])


def record_path(
    benchmark: str,
    device: str,
    versions: list[tuple[str, str]],
    ext: str,
    tag: str | None = None,
    when: datetime.datetime | None = None,
    folder: Path = RESULTS,
) -> Path:
    """The default path of a record file, following :data:`PATTERN`.

    Args:
        benchmark: the measurement's name (lower-case, ``_`` between words).
        device: the device part (:func:`device_part`).
        versions: (package name, version string) pairs, in the order they are to appear.
        ext: ``jsonl``, ``json`` or ``md``.
        tag: what tells apart runs of one day; the time ``HHMM`` of ``when`` if None.
        when: the run's time (now, UTC, if None).
        folder: where the file goes (``benchmarks/results/``).
    """
    when = when or datetime.datetime.now(datetime.timezone.utc)
    tag = when.strftime("%H%M") if tag is None else tag
    part = "_".join(version_part(name, version) for name, version in versions)
    name = f"{benchmark}-{device}-{part}-{when:%Y%m%d}" + (f"-{tag}" if tag else "") + f".{ext}"
    if PATTERN.fullmatch(name) is None:
        raise ValueError(f"{name!r} does not follow the results' naming pattern {PATTERN.pattern}")
    return folder / name
