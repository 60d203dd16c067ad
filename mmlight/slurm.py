"""A run under SLURM: its run directory named by the job id (a requeued job finds its checkpoints), and
task counts checked against the trainer before any process waits for another."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.plugins.environments import SLURMEnvironment


def name_slurm_run(config, subcommand: str) -> None:
    """Under SLURM, ``fit`` logs to version ``slurm-<job id>`` and uses that run directory as the
    trainer's root, where Lightning writes ``hpc_ckpt_*.ckpt``: a requeued job (same id) finds them.
    A version or root directory given by the user is kept.

    Args:
        config: the parsed config of the subcommand (changed in place).
        subcommand: ``fit``, ``validate``, ...; only ``fit`` is named.
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    logger = config.trainer.get("logger")
    if job_id and subcommand == "fit" and getattr(logger, "init_args", None) is not None:
        if logger.init_args.get("version") is None:
            logger.init_args.version = f"slurm-{job_id}"
        if config.trainer.get("default_root_dir") is None:
            config.trainer.default_root_dir = str(run_dir(logger.init_args))


def run_dir(logger_args) -> Path:
    """``save_dir/name/version`` of a TensorBoard logger's arguments."""
    save_dir, name = logger_args.get("save_dir") or ".", logger_args.get("name") or ""
    return Path(save_dir) / name / str(logger_args.get("version"))


def check_slurm_tasks(trainer) -> None:
    """Under SLURM, stop when the job's task counts do not match the trainer: Lightning would
    otherwise wait forever at "initializing distributed" for processes that never start."""
    if not SLURMEnvironment.detect():
        return
    ntasks = int(os.environ["SLURM_NTASKS"])  # detect() is true only when it is set
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
    expected = trainer.num_devices * trainer.num_nodes
    if ntasks != expected or nodes != trainer.num_nodes:
        raise SystemExit(
            f"mmlight: SLURM started {ntasks} task(s) on {nodes} node(s), but the trainer expects "
            f"devices={trainer.num_devices} x num_nodes={trainer.num_nodes} = {expected} process(es). "
            "Make --ntasks-per-node equal --trainer.devices and --nodes equal --trainer.num_nodes."
        )
