"""The `mmlight` command without a cluster or a training run: the commands, their help and the
nearest name for a misspelt one; which checkpoint ``--ckpt_path last`` resumes (files with set modification
times), the SLURM run directory (SLURM's environment variables), the task-count check and the checkpoint
defaults."""

import functools
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import LearningRateMonitor

from mmlight import ckpt_path, cli, lightning_cli
from mmlight.callbacks import (
    DataPosition,
    DataWaitMonitor,
    FinalMetrics,
    ReweightingMonitor,
    SkippedSamplesMonitor,
    SlurmRequeue,
    StepProgressBar,
    StepSeed,
    Throughput,
)
from mmlight.slurm import check_slurm_tasks, name_slurm_run, run_dir

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "quickstart" / "digits_multimax.yaml"


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    """Start every test outside SLURM, whatever the machine running the tests."""
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(sys, "argv", ["mmlight"])


def touch(path: Path, mtime: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    os.utime(path, (mtime, mtime))
    return path


def trainer_at(root: Path, log_dir: Path | None = None, **more) -> SimpleNamespace:
    logger = None if log_dir is None else SimpleNamespace(log_dir=str(log_dir))
    return SimpleNamespace(default_root_dir=str(root), logger=logger, **more)


def test_newest_checkpoint_is_the_most_recently_written_of_any_version(tmp_path):
    run = tmp_path / "runs" / "digits"
    touch(run / "version_0" / "checkpoints" / "last.ckpt", 1000)
    newest = touch(run / "version_1" / "checkpoints" / "last.ckpt", 3000)
    touch(run / "version_1" / "checkpoints" / "last-v1.ckpt", 2000)
    touch(run / "version_2" / "checkpoints" / "best-0-5.ckpt", 9000)  # not a resume point
    touch(run / "version_2" / "checkpoints" / "epoch=0.ckpt", 9000)
    trainer = trainer_at(tmp_path / "elsewhere", log_dir=run / "version_3")  # the new run's version
    assert ckpt_path.newest_checkpoint(trainer) == str(newest)
    # Lightning's hpc_ckpt_*.ckpt (SLURM's warning signal) in the root directory, once it is newer
    hpc = touch(tmp_path / "elsewhere" / "hpc_ckpt_2.ckpt", 2500)
    assert ckpt_path.newest_checkpoint(trainer) == str(newest)
    os.utime(hpc, (4000, 4000))
    assert ckpt_path.newest_checkpoint(trainer) == str(hpc)
    os.utime(run / "version_0" / "checkpoints" / "last.ckpt", (5000, 5000))  # oldest name, newest file
    assert ckpt_path.newest_checkpoint(trainer) == str(run / "version_0" / "checkpoints" / "last.ckpt")


def test_newest_checkpoint_never_takes_another_runs_checkpoint_under_the_root(tmp_path):
    """The root directory defaults to the working directory: with a logger, another run's
    last.ckpt below it is not a resume point of this run, while Lightning's hpc_ckpt in it is."""
    other = touch(tmp_path / "runs" / "other_run" / "version_0" / "checkpoints" / "last.ckpt", 9000)
    mine = touch(tmp_path / "runs" / "mine" / "version_0" / "checkpoints" / "last.ckpt", 1000)
    trainer = trainer_at(tmp_path, log_dir=tmp_path / "runs" / "mine" / "version_1")
    assert ckpt_path.newest_checkpoint(trainer) == str(mine)
    touch(tmp_path / "sub" / "hpc_ckpt_3.ckpt", 9500)  # not written by Lightning for this root
    assert ckpt_path.newest_checkpoint(trainer) == str(mine)
    hpc = touch(tmp_path / "hpc_ckpt_1.ckpt", 2000)
    assert ckpt_path.newest_checkpoint(trainer) == str(hpc)
    assert ckpt_path.newest_checkpoint(trainer_at(tmp_path)) == str(
        other.parent.parent.parent.parent.parent / "sub" / "hpc_ckpt_3.ckpt"
    )


def test_newest_checkpoint_searches_the_root_without_a_logger_and_finds_none_in_an_empty_run(tmp_path):
    assert ckpt_path.newest_checkpoint(trainer_at(tmp_path / "missing")) is None
    assert ckpt_path.newest_checkpoint(trainer_at(tmp_path, log_dir=tmp_path / "runs" / "x" / "version_0")) is None
    hpc = touch(tmp_path / "slurm-9" / "hpc_ckpt_1.ckpt", 100)
    assert ckpt_path.newest_checkpoint(trainer_at(tmp_path)) == str(hpc)
    assert ckpt_path.newest_checkpoint(
        SimpleNamespace(default_root_dir=str(tmp_path), logger=SimpleNamespace(log_dir=None))
    ) == str(hpc)


def test_before_fit_resumes_the_newest_checkpoint_for_ckpt_path_last(tmp_path, capsys):
    def fit(ckpt_path):
        stand_in = SimpleNamespace(
            trainer=trainer_at(tmp_path, num_devices=1, num_nodes=1),
            subcommand="fit",
            config={"fit": {"ckpt_path": ckpt_path}},
            config_init={"fit": {"ckpt_path": ckpt_path}},
        )
        lightning_cli.MmlightCLI.before_fit(stand_in)
        return stand_in.config_init["fit"]["ckpt_path"], capsys.readouterr().out

    assert fit("last") == (None, "mmlight: --ckpt_path last -> no checkpoint yet, starting fresh\n")
    for version, mtime in (("v0", 100), ("v1", 200)):  # real checkpoint files: before_fit checks what it resumes
        newest = tmp_path / version / "last.ckpt"
        newest.parent.mkdir()
        torch.save({"state_dict": {}}, newest)
        os.utime(newest, (mtime, mtime))
    assert fit("last") == (str(newest), f"mmlight: --ckpt_path last -> {newest}\n")
    assert fit("given.ckpt") == ("given.ckpt", "")  # an explicit path is left alone
    broken = tmp_path / "v2" / "last.ckpt"  # the newest resume point is unreadable: stop, naming it
    broken.parent.mkdir()
    broken.write_text("half a file")
    with pytest.raises(SystemExit, match=f"--ckpt_path {broken} is not a Lightning checkpoint"):
        fit("last")


def slurm(monkeypatch, ntasks: str, nodes: str | None, job_name: str = "train", nodes_var="SLURM_JOB_NUM_NODES"):
    monkeypatch.setenv("SLURM_NTASKS", ntasks)
    monkeypatch.setenv("SLURM_JOB_NAME", job_name)
    if nodes is not None:
        monkeypatch.setenv(nodes_var, nodes)


@pytest.mark.parametrize(
    "ntasks, nodes, nodes_var, devices, num_nodes",
    [
        ("4", "2", "SLURM_JOB_NUM_NODES", 2, 2),
        ("4", "2", "SLURM_NNODES", 2, 2),  # older SLURM names the node count so
        ("3", None, None, 3, 1),  # one node when SLURM does not say
    ],
)
def test_matching_slurm_task_counts_pass(monkeypatch, ntasks, nodes, nodes_var, devices, num_nodes):
    slurm(monkeypatch, ntasks, nodes, nodes_var=nodes_var)
    check_slurm_tasks(SimpleNamespace(num_devices=devices, num_nodes=num_nodes))


@pytest.mark.parametrize(
    "ntasks, nodes, devices, num_nodes, said",
    [
        ("3", "2", 2, 2, "3 task(s) on 2 node(s), but the trainer expects devices=2 x num_nodes=2 = 4 process(es)"),
        ("4", "1", 2, 2, "4 task(s) on 1 node(s), but the trainer expects devices=2 x num_nodes=2 = 4 process(es)"),
        ("1", None, 2, 1, "1 task(s) on 1 node(s), but the trainer expects devices=2 x num_nodes=1 = 2 process(es)"),
    ],
)
def test_mismatched_slurm_task_counts_stop_the_run(monkeypatch, ntasks, nodes, devices, num_nodes, said):
    slurm(monkeypatch, ntasks, nodes)
    with pytest.raises(SystemExit) as exit_info:
        check_slurm_tasks(SimpleNamespace(num_devices=devices, num_nodes=num_nodes))
    assert str(exit_info.value) == (
        f"mmlight: SLURM started {said}. Make --ntasks-per-node equal --trainer.devices "
        "and --nodes equal --trainer.num_nodes."
    )
    monkeypatch.setenv("SLURM_NNODES", "7")  # SLURM_JOB_NUM_NODES wins over the older name
    if nodes is not None:
        with pytest.raises(SystemExit, match=f"on {nodes} node"):
            check_slurm_tasks(SimpleNamespace(num_devices=devices, num_nodes=num_nodes))


def test_no_task_check_outside_slurm_or_in_an_interactive_allocation(monkeypatch):
    wrong = SimpleNamespace(num_devices=8, num_nodes=4)
    check_slurm_tasks(wrong)  # no SLURM variables at all
    slurm(monkeypatch, "1", "1", job_name="interactive")  # Lightning does not take this for a SLURM launch
    check_slurm_tasks(wrong)


def fit_config(version=None, default_root_dir=None, logger=True) -> Namespace:
    init_args = Namespace(save_dir="runs", name="digits_multimax", version=version)
    tb = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=init_args) if logger else False
    return Namespace(fit=Namespace(trainer=Namespace(logger=tb, default_root_dir=default_root_dir)))


def instantiate(config: Namespace, subcommand: str = "fit") -> Namespace:
    name_slurm_run(config[subcommand], subcommand)
    return config[subcommand].trainer


def test_slurm_run_directory_is_named_by_the_job_id(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    trainer = instantiate(fit_config())
    assert trainer.logger.init_args.version == "slurm-4242"
    assert Path(trainer.default_root_dir) == Path("runs/digits_multimax/slurm-4242")
    trainer = instantiate(fit_config(version="mine"))  # a version given by the user is kept
    assert trainer.logger.init_args.version == "mine"
    assert Path(trainer.default_root_dir) == Path("runs/digits_multimax/mine")
    trainer = instantiate(fit_config(default_root_dir="/scratch/run"))
    assert (trainer.logger.init_args.version, trainer.default_root_dir) == ("slurm-4242", "/scratch/run")
    assert instantiate(fit_config(logger=False)).default_root_dir is None  # no logger: nothing to name
    config = fit_config()
    config["test"] = config.pop("fit")
    assert instantiate(config, "test").logger.init_args.version is None  # only fit writes a run


def test_no_run_directory_outside_slurm():
    trainer = instantiate(fit_config())
    assert trainer.logger.init_args.version is None and trainer.default_root_dir is None


def test_run_dir_of_logger_arguments():
    assert run_dir({"save_dir": "runs", "name": "lm", "version": "slurm-1"}) == Path("runs/lm/slurm-1")
    assert run_dir({"save_dir": None, "name": None, "version": 3}) == Path("3")


def test_model_options_of_a_command_line_edges():
    assert lightning_cli.model_options([]) == []
    assert lightning_cli.model_options(["fit", "--model.init_args.lr"]) == ["--model.init_args.lr"]  # last, no value
    assert lightning_cli.model_options(["--model.a=1", "--model.b", "2", "--data.c", "3"]) == [
        "--model.a=1",
        "--model.b",
        "2",
    ]


CALLS = []


def record_tool(argv):
    CALLS.append(argv)


def test_tools_table_dispatches_the_rest_of_the_command_line(monkeypatch):
    monkeypatch.setitem(cli.TOOLS, "probe", cli.Tool("tests.test_cli_units:record_tool", "a probe"))
    CALLS.clear()
    cli.main(["probe", "--src", "raw", "x"])
    assert CALLS == [["--src", "raw", "x"]]
    from mmlight.commands.prepare import main as prepare_main

    module, function = cli.TOOLS["prepare"].target.split(":")
    assert getattr(__import__(module, fromlist=[function]), function) is prepare_main


def test_trainer_defaults():
    defaults = lightning_cli.trainer_defaults()
    logger = defaults["logger"]
    assert logger == {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "mmlight"},
    }
    callbacks = defaults["callbacks"]
    kinds = [
        StepProgressBar,
        LearningRateMonitor,
        ReweightingMonitor,
        SkippedSamplesMonitor,
        DataWaitMonitor,
        FinalMetrics,
        StepSeed,
        DataPosition,
        Throughput,
        SlurmRequeue,
    ]
    assert [type(c) for c in callbacks] == kinds
    assert callbacks[1].logging_interval == "step"
    assert all(a is not b for a, b in zip(callbacks, lightning_cli.trainer_defaults()["callbacks"]))  # fresh each time


def test_checkpoint_groups_and_their_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(DIGITS), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    last, best = printed["last_checkpoint"], printed["best_checkpoint"]
    assert (last["save_last"], last["save_top_k"], last["every_n_train_steps"]) == (True, 0, 1000)
    assert (best["monitor"], best["mode"], best["filename"], best["save_top_k"]) == (
        "val/top1",
        "max",
        "best-{epoch}-{step}",
        1,
    )
    assert best["auto_insert_metric_name"] is False
    assert printed["seed_everything"] == 0


@pytest.fixture
def parse_only(monkeypatch):
    """build_cli that parses (and runs the hooks before instantiation) but builds and runs nothing."""
    monkeypatch.setattr(lightning_cli.MmlightCLI, "instantiate_classes", lambda self: None)
    monkeypatch.setattr(lightning_cli.MmlightCLI, "after_instantiate_classes", lambda self: None)
    monkeypatch.setattr(lightning_cli.MmlightCLI, "_run_subcommand", lambda self, subcommand: None)
    return lambda args: lightning_cli.build_cli(args)


def test_model_options_on_the_command_line_win_over_the_checkpoint(tmp_path, parse_only, monkeypatch):
    import torch

    ckpt = tmp_path / "model.ckpt"
    torch.save(
        {
            "state_dict": {},
            "hyper_parameters": {"_class_path": "mmlight.tasks.ImageClassifier", "lr": 0.125, "warmup_epochs": 7.0},
        },
        ckpt,
    )
    common = ["validate", "--config", str(DIGITS), "--ckpt_path", str(ckpt)]
    model = parse_only(common).config.validate.model.init_args
    assert (model.lr, model.warmup_epochs) == (0.125, 7.0)  # Lightning restores the checkpoint's
    model = parse_only([*common, "--model.init_args.lr", "0.5"]).config.validate.model.init_args
    assert (model.lr, model.warmup_epochs) == (0.5, 7.0)  # the command line wins where it speaks
    model = parse_only([*common, "--model.init_args.lr=0.25"]).config.validate.model.init_args
    assert model.lr == 0.25
    model = parse_only(tuple([*common, "--model.init_args.lr", "0.75"])).config.validate.model.init_args
    assert model.lr == 0.75
    monkeypatch.setattr(sys, "argv", ["mmlight", *common, "--model.init_args.lr", "0.5"])  # the console script
    assert parse_only(None).config.validate.model.init_args.lr == 0.5


def test_slurm_job_names_the_parsed_fit_run(monkeypatch, parse_only):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    trainer = parse_only(["fit", "--config", str(DIGITS)]).config.fit.trainer
    assert trainer.logger.init_args.version == "slurm-77"
    assert Path(trainer.default_root_dir) == Path(trainer.logger.init_args.save_dir) / "digits_multimax" / "slurm-77"


def test_how_the_cli_is_built(parse_only):
    built = parse_only(["fit", "--config", str(DIGITS)])
    assert built.save_config_kwargs == {"overwrite": True}  # a requeued job rewrites its config.yaml
    assert built.auto_configure_optimizers is False and built.seed_everything_default == 0
    assert built.subcommand == "fit" and built.config.fit.model.class_path == "mmlight.tasks.ImageClassifier"
    callbacks = built.trainer_defaults["callbacks"]  # given to the Trainer when it is built
    assert [type(c).__name__ for c in callbacks] == [
        type(c).__name__ for c in lightning_cli.trainer_defaults()["callbacks"]
    ]
    assert built.trainer_defaults["logger"]["class_path"] == "lightning.pytorch.loggers.TensorBoardLogger"


def test_main_reads_sys_argv(monkeypatch):
    monkeypatch.setitem(cli.TOOLS, "probe", cli.Tool("tests.test_cli_units:record_tool", "a probe"))
    monkeypatch.setattr(sys, "argv", ["mmlight", "probe", "--x", "1"])
    CALLS.clear()
    cli.main()
    assert CALLS == [["--x", "1"]]


def test_before_fit_checks_the_slurm_task_counts(tmp_path, monkeypatch):
    slurm(monkeypatch, "1", "1")
    stand_in = SimpleNamespace(
        trainer=trainer_at(tmp_path, num_devices=2, num_nodes=1),
        subcommand="fit",
        config={"fit": {"ckpt_path": None}},
        config_init={"fit": {"ckpt_path": None}},
    )
    with pytest.raises(SystemExit, match="SLURM started 1 task"):
        lightning_cli.MmlightCLI.before_fit(stand_in)


def test_without_a_subcommand_the_whole_config_is_the_subcommands(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setattr(lightning_cli.MmlightCLI, "instantiate_classes", lambda self: None)
    monkeypatch.setattr(lightning_cli.MmlightCLI, "after_instantiate_classes", lambda self: None)
    built = lightning_cli.build_cli(["--config", str(DIGITS)], run=False)  # LightningCLI(run=False): no subcommand
    assert built.subcommand is None
    assert built.config.trainer.logger.init_args.version is None  # only fit names a run


def test_main_closes_the_process_group_the_run_opened(monkeypatch):
    """A DDP process group left open at exit can abort a finished rank: main destroys it after the run
    (a single-process gloo group stands in for the one Lightning opens)."""
    import torch.distributed as dist

    opened = []

    def run(args):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        opened.append(dist.is_initialized())

    monkeypatch.setattr(cli, "build_cli", run)
    cli.main(["fit"])
    assert opened == [True] and not dist.is_initialized()
    cli.close_process_group()  # without a group: nothing to do, no error


class NotAWeight:
    """A pickled object that ``torch.load(weights_only=True)`` refuses to build."""


@pytest.mark.parametrize(
    "path",
    [
        None,
        "",
        "last",
        "best",
        "hpc",
        "registry",
        "registry:me/model:latest",
        "s3://bucket/run/last.ckpt",
        "https://host/last.ckpt",
    ],
)
def test_check_checkpoint_file_leaves_special_values_and_urls_to_lightning(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # none of these names a file here
    assert ckpt_path.check_checkpoint_file(path) is None


def test_check_checkpoint_file_stops_on_a_missing_file_or_a_folder(tmp_path):
    for path in (tmp_path / "none.ckpt", tmp_path):
        with pytest.raises(SystemExit) as stop:
            ckpt_path.check_checkpoint_file(str(path))
        assert str(stop.value) == f"mmlight: --ckpt_path {path}: no such file"


def test_check_checkpoint_file_stops_on_files_that_are_not_lightning_checkpoints(tmp_path):
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(SystemExit) as stop:
        ckpt_path.check_checkpoint_file(str(text))
    said = str(stop.value)
    assert said.startswith(f"mmlight: --ckpt_path {text} is not a Lightning checkpoint (torch.load cannot read it: ")
    assert "\n" not in said
    unsafe = tmp_path / "unsafe.ckpt"  # loadable only by unpickling arbitrary objects
    torch.save({"state_dict": {}, "extra": NotAWeight()}, unsafe)
    with pytest.raises(SystemExit, match="cannot read it: UnpicklingError"):
        ckpt_path.check_checkpoint_file(str(unsafe))
    for name, content in (("weights.pt", {"weight": torch.zeros(2)}), ("list.pt", [torch.zeros(2)])):
        torch.save(content, tmp_path / name)
        with pytest.raises(SystemExit) as stop:
            ckpt_path.check_checkpoint_file(str(tmp_path / name))
        assert str(stop.value) == (
            f"mmlight: --ckpt_path {tmp_path / name} is not a Lightning checkpoint "
            "(a torch file without the 'state_dict' entry Lightning writes)"
        )


def test_check_checkpoint_file_quotes_the_first_line_of_the_error_cut_at_200_characters(tmp_path, monkeypatch):
    path = tmp_path / "x.ckpt"
    path.write_bytes(b"x")
    monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(ValueError("e" * 300 + "\nsecond line")))
    with pytest.raises(SystemExit) as stop:
        ckpt_path.check_checkpoint_file(str(path))
    assert str(stop.value).endswith(f"(torch.load cannot read it: ValueError: {'e' * 200})")


def test_check_checkpoint_file_accepts_a_checkpoint_and_reads_no_tensor(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(3)}, "epoch": 1}, path)
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k))
    assert ckpt_path.check_checkpoint_file(str(path)) is None
    assert calls == [{"map_location": "cpu", "weights_only": True, "mmap": True}]  # mapped, on the CPU, no pickles


LM = ROOT / "configs" / "quickstart" / "lm_multimax.yaml"


def instantiated(args, capsys):
    """The CLI with its classes built (no subcommand, no logger), and what it printed."""
    built = lightning_cli.build_cli([*args, "--trainer.logger", "false"], run=False)
    return built, capsys.readouterr().out


def test_sizes_linked_from_the_data_win_and_only_a_given_different_size_is_reported(capsys, monkeypatch):
    built, said = instantiated(["--config", str(DIGITS)], capsys)
    assert built.model.hparams.model["num_classes"] == 10 == built.datamodule.num_classes  # not ViTConfig's 1000
    assert "was given" not in said  # the config leaves num_classes to the link
    built, said = instantiated(["--config", str(DIGITS), "--model.init_args.model.num_classes", "10"], capsys)
    assert "was given" not in said  # given and equal to the data's
    built, said = instantiated(["--config", str(DIGITS), "--model.init_args.model.num_classes", "7"], capsys)
    assert built.model.hparams.model["num_classes"] == 10
    assert (
        "mmlight: model.num_classes=7 was given, but the size is linked from the data: num_classes=10 is used"
        in said.splitlines()
    )
    monkeypatch.setattr(lightning_cli.MmlightCLI, "_run_subcommand", lambda self, subcommand: None)  # built, not run
    built = lightning_cli.build_cli(
        ["fit", "--config", str(DIGITS), "--model.init_args.model.num_classes", "7", "--trainer.logger", "false"]
    )
    assert built.subcommand == "fit" and built.model.hparams.model["num_classes"] == 10
    assert "mmlight: model.num_classes=7 was given" in capsys.readouterr().out  # read from the subcommand's config
    built, said = instantiated(["--config", str(LM), "--model.init_args.model.vocab_size", "5"], capsys)
    vocab = built.datamodule.vocab_size
    assert vocab != 5 and built.model.hparams.model["vocab_size"] == vocab
    assert (
        f"mmlight: model.vocab_size=5 was given, but the size is linked from the data: vocab_size={vocab} is used"
        in said.splitlines()
    )


