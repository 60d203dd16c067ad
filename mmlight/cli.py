"""The ``mmlight`` command: its commands, each with ``--help``.

``fit``, ``validate``, ``test`` and ``predict`` are the LightningCLI of :mod:`mmlight.lightning_cli`;
``prepare``, ``analyze``, ``sweep``, ``collect``, ``export`` and ``doctor`` are the modules of
:mod:`mmlight.commands` (:data:`TOOLS`), imported only when named. ``mmlight --help`` lists them all; a
misspelt command stops with the nearest name, exit status 2, before anything runs.

Lightning (and, through torchmetrics, whatever it finds installed: transformers, scipy) is imported for
the trainer commands, the help and ``analyze``, not for the light commands: ``mmlight sweep --print``,
``mmlight collect`` and ``mmlight prepare`` of any dataset but the quick start's digits (written through
its DataModule's module) start without the several seconds of CPU that importing Lightning takes.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, NamedTuple, NoReturn

if TYPE_CHECKING:
    from lightning.pytorch.cli import ArgsType, LightningCLI


class Tool(NamedTuple):
    """A command outside LightningCLI."""

    target: str  #: ``module:function``, called with the rest of the command line
    summary: str  #: the line ``mmlight --help`` shows (``{datasets}``: the names ``mmlight prepare`` takes)


TOOLS: dict[str, Tool] = {
    "prepare": Tool(
        "mmlight.commands.prepare:main",
        "write a dataset's raw files as webdataset shards ({datasets})",
    ),
    "analyze": Tool(
        "mmlight.commands.analyze:main",
        "attention statistics, figures and robustness of checkpoints on a config's data",
    ),
    "sweep": Tool("mmlight.commands.sweep:main", "run the cells and seeds of an experiment table"),
    "collect": Tool("mmlight.commands.collect:main", "gather a table's final metrics into one results file"),
    "export": Tool("mmlight.commands.export:main", "write a Llama-style LM checkpoint as a transformers model folder"),
    "doctor": Tool(
        "mmlight.commands.doctor:main", "check the GPU, the Triton kernels and the image decoder on this machine"
    ),
}


def commands() -> dict[str, str]:
    """Every command, in the order ``mmlight --help`` lists them -> its one line."""
    from mmlight.data.prepare import DATASETS
    from mmlight.lightning_cli import TRAINER_COMMANDS

    datasets = ", ".join(DATASETS)
    return {**TRAINER_COMMANDS, **{name: tool.summary.format(datasets=datasets) for name, tool in TOOLS.items()}}


def build_cli(args: ArgsType, **options) -> LightningCLI:
    """The LightningCLI of ``fit``, ``validate``, ``test`` and ``predict``: :func:`mmlight.lightning_cli.build_cli`
    with the same arguments, imported here so that the other commands do not pay for importing Lightning."""
    from mmlight.lightning_cli import build_cli as build

    return build(args, **options)


def overview() -> str:
    """The text of ``mmlight --help``."""
    width = max(map(len, commands()))
    lines = [f"  {name:<{width}}  {summary}" for name, summary in commands().items()]
    return "\n".join(
        [
            "usage: mmlight [-c CONFIG] COMMAND [options]",
            "",
            "Attention reweighting (softmax, MultiMax, sparsemax, ...) as a PyTorch Lightning application.",
            "",
            "commands:",
            *lines,
            "",
            "`mmlight COMMAND --help` shows a command's options. -c/--config and --print_config may also come",
            "before fit, validate, test or predict, as in LightningCLI.",
        ]
    )


def nearest(word: str, names: list[str]) -> str:
    """The name with the fewest single-character insertions, deletions and substitutions from ``word``
    (the first such name on a tie)."""
    return min(names, key=lambda name: edit_distance(word, name))


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between ``a`` and ``b``, one row of the table at a time."""
    row = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        previous, row[0] = row[0], i
        for j, char_b in enumerate(b, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (char_a != char_b))
    return row[-1]


def unknown_command(word: str) -> NoReturn:
    """Stop (exit status 2) naming the nearest command; nothing has run."""
    sys.stderr.write(
        f"mmlight: unknown command {word!r}; did you mean {nearest(word, list(commands()))!r}?\n"
        "Run `mmlight --help` for the list of commands.\n"
    )
    raise SystemExit(2)


def main(args: ArgsType = None) -> None:
    """Entry point of the ``mmlight`` console script; ``args`` lets tests call it in-process."""
    argv = sys.argv[1:] if args is None else args
    is_list = isinstance(argv, (list, tuple))  # LightningCLI also takes a dict or a Namespace of arguments
    command = argv[0] if is_list and argv else None
    if command in TOOLS:
        module, function = TOOLS[command].target.split(":")
        getattr(importlib.import_module(module), function)(list(argv[1:]))
        return
    if command in ("-h", "--help"):
        print(overview())
        raise SystemExit(0)
    if is_list and not argv:
        print(overview(), file=sys.stderr)
        raise SystemExit(2)
    if command and not command.startswith("-") and command not in commands():
        unknown_command(command)  # options first (-c CONFIG fit) are LightningCLI's to read
    build_cli(args)
    close_process_group()


def close_process_group() -> None:
    """Destroy the DDP process group before the interpreter exits. Lightning leaves it open, and
    gloo's threads torn down at exit can abort a finished rank ("terminate called without an
    active exception"), which SLURM then reports as a failed job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
