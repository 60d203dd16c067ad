"""The LightningCLI of ``mmlight fit``, ``validate``, ``test`` and ``predict``: config groups, defaults,
the data sizes linked into the model, and the checks a cluster run needs before any work.

Model and data are given in subclass mode, so a config names them by ``class_path``::

    model:
      class_path: mmlight.tasks.ImageClassifier
    data:
      class_path: mmlight.data.DigitsDataModule

:func:`build_cli` is what the ``mmlight`` command (:mod:`mmlight.cli`) runs for these four commands, and
what ``mmlight analyze`` uses to build a config's model and data without running them.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import typing

from jsonargparse import Namespace
from lightning import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningCLI

# Imported so that their classes are known to the parser by their short names too.
import mmlight.data
import mmlight.tasks  # noqa: F401
from mmlight.callbacks import (
    DataPosition,
    DataWaitMonitor,
    FinalMetrics,
    LastCheckpoint,
    ReweightingMonitor,
    SkippedSamplesMonitor,
    SlurmRequeue,
    StepProgressBar,
    StepSeed,
    Throughput,
)
from mmlight.ckpt_path import check_checkpoint_file, newest_checkpoint
from mmlight.reweighting import available as available_reweightings
from mmlight.safe_load import RefusedFile, raised_from
from mmlight.slurm import check_slurm_tasks, name_slurm_run

mmlight.data.load_all()  # the package imports its DataModules on first use only (for `mmlight prepare`)

#: The Trainer's commands, each with the line ``mmlight --help`` and ``mmlight COMMAND --help`` show.
TRAINER_COMMANDS = {
    "fit": "train a model from a config (task, data, trainer); --ckpt_path last resumes",
    "validate": "evaluate a model on the validation split",
    "test": "evaluate a model on the test split",
    "predict": "run a model's predictions (e.g. the translator's hypotheses)",
}


def trainer_defaults() -> dict:
    """Defaults a config can override: TensorBoard under ``runs/``, a rich progress bar (steps out of
    ``max_steps`` in step-limited runs), the learning rate per step, MultiMax parameters and curves,
    the count of skipped corrupt samples, a one-time warning when the step waits on the data loader,
    the final metrics printed, samples/s, tokens/s and MFU (:class:`~mmlight.callbacks.Throughput`),
    the per-step seeding of dropout and mixup
    (:class:`~mmlight.callbacks.StepSeed`), the data position restored on resume
    (:class:`~mmlight.callbacks.DataPosition`), and under SLURM the checkpoint of the warning signal
    written at the end of a step (:class:`~mmlight.callbacks.SlurmRequeue`)."""
    # Built anew for each CLI: the callbacks go to the Trainer as they are (LightningCLI adds
    # ``trainer_defaults["callbacks"]`` to the config's), and the logger is a parser default, written as the
    # class path and arguments a config gives. (jsonargparse's ``lazy_instance`` would defer the same
    # construction, but it reads the calling module from ``inspect.stack()``: about 0.2 s a call under a
    # deep stack such as pytest's, 2.4 s for every CLI the tests build.)
    return {
        "logger": {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": "runs", "name": "mmlight"},
        },
        "callbacks": [
            StepProgressBar(),
            LearningRateMonitor(logging_interval="step"),
            ReweightingMonitor(),
            SkippedSamplesMonitor(),
            DataWaitMonitor(),
            FinalMetrics(),
            StepSeed(),
            DataPosition(),
            Throughput(),
            SlurmRequeue(),
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
    * a ``--ckpt_path`` file that is missing or not a Lightning checkpoint stops the run at once,
      naming the file;
    * SLURM task counts that disagree with ``devices x num_nodes`` stop the run at once;
    * with ``--ckpt_path``, Lightning rebuilds the model from the checkpoint's hyperparameters, which
      would silently override the command line; ``--model.*`` options given on the command line
      (e.g. ``--model.init_args.beam.beam_size 10`` for ``test``) are applied after them;
    * sizes the data defines are linked into the model when the data is instantiated (see
      :data:`DATA_SIZES`), so a config works on any prepared data without editing.
    """

    def parse_arguments(self, parser, args) -> None:
        self._argv = list(sys.argv[1:] if args is None else args) if isinstance(args, (list, tuple, type(None))) else []
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        if subcommand:
            check_checkpoint_file(self.config[subcommand].get("ckpt_path"))
        super()._parse_ckpt_path()
        subcommand = self.config.get("subcommand")
        overrides = model_options(self._argv)  # parse_arguments ran first: LightningCLI.__init__ calls it
        if subcommand and overrides and self.config[subcommand].get("ckpt_path"):
            self.config = self.parser.parse_args([subcommand, *overrides], namespace=self.config)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(LastCheckpoint, "last_checkpoint")
        parser.set_defaults(
            {
                "last_checkpoint.save_last": True,
                "last_checkpoint.save_top_k": 0,
                "last_checkpoint.every_n_train_steps": 1000,
            }
        )
        parser.add_lightning_class_args(ModelCheckpoint, "best_checkpoint")
        parser.set_defaults(
            {
                "best_checkpoint.monitor": "val/top1",
                "best_checkpoint.mode": "max",
                "best_checkpoint.filename": "best-{epoch}-{step}",
                "best_checkpoint.save_top_k": 1,
                "best_checkpoint.auto_insert_metric_name": False,
            }
        )
        for data_attribute, model_key in DATA_SIZES.items():
            # skipped when the DataModule has no such attribute (missing_data_sizes checks it is not needed)
            parser.link_arguments(
                f"data.{data_attribute}", f"model.init_args.model.{model_key}", apply_on="instantiate"
            )

    def instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config)
        given = config.get("model.init_args.model") or {}  # before the links replace them
        defaults = model_config_defaults(_import(config.model.class_path))
        try:
            super().instantiate_classes()
        except FileNotFoundError as err:  # e.g. data not prepared yet: the size links read it
            self.parser.error(str(err))
        except ValueError as err:  # jsonargparse reports a refused pretrained file inside its own error
            refused = raised_from(err, RefusedFile)
            if refused is None:
                raise
            self.parser.error(str(refused))
        for data_attribute, model_key in DATA_SIZES.items():
            value, linked = given.get(model_key), getattr(self.datamodule, data_attribute, None)
            # the parsed config holds the dataclass default where nothing was given: not worth a word
            if value is not None and value != defaults.get(model_key) and linked is not None and value != linked:
                print(
                    f"mmlight: model.{model_key}={value} was given, but the size is linked from the "
                    f"data: {model_key}={linked} is used"
                )

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config)
        for key, name in reweighting_names(config.model):
            if name not in available_reweightings():
                self.parser.error(
                    f"model.{key}: unknown reweighting {name!r}; choose one of {available_reweightings()}"
                )
        missing = missing_data_sizes(_import(config.model.class_path), _import(config.data.class_path))
        if missing:
            self.parser.error(
                f"{config.model.class_path} takes {', '.join(missing)} from its DataModule, but "
                f"{config.data.class_path} has no such attribute"
            )
        name_slurm_run(config, self.subcommand)

    def before_fit(self) -> None:
        check_slurm_tasks(self.trainer)
        config = self.config[self.subcommand]
        if config.get("ckpt_path") == "last":
            config_init = self.config_init[self.subcommand]
            config_init["ckpt_path"] = newest_checkpoint(self.trainer)
            check_checkpoint_file(config_init["ckpt_path"])
            print(f"mmlight: --ckpt_path last -> {config_init['ckpt_path'] or 'no checkpoint yet, starting fresh'}")