def test_data_that_is_not_prepared_stops_with_the_parsers_message(capsys):
    deit = ROOT / "configs" / "deit_small_multimax.yaml"
    with pytest.raises(SystemExit) as stop:
        lightning_cli.build_cli(
            ["--config", str(deit), "--data.init_args.root", "/nonexistent/imagenet", "--trainer.logger", "false"],
            run=False,
        )
    assert stop.value.code == 2
    assert (
        "error: no shard set at /nonexistent/imagenet: expected /nonexistent/imagenet/_info.json"
        in capsys.readouterr().err
    )


def test_model_config_defaults_and_missing_data_sizes():
    from mmlight.data import DigitsDataModule
    from mmlight.tasks import ImageClassifier, LanguageModel

    image = lightning_cli.model_config_defaults(ImageClassifier)
    assert image["num_classes"] == 1000 and image["img_size"] == 224
    lm = lightning_cli.model_config_defaults(LanguageModel)
    assert "vocab_size" not in lm and lm["n_heads"] == 8  # a field without a default is left out
    assert lightning_cli.model_config_defaults(SimpleNamespace) == {}  # no model config at all
    assert lightning_cli.missing_data_sizes(ImageClassifier, DigitsDataModule) == []
    assert lightning_cli.missing_data_sizes(LanguageModel, DigitsDataModule) == ["vocab_size"]
    assert lightning_cli.missing_data_sizes(ImageClassifier, object) == ["num_classes"]
    assert lightning_cli.missing_data_sizes(SimpleNamespace, object) == []

    class TakesAModule:  # a task whose ``model`` is not a config dataclass
        def __init__(self, model: torch.nn.Module):
            self.model = model

    assert (
        lightning_cli.model_config_class(TakesAModule) is None
        and lightning_cli.model_config_defaults(TakesAModule) == {}
    )
    assert lightning_cli.missing_data_sizes(TakesAModule, object) == []


def test_every_missing_size_is_named(parse_only, capsys, monkeypatch):
    """Two sizes the model takes and the DataModule lacks are both named, comma-separated."""
    monkeypatch.setattr(lightning_cli, "DATA_SIZES", {"vocab_size": "vocab_size", "pad_size": "pad_id"})
    with pytest.raises(SystemExit):
        parse_only(["fit", "--config", str(LM), "--data", "mmlight.data.DigitsDataModule"])
    assert (
        "mmlight.tasks.LanguageModel takes vocab_size, pad_size from its DataModule, but "
        "mmlight.data.DigitsDataModule has no such attribute"
    ) in capsys.readouterr().err


def test_a_misspelt_reweighting_or_a_data_without_a_needed_size_stops_at_parse_time(parse_only, capsys):
    """Both errors name what is wrong before anything is built (exit status 2, the parser's error)."""
    with pytest.raises(SystemExit) as stop:
        parse_only(["fit", "--config", str(DIGITS), "--model.init_args.model.attention.name", "softmx"])
    assert stop.value.code == 2
    from mmlight.reweighting import available as available_reweightings

    assert (
        f"error: model.init_args.model.attention.name: unknown reweighting 'softmx'; choose one of "
        f"{available_reweightings()}"
    ) in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        parse_only(["fit", "--config", str(LM), "--data", "mmlight.data.DigitsDataModule"])
    assert stop.value.code == 2
    assert (
        "error: mmlight.tasks.LanguageModel takes vocab_size from its DataModule, but "
        "mmlight.data.DigitsDataModule has no such attribute"
    ) in capsys.readouterr().err
    assert parse_only(["fit", "--config", str(DIGITS)]).subcommand == "fit"  # the shipped config passes both checks


def test_reweighting_names_finds_every_spec_at_any_depth():
    """Specs are the nodes holding exactly ``name`` and ``options``, in dicts or Namespaces, at any depth."""
    spec = {"name": "multimax", "options": {"order": 2}}
    config = Namespace(
        init_args=Namespace(
            model={
                "attention": spec,
                "output": Namespace(name="softmax", options={}),
                "not_a_spec": {"name": "x"},
                "depth": 3,
                "deeper": {"inner": {"attention": dict(spec, name="topk")}},
            }
        )
    )
    assert sorted(lightning_cli.reweighting_names(config)) == [
        ("init_args.model.attention.name", "multimax"),
        ("init_args.model.deeper.inner.attention.name", "topk"),
        ("init_args.model.output.name", "softmax"),
    ]
    assert lightning_cli.reweighting_names(config, "model.")[0][0].startswith("model.init_args.")
    assert lightning_cli.reweighting_names({"leaf": 1}) == [] and lightning_cli.reweighting_names(5) == []


