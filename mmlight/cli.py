"""The ``mmlight`` command: a LightningCLI with ``fit``, ``validate``, ``test`` and ``predict``,
plus ``mmlight prepare <dataset> --src RAW --out SHARDS`` (see :mod:`mmlight.data.prepare`).

Model and data are given in subclass mode, so a config names them by ``class_path``::

    model:
      class_path: mmlight.tasks.ImageClassifier
    data:
      class_path: mmlight.data.DigitsDataModule
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning import LightningDataModule, LightningModule
from jsonargparse import lazy_instance
from lightning.pytorch.cli import ArgsType, LightningCLI

from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.loggers import TensorBoardLogger

# Imported so that their classes are known to the parser by their short names too.
import mmlight.data  # noqa: F401
import mmlight.tasks  # noqa: F401
from mmlight.callbacks import FinalMetrics, LastCheckpoint, ReweightingMonitor, SkippedSamplesMonitor


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


class MmlightCLI(LightningCLI):
    """LightningCLI plus what a cluster run needs.

    * ``last_checkpoint`` (``last.ckpt`` every N steps and at epoch ends, written atomically) and
      ``best_checkpoint`` (best by a validation metric) are config groups of their own;
    * under SLURM the TensorBoard version is ``slurm-<job id>``, and the trainer's root directory is
      that run directory, so a requeued job (same id) finds its checkpoints there;
    * ``--ckpt_path last`` resumes from the newest of ``last.ckpt`` and Lightning's
      ``hpc_ckpt_*.ckpt`` (written on SLURM's warning signal) of any version of the run's name,
      and starts fresh when there is none;
    * SLURM task counts that disagree with ``devices x num_nodes`` stop the run at once;
    * with ``--ckpt_path``, Lightning rebuilds the model from the checkpoint's hyperparameters, which
      would silently override the command line; ``--model.*`` options given on the command line
      (e.g. ``--model.init_args.beam.beam_size 10`` for ``test``) are applied after them.
    """

    def parse_arguments(self, parser, args) -> None:
        self._argv = list(sys.argv[1:] if args is None else args) if isinstance(args, (list, tuple, type(None))) else []
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        super()._parse_ckpt_path()
        subcommand = self.config.get("subcommand")
        overrides = model_options(getattr(self, "_argv", []))
        if subcommand and overrides and self.config[subcommand].get("ckpt_path"):
            self.config = self.parser.parse_args([subcommand, *overrides], namespace=self.config)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.set_defaults({"last_checkpoint.save_last": True, "last_checkpoint.save_top_k": 0,
                             "last_checkpoint.every_n_train_steps": 1000})
        parser.add_lightning_class_args(ModelCheckpoint, "best_checkpoint")
        parser.set_defaults({"best_checkpoint.monitor": "val/top1", "best_checkpoint.mode": "max",
                             "best_checkpoint.filename": "best-{epoch}-{step}", "best_checkpoint.save_top_k": 1,
                             "best_checkpoint.auto_insert_metric_name": False})

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config)
        job_id = os.environ.get("SLURM_JOB_ID")
        logger = config.trainer.get("logger")
        if job_id and self.subcommand == "fit" and getattr(logger, "init_args", None) is not None:
            if logger.init_args.get("version") is None:
                logger.init_args.version = f"slurm-{job_id}"
            if config.trainer.get("default_root_dir") is None:  # where Lightning writes hpc_ckpt_*.ckpt
                config.trainer.default_root_dir = str(run_dir(logger.init_args))

    def before_fit(self) -> None:
        check_slurm_tasks(self.trainer)
        config = self.config[self.subcommand]
        if config.get("ckpt_path") == "last":
            config_init = self.config_init[self.subcommand]
            config_init["ckpt_path"] = newest_checkpoint(self.trainer)
            print(f"mmlight: --ckpt_path last -> {config_init['ckpt_path'] or 'no checkpoint yet, starting fresh'}")


def model_options(argv: list[str]) -> list[str]:
    """The ``--model.*`` options of a command line (``--model.x=1`` or ``--model.x 1``)."""
    picked = []
    for i, arg in enumerate(argv):
        if arg.startswith("--model."):
            picked += [arg] if "=" in arg or i + 1 == len(argv) else [arg, argv[i + 1]]
    return picked


def run_dir(logger_args) -> Path:
    """``save_dir/name/version`` of a TensorBoard logger's arguments."""
    return Path(logger_args.get("save_dir") or ".") / (logger_args.get("name") or "") / str(logger_args.get("version"))


def newest_checkpoint(trainer) -> str | None:
    """The most recently written ``last*.ckpt`` or ``hpc_ckpt_*.ckpt`` of this run's name (every
    version), or None."""
    roots = {Path(trainer.default_root_dir)}
    if trainer.logger is not None and trainer.logger.log_dir is not None:
        roots.add(Path(trainer.logger.log_dir).parent)
    found = [p for root in roots if root.is_dir() for pattern in ("**/last*.ckpt", "**/hpc_ckpt_*.ckpt")
             for p in root.glob(pattern)]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def check_slurm_tasks(trainer) -> None:
    """Under SLURM, stop when the job's task counts do not match the trainer: Lightning would
    otherwise wait forever at "initializing distributed" for processes that never start."""
    if not SLURMEnvironment.detect():
        return
    ntasks = int(os.environ.get("SLURM_NTASKS", "1"))
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
    expected = trainer.num_devices * trainer.num_nodes
    if ntasks != expected or nodes != trainer.num_nodes:
        raise SystemExit(
            f"mmlight: SLURM started {ntasks} task(s) on {nodes} node(s), but the trainer expects "
            f"devices={trainer.num_devices} x num_nodes={trainer.num_nodes} = {expected} process(es). "
            "Make --ntasks-per-node equal --trainer.devices and --nodes equal --trainer.num_nodes.")


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (``sys.argv`` by default), build model, data and trainer, and run the subcommand."""
    return MmlightCLI(
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


#: Subcommands outside LightningCLI: name -> ``module:function``, called with the remaining argv.
TOOLS: dict[str, str] = {
    "prepare": "mmlight.data.prepare:main",
    "sweep": "mmlight.experiments.sweep:main",
    "collect": "mmlight.experiments.collect:main",
}


def main(args: ArgsType = None) -> None:
    """Entry point of the ``mmlight`` console script; ``args`` lets tests call it in-process."""
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] and argv[0] in TOOLS:
        import importlib

        module, function = TOOLS[argv[0]].split(":")
        getattr(importlib.import_module(module), function)(argv[1:])
        return
    build_cli(args)


if __name__ == "__main__":
    main()