#: DataModule attribute -> the model config key it sets (``model.init_args.model.<key>``), read once the
#: DataModule exists. A link is skipped when the DataModule has no such attribute or the task's model
#: config no such key, so each task takes the sizes it has: the LM and the translator the vocabulary,
#: the image classifier the class count.
DATA_SIZES = {"vocab_size": "vocab_size", "num_classes": "num_classes"}


def model_config_class(model_class: type) -> type | None:
    """The dataclass type of ``model_class``'s ``model`` argument, or None for a task without one."""
    config_class = typing.get_type_hints(model_class.__init__).get("model")
    return config_class if dataclasses.is_dataclass(config_class) else None


def model_config_defaults(model_class: type) -> dict:
    """Field name -> default of ``model_class``'s ``model`` config (fields without one left out)."""
    config_class = model_config_class(model_class)
    fields = dataclasses.fields(config_class) if config_class else ()
    return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


def missing_data_sizes(model_class: type, data_class: type) -> list[str]:
    """The :data:`DATA_SIZES` attributes that ``model_class``'s ``model`` config needs and
    ``data_class`` does not define."""
    config_class = model_config_class(model_class)
    keys = {f.name for f in dataclasses.fields(config_class)} if config_class else set()
    return [attr for attr, key in DATA_SIZES.items() if key in keys and not hasattr(data_class, attr)]


def _import(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def reweighting_names(config, prefix: str = "") -> list[tuple[str, str]]:
    """``(key, name)`` of every reweighting spec (a ``{name, options}`` entry) in a parsed config,
    so that a misspelt function stops the run at parse time, naming its key."""
    found = []
    for key, value in _entries(config).items():
        fields = _entries(value)
        if set(fields) == {"name", "options"}:
            found.append((f"{prefix}{key}.name", fields["name"]))
        elif fields:
            found += reweighting_names(value, f"{prefix}{key}.")
    return found


def _entries(value) -> dict:
    """The keys of a config node (a jsonargparse Namespace or a dict); {} for a leaf."""
    return vars(value) if isinstance(value, Namespace) else value if isinstance(value, dict) else {}


def model_options(argv: list[str]) -> list[str]:
    """The ``--model.*`` options of a command line (``--model.x=1`` or ``--model.x 1``)."""
    picked = []
    for i, arg in enumerate(argv):
        if arg.startswith("--model."):
            picked += [arg] if "=" in arg or i + 1 == len(argv) else [arg, argv[i + 1]]
    return picked


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (``sys.argv`` by default), build model, data and trainer, and run the subcommand."""
    return MmlightCLI(
        model_class=LightningModule,
        datamodule_class=LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},  # a requeued job rewrites its config.yaml
        parser_kwargs={name: {"description": summary} for name, summary in TRAINER_COMMANDS.items()},
        trainer_defaults=trainer_defaults(),
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )
