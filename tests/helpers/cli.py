"""The ``mmlight`` command as the tests run it: in a subprocess (:func:`run_mmlight`) or in-process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from mmlight.cli import main


def mmlight_argv(*args: str) -> list[str]:
    """The command line that runs ``mmlight ARGS`` with this interpreter (and so this checkout's package,
    through the inherited ``PYTHONPATH``), whether or not the console script is installed."""
    return [sys.executable, "-m", "mmlight.cli", *args]


def run_mmlight(*args: str, timeout: float = 900, **run) -> subprocess.CompletedProcess:
    """Run ``mmlight ARGS`` to the end in a subprocess and return it, its output captured as text.

    Args:
        args: the command line after ``mmlight``.
        timeout: seconds before the process is killed and ``subprocess.TimeoutExpired`` raised.
        run: any other ``subprocess.run`` argument (``cwd``, ``env``, ``check``).
    """
    return subprocess.run(mmlight_argv(*args), capture_output=True, text=True, timeout=timeout, **run)


@contextlib.contextmanager
def environment(cwd: Path, env: Mapping[str, str]) -> Iterator[None]:
    """Work in ``cwd`` with the variables of ``env`` set (the others as they are), both restored after."""
    here, before = os.getcwd(), {name: os.environ.get(name) for name in env}
    os.chdir(cwd)
    os.environ.update(env)
    try:
        yield
    finally:
        os.chdir(here)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def mmlight_in_process(*args: str, cwd: Path, env: Mapping[str, str] | None = None) -> None:
    """Run ``mmlight ARGS`` to the end by :func:`mmlight.cli.main` in this process, from ``cwd`` with
    ``env``'s variables set: a one-process run of :func:`run_mmlight` less the seconds a new interpreter
    spends importing Lightning. A command that exits with an error raises ``AssertionError``.

    Args:
        args: the command line after ``mmlight``.
        cwd: the working directory of the run.
        env: variables to set for the run (restored after).
    """
    with environment(cwd, env or {}):
        try:
            main(list(args))
        except SystemExit as stop:
            assert stop.code in (0, None), f"mmlight {args[0]} exited with status {stop.code}"


def analyze(config: Path, ckpts: list[Path], out: Path, *options: str, overrides: Sequence[str] = ()) -> None:
    """``mmlight analyze`` of ``ckpts`` trained with ``config``, written to ``out``.

    Args:
        config: the config the checkpoints were trained with.
        ckpts: the checkpoints to compare.
        out: the output folder.
        options: analysis options (``--num_samples 16``, ``--robustness``, ...).
        overrides: ``--data.*``/``--trainer.*`` options for the config's parser.
    """
    main(["analyze", "--config", str(config), *overrides, "--ckpt_path", *map(str, ckpts), "--out", str(out), *options])