def test_a_missing_ckpt_path_stops_at_parse_time_for_every_subcommand(parse_only, tmp_path):
    for subcommand in ("fit", "validate", "test"):
        with pytest.raises(SystemExit) as stop:
            parse_only([subcommand, "--config", str(DIGITS), "--ckpt_path", str(tmp_path / "gone.ckpt")])
        assert str(stop.value) == f"mmlight: --ckpt_path {tmp_path / 'gone.ckpt'}: no such file"


def test_the_cli_keeps_the_command_line_it_parsed(parse_only, monkeypatch):
    """The arguments the --model.* overrides are taken from: a list or tuple as given, else sys.argv."""
    args = ["validate", "--config", str(DIGITS), "--model.init_args.lr", "0.5"]
    built = parse_only(args)
    assert built.config.validate.model.init_args.lr == 0.5 and built._argv == args
    assert parse_only(tuple(args))._argv == args
    monkeypatch.setattr(sys, "argv", ["mmlight", *args])
    assert parse_only(None)._argv == args
    config = yaml.safe_load(DIGITS.read_text())  # arguments as a dict have no command-line overrides
    config["model"]["init_args"]["lr"] = 0.5
    built = parse_only({"subcommand": "validate", "validate": config})
    assert built._argv == [] and built.config.validate.model.init_args.lr == 0.5


#: the commands a user can type, in the order ``mmlight --help`` lists them
COMMANDS = ["fit", "validate", "test", "predict", "prepare", "analyze", "sweep", "collect", "export", "doctor"]


def test_help_lists_every_command_with_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    listed = text.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split()[0] for line in listed] == COMMANDS
    assert all(len(line.split(maxsplit=1)[1]) > 10 for line in listed)  # a line saying what it does
    # the summaries start in one column, two spaces after the longest name ("validate")
    assert all(line.startswith(f"  {line.split()[0]:<8}  ") and line[12] != " " for line in listed)
    # prepare's line names the datasets of the preparers' registry, every one of them
    from mmlight.data.prepare import DATASETS

    prepare_line = next(line for line in listed if line.split()[0] == "prepare")
    assert prepare_line.endswith(f"({', '.join(DATASETS)})") and len(DATASETS) >= 9
    head, tail = text.split("commands:\n", 1)
    assert head == (
        "usage: mmlight [-c CONFIG] COMMAND [options]\n\n"
        "Attention reweighting (softmax, MultiMax, sparsemax, ...) as a PyTorch Lightning application.\n\n"
    )
    assert tail.split("\n\n", 1)[1] == (
        "`mmlight COMMAND --help` shows a command's options. -c/--config and --print_config may also come\n"
        "before fit, validate, test or predict, as in LightningCLI.\n"
    )
    with pytest.raises(SystemExit) as stop:
        cli.main(["-h"])
    assert stop.value.code == 0 and capsys.readouterr().out == text


