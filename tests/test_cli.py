"""The ``mmlight`` CLI: every shipped config parses, quick starts run, bad configs fail early."""

from pathlib import Path

import pytest
import yaml

from mmlight.cli import build_cli, main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
QUICKSTARTS = sorted((ROOT / "configs" / "quickstart").glob("digits_*.yaml"))


def test_configs_exist():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in CONFIGS}
    assert {"deit_small_multimax.yaml", "deit_small_softmax.yaml",
            "quickstart/digits_multimax.yaml", "quickstart/digits_softmax.yaml"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_prints(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"].startswith("mmlight.tasks.")
    assert printed["data"]["class_path"].startswith("mmlight.data.")


def test_deit_small_recipe():
    """The ImageNet configs carry the DeiT recipe the paper trains with."""
    for name, attention in [("deit_small_multimax.yaml", "multimax"), ("deit_small_softmax.yaml", "softmax")]:
        cfg = build_cli(["--config", str(ROOT / "configs" / name)], run=False).config
        model = cfg.model.init_args
        assert model.model.variant == "deit_small" and model.model.global_pool == "avg"
        assert model.model.attention.name == attention
        assert model.model.output_multimax == (attention == "multimax")
        assert model.model.drop_path_rate == 0.1
        assert (model.lr, model.lr_reference_batch, model.weight_decay) == (5e-4, 512, 0.05)
        assert (model.warmup_epochs, model.mixup_alpha, model.cutmix_alpha, model.label_smoothing) == (5, 0.8, 1.0, 0.1)
        augment = cfg.data.init_args.augment
        assert (augment.auto_augment, augment.re_prob, augment.interpolation) == ("rand-m9-mstd0.5-inc1", 0.25, "bicubic")
        assert cfg.trainer.max_epochs == 300 and cfg.trainer.precision == "bf16-mixed"
        assert cfg.trainer.strategy == "ddp"


@pytest.mark.parametrize(
    "override, message",
    [
        (["--model.init_args.model.attenton.name", "multimax"], "attenton"),
        (["--model.init_args.lr", "fast"], "lr"),
        (["--model.init_args.model.attention.name", "softmaxx"], "softmaxx"),
    ],
)
def test_bad_config_stops_before_work(override, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(QUICKSTARTS[0]), *override])
    assert exit_info.value.code != 0
    assert message in capsys.readouterr().err


def test_missing_config_file(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", "configs/no_such_file.yaml"])
    assert "no_such_file.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("config", QUICKSTARTS, ids=lambda p: p.name)
def test_quickstart_fast_dev_run(config, tmp_path):
    cli = build_cli(
        ["fit", "--config", str(config), "--trainer.fast_dev_run", "2",
         "--trainer.default_root_dir", str(tmp_path),
         "--data.init_args.cache_dir", str(tmp_path / "digits"), "--data.init_args.num_workers", "0"],
    )
    assert cli.trainer.global_step == 2
    assert (tmp_path / "digits" / "_info.json").is_file()
