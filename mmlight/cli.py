"""The ``mmlight`` command: a LightningCLI with ``fit``, ``validate``, ``test`` and ``predict``,
plus ``mmlight prepare <dataset> --src RAW --out SHARDS`` (see :mod:`mmlight.data.prepare`).

Model and data are given in subclass mode, so a config names them by ``class_path``::

    model:
      class_path: mmlight.tasks.ImageClassifier
    data:
      class_path: mmlight.data.DigitsDataModule
"""

from __future__ import annotations

import sys

from lightning import LightningDataModule, LightningModule
from jsonargparse import lazy_instance
from lightning.pytorch.cli import ArgsType, LightningCLI

from lightning.pytorch.callbacks import LearningRateMonitor, RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

# Imported so that their classes are known to the parser by their short names too.
import mmlight.data  # noqa: F401
import mmlight.tasks  # noqa: F401
from mmlight.callbacks import FinalMetrics, ReweightingMonitor, SkippedSamplesMonitor


def trainer_defaults() -> dict:
    """Defaults a config can override: TensorBoard under ``runs/``, a rich progress bar, the
    learning rate per step, MultiMax parameters and curves, the count of skipped corrupt samples,
    and the final metrics printed."""
    return {
        "logger": lazy_instance(TensorBoardLogger, save_dir="runs", name="mmlight"),
        "callbacks": [
            lazy_instance(RichProgressBar),
            lazy_instance(LearningRateMonitor, logging_interval="step"),
            lazy_instance(ReweightingMonitor),
            lazy_instance(SkippedSamplesMonitor),
            lazy_instance(FinalMetrics),
        ],
    }


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (``sys.argv`` by default), build model, data and trainer, and run the subcommand."""
    return LightningCLI(
        model_class=LightningModule,
        datamodule_class=LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},  # a requeued job rewrites its config.yaml
        trainer_defaults=trainer_defaults(),
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of the ``mmlight`` console script; ``args`` lets tests call it in-process."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == ["prepare"]:
        from mmlight.data.prepare import main as prepare_main

        prepare_main(argv[1:])
        return
    build_cli(args)


if __name__ == "__main__":
    main()