def test_no_command_shows_the_list_and_fails(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert all(f"\n  {name} " in err for name in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage:") and f" {command}" in out.splitlines()[0]
    summary = {  # the Trainer's commands describe themselves (the tools' help is their own parsers')
        "fit": "train a model from a config (task, data, trainer); --ckpt_path last resumes",
        "validate": "evaluate a model on the validation split",
        "test": "evaluate a model on the test split",
        "predict": "run a model's predictions (e.g. the translator's hypotheses)",
    }.get(command)
    assert summary is None or summary in " ".join(out.split())


def test_a_config_without_data_stops_at_parse_time(tmp_path, capsys):
    """The data section is required: a model that brings its own loaders (Lightning's BoringModel) is not
    trained without it."""
    config = tmp_path / "model_only.yaml"
    config.write_text("model:\n  class_path: lightning.pytorch.demos.boring_classes.BoringModel\n")
    with pytest.raises(SystemExit) as stop:
        lightning_cli.build_cli(["--config", str(config), "--trainer.logger", "false"], run=False)
    assert stop.value.code == 2
    assert "the following arguments are required: data" in capsys.readouterr().err


def test_build_cli_passes_its_arguments_and_options_to_lightning_s_and_returns_what_it_builds(monkeypatch):
    """``cli.build_cli`` defers importing Lightning: it is :func:`mmlight.lightning_cli.build_cli` with the same
    command line and options (``run=False`` in the Python API and the benchmarks) and the same result."""
    calls = []

    def recorder(args, **options):
        calls.append((args, options))
        return "the LightningCLI"

    monkeypatch.setattr(lightning_cli, "build_cli", recorder)
    assert cli.build_cli(["fit", "--config", "c.yaml"], run=False, save_config_callback=None) == "the LightningCLI"
    assert calls == [(["fit", "--config", "c.yaml"], {"run": False, "save_config_callback": None})]


@pytest.fixture
def nothing_runs(monkeypatch):
    """Every command replaced by a recorder: what a test lets through is in the returned list."""
    ran = []
    monkeypatch.setattr(cli, "build_cli", lambda args: ran.append(("lightning", args)))
    for name in cli.TOOLS:
        monkeypatch.setitem(cli.TOOLS, name, cli.Tool("tests.test_cli_units:record_tool", name))
    CALLS.clear()
    yield ran
    ran.extend(CALLS)


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("fitt", "fit"),
        ("tset", "test"),
        ("valdate", "validate"),
        ("perdict", "predict"),
        ("prepair", "prepare"),
        ("analyse", "analyze"),
        ("sweeps", "sweep"),
        ("colect", "collect"),
        ("docter", "doctor"),
    ],
)
def test_a_misspelt_command_names_the_nearest_and_runs_nothing(typed, meant, nothing_runs, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main([typed, "--config", "x.yaml"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"mmlight: unknown command {typed!r}; did you mean {meant!r}?\nRun `mmlight --help` for the list of commands.\n"
    )
    assert nothing_runs == [] and CALLS == []


def test_known_commands_and_leading_options_go_through(nothing_runs):
    cli.main(["fit", "--config", "x.yaml"])
    cli.main(["--config", "x.yaml", "validate"])  # LightningCLI's options before the command
    cli.main(["doctor", "--quick"])
    assert nothing_runs == [
        ("lightning", ["fit", "--config", "x.yaml"]),
        ("lightning", ["--config", "x.yaml", "validate"]),
    ]
    assert CALLS == [["--quick"]]


def levenshtein(a: str, b: str) -> int:
    """The textbook recursion: the last characters deleted, inserted or matched (replaced)."""

    @functools.cache
    def d(i: int, j: int) -> int:
        if min(i, j) == 0:
            return max(i, j)
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

    return d(len(a), len(b))


def test_edit_distance_is_levenshteins():
    rng = random.Random(0)
    words = ["", *("".join(rng.choice("abc") for _ in range(rng.randint(1, 7))) for _ in range(60))]
    for a in words:
        for b in words[:20]:
            assert cli.edit_distance(a, b) == levenshtein(a, b), (a, b)
    assert cli.edit_distance("kitten", "sitting") == 3


def test_the_table_commands_start_without_lightning(tmp_path):
    """``mmlight sweep`` and ``mmlight collect`` (run once per SLURM array task, and by hand between
    runs) import neither Lightning nor torch: the command table and the two commands' modules are light."""
    probe = (
        "import sys\n"
        "from mmlight import cli\n"
        "for name in ('sweep', 'collect'):\n"
        "    module, _ = cli.TOOLS[name].target.split(':')\n"
        "    __import__(module)\n"
        "print(sorted(m for m in ('lightning', 'torch', 'torchmetrics') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert result.stdout.strip() == "[]"


def test_prepare_starts_without_lightning(tmp_path):
    """``mmlight prepare`` (run on login nodes, often before any GPU job) and every preparer but the
    quick start's digits, which writes through its DataModule's module, import neither Lightning nor
    torchmetrics: the data package hands out its DataModules on first use."""
    from mmlight.data.prepare import DATASETS

    modules = ["mmlight.commands.prepare", *(m for name, m in DATASETS.items() if name != "digits")]
    probe = (
        "import importlib, sys\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
        "print(sorted(m for m in ('lightning', 'torchmetrics', 'timm') if m in sys.modules))\n"
        "import mmlight.data, mmlight.lightning_cli\n"
        "print(sorted(set(mmlight.data.EXPORTS.values()) - set(sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, wherever it is installed from
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # the trainer commands import every DataModule, whose short names (``--data DigitsDataModule``) the
    # parser knows only once their classes exist
    assert result.stdout.split("\n")[:2] == ["[]", "[]"]


def test_the_data_package_hands_out_each_name_from_its_module():
    import importlib

    import mmlight.data

    mmlight.data.load_all()
    for name, module in mmlight.data.EXPORTS.items():
        assert getattr(mmlight.data, name) is getattr(importlib.import_module(module), name)
        assert name in vars(mmlight.data) and name in dir(mmlight.data)
    with pytest.raises(AttributeError, match="no attribute 'NoSuchModule'"):
        mmlight.data.NoSuchModule  # noqa: B018
