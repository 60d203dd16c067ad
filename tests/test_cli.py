"""The ``mmlight`` CLI: every shipped config parses, quick starts run, bad configs fail early."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from mmlight.cli import main
from mmlight.lightning_cli import build_cli
from tests.helpers.text_fixtures import FIXTURE_BATCHES, vocab_size, write_text_shard_sets

pytestmark = pytest.mark.usefixtures("plain_argv")  # LightningCLI reads sys.argv

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "tables" not in p.parts)  # tables: tests/experiments
QUICKSTARTS = sorted((ROOT / "configs" / "quickstart").glob("digits_*.yaml"))
ALL_QUICKSTARTS = sorted((ROOT / "configs" / "quickstart").glob("*.yaml"))


def test_configs_exist():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in CONFIGS}
    expected = {
        "deit_small_multimax.yaml",
        "deit_small_softmax.yaml",
        "lm_wikitext103_softmax.yaml",
        "lm_wikitext103_multimax.yaml",
    }
    expected |= {f"nmt_iwslt14_{name}.yaml" for name in ("softmax", "multimax", "sparsemax", "entmax15", "evsoftmax")}
    expected |= {
        f"quickstart/{task}_{name}.yaml" for task in ("digits", "lm", "llm", "nmt") for name in ("softmax", "multimax")
    }
    expected |= {f"llm/llama_{size}_softmax.yaml" for size in ("124m", "350m")}
    assert expected <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_prints(config, capsys):
    printed = resolved_config(config, capsys)
    assert printed["model"]["class_path"].startswith("mmlight.tasks.")
    assert printed["data"]["class_path"].startswith("mmlight.data.")


def resolved_config(config, capsys) -> dict:
    return resolved_config_with(config, [], capsys)


def resolved_config_with(config, overrides, capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), *overrides, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize(
    "name, attention", [("deit_small_multimax.yaml", "multimax"), ("deit_small_softmax.yaml", "softmax")]
)
def test_deit_small_recipe(name, attention, capsys):
    """The ImageNet configs carry the DeiT recipe the paper trains with."""
    cfg = resolved_config(ROOT / "configs" / name, capsys)
    model, arch = cfg["model"]["init_args"], cfg["model"]["init_args"]["model"]
    assert (arch["variant"], arch["global_pool"], arch["drop_path_rate"]) == ("deit_small", "avg", 0.1)
    assert arch["attention"]["name"] == attention and arch["output_multimax"] == (attention == "multimax")
    assert (model["lr"], model["lr_reference_batch"], model["weight_decay"]) == (5e-4, 512, 0.05)
    assert (model["warmup_epochs"], model["mixup_alpha"], model["cutmix_alpha"]) == (5, 0.8, 1.0)
    assert model["label_smoothing"] == 0.1 and model["ema_decay"] == 0.99996
    assert model["compile"] is True  # measured faster on an H200 (BENCHMARKS.md)
    augment = cfg["data"]["init_args"]["augment"]
    assert (augment["auto_augment"], augment["color_jitter"], augment["re_prob"]) == ("rand-m9-mstd0.5-inc1", 0.3, 0.25)
    assert (augment["interpolation"], augment["crop_pct"]) == ("bicubic", 0.875)
    assert cfg["data"]["init_args"]["normalize_on_device"] is True  # the workers send uint8 (BENCHMARKS.md)
    trainer = cfg["trainer"]
    assert (trainer["max_epochs"], trainer["precision"], trainer["strategy"]) == (300, "bf16-mixed", "ddp")
    assert arch["backend"] == "auto"  # Triton kernels on the GPUs, eager on a CPU
    # the SLURM job asks for the loader workers plus the training process (BENCHMARKS.md, cores per GPU)
    cpus = int(re.search(r"--cpus-per-task=(\d+)", (ROOT / "slurm" / "imagenet.sh").read_text()).group(1))
    assert cfg["data"]["init_args"]["num_workers"] + 1 < cpus


def test_backend_is_a_config_key(capsys):
    cfg = resolved_config_with(QUICKSTARTS[0], ["--model.init_args.model.backend", "compile"], capsys)
    assert cfg["model"]["init_args"]["model"]["backend"] == "compile"


@pytest.mark.parametrize(
    "override, message",
    [
        (["--model.init_args.model.attenton.name", "multimax"], "attenton"),
        (["--model.init_args.lr", "fast"], "lr"),
        (["--model.init_args.model.attention.name", "softmaxx"], "softmaxx"),
        (["--model.init_args.model.backend", "cuda"], "backend"),
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


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One cache for the generated data sets of the quick starts (written on first use)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def python_docs(tmp_path_factory):
    """A python-docs shard set (the llm quick starts' data)."""
    from tests.helpers.text_fixtures import python_docs_shards

    return python_docs_shards(tmp_path_factory.mktemp("python-docs"))


#: A smaller generated corpus for the translation quick start's runs here (same lexicon, so the same 114-token
#: dictionary): fast_dev_run validates two batches of 2048 tokens with beam search, most of the test's time
#: with the config's 500 validation sentences. tests/callbacks/test_data_wait.py fits the config as shipped.
SMALL_NMT = [
    "--data.init_args.train_size",
    "2000",
    "--data.init_args.valid_size",
    "40",
    "--data.init_args.test_size",
    "40",
]


@pytest.mark.parametrize("config", ALL_QUICKSTARTS, ids=lambda p: p.name)
def test_quickstart_fast_dev_run(config, cache_dir, tmp_path, request):
    task = config.stem.split("_")[0]
    if task == "llm":  # prepared text: the shard set replaces data/python-docs
        data = ["--data.init_args.root", str(request.getfixturevalue("python_docs"))]
    else:  # recall is generated in memory, the other quick starts write a cache
        data = [] if task == "lm" else ["--data.init_args.cache_dir", str(cache_dir / task)]
    sizes = SMALL_NMT if task == "nmt" else []
    cli = build_cli(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.fast_dev_run",
            "2",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--data.init_args.num_workers",
            "0",
            *data,
            *sizes,
        ]
    )
    assert cli.trainer.global_step == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    if task not in ("lm", "llm"):
        assert (cache_dir / task / "_info.json").is_file()


def topk_of_batches(cli, k: int, stage: str, batches: int = 2) -> float:
    """Top-k accuracy of the CLI's model on the first ``batches`` batches of ``stage``, recomputed."""
    loader = cli.datamodule.test_dataloader() if stage == "test" else cli.datamodule.val_dataloader()
    hits = total = 0
    model = cli.model.eval()
    with torch.no_grad():
        for i, (images, labels) in enumerate(loader):
            if i == batches:
                break
            ranked = model(images).topk(k, dim=-1).indices  # (B, k)
            hits += int((ranked == labels[:, None]).any(-1).sum())
            total += len(labels)
    return hits / total


def test_validate_test_predict_subcommands(tmp_path):
    common = [
        "--config",
        str(QUICKSTARTS[0]),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.logger",
        "false",
        "--data.init_args.cache_dir",
        str(tmp_path / "digits"),
    ]
    cli = build_cli(["test", *common, "--trainer.limit_test_batches", "2"])
    assert cli.trainer.callback_metrics["test/top1"].item() == pytest.approx(topk_of_batches(cli, 1, "test"))
    cli = build_cli(["validate", *common, "--trainer.limit_val_batches", "2"])
    assert cli.trainer.callback_metrics["val/top5"].item() == pytest.approx(topk_of_batches(cli, 5, "val"))
    cli = build_cli(["predict", *common, "--trainer.limit_predict_batches", "2"])
    predictions = cli.trainer.predict_loop.predictions
    assert len(predictions) == 2 and predictions[0]["probs"].shape == (32, 10)
    assert (predictions[0]["pred"] == predictions[0]["probs"].argmax(-1)).all()


def test_resume_last_and_refuse_a_checkpoint_of_another_model(tmp_path, plain_argv, capsys):
    """`--ckpt_path last` starts fresh, then resumes the newest last.ckpt of the run name; a
    checkpoint of another architecture stops with a message naming what differs."""
    common = [
        "--config",
        str(QUICKSTARTS[0]),
        "--trainer.limit_train_batches",
        "3",
        "--trainer.limit_val_batches",
        "1",
        "--data.init_args.cache_dir",
        str(tmp_path / "digits"),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
        "--last_checkpoint.every_n_train_steps",
        "2",
        "--ckpt_path",
        "last",
    ]
    main(["fit", *common, "--trainer.max_epochs", "1"])
    assert "no checkpoint yet, starting fresh" in capsys.readouterr().out
    main(["fit", *common, "--trainer.max_epochs", "2"])
    assert "version_0/checkpoints/last.ckpt" in capsys.readouterr().out
    last = tmp_path / "runs" / "digits_multimax" / "version_1" / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 6  # 3 + 3: continued
    # (the CLI itself rebuilds the model from the checkpoint's hyperparameters; the Python API does not)
    import lightning as L

    from mmlight.data import DigitsDataModule
    from mmlight.models import ViTConfig
    from mmlight.tasks import ImageClassifier

    other = ImageClassifier(ViTConfig(variant="deit_tiny", img_size=8, patch_size=2, in_chans=1, num_classes=10))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=1)
    with pytest.raises(ValueError, match="another model or config.*shapes differ"):
        trainer.validate(other, DigitsDataModule(cache_dir=str(tmp_path / "digits")), ckpt_path=str(last))


@pytest.fixture(scope="module")
def text_shards(tmp_path_factory):
    return write_text_shard_sets(tmp_path_factory.mktemp("text"))


PAPER_TEXT_CONFIGS = sorted((ROOT / "configs").glob("lm_*.yaml")) + sorted((ROOT / "configs").glob("nmt_*.yaml"))


@pytest.mark.parametrize("config", PAPER_TEXT_CONFIGS, ids=lambda p: p.stem)
def test_paper_text_config_fast_dev_run(config, text_shards, tmp_path, monkeypatch):
    """Each Table 3/4 config runs a training and a validation step at its full model size, on the CPU,
    on the tiny fixture shards (vocabulary, device, data location and batch shape overridden). The
    translation configs' validation BLEU is sacreBLEU's on the sentences the model translated, whose
    references are the fixture's validation pairs (every 23rd kept training pair)."""
    import sacrebleu

    from mmlight.tasks import Translator
    from tests.helpers.iwslt import moses_tok, write_raw

    generated = []
    finish = Translator._finish_generation
    monkeypatch.setattr(
        Translator, "_finish_generation", lambda self, stage: generated.append(finish(self, stage)) or generated[-1]
    )
    dataset = "wikitext103" if config.name.startswith("lm_") else "iwslt14"
    data = text_shards[dataset]
    cli = build_cli(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.fast_dev_run",
            "1",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.strategy",
            "auto",
            "--trainer.precision",
            "32",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--data.init_args.root",
            str(data),
            "--data.init_args.num_workers",
            "0",
            *FIXTURE_BATCHES[dataset],
        ]
    )
    assert cli.model.config.vocab_size == vocab_size(data) == len(cli.datamodule.vocab)  # linked, not configured
    assert cli.trainer.global_step == 1
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and torch.isfinite(metrics["val/ppl"])
    if config.name.startswith("nmt_"):
        [rows] = generated
        kept, _ = write_raw(tmp_path / "raw")
        assert [r["ref_tok"] for r in rows] == [moses_tok(kept[i][1], "en") for i in (22, 45)]
        hyps, refs = [r["hyp"] for r in rows], [r["ref"] for r in rows]
        assert metrics["val/bleu"].item() == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-4)
        tokenised = sacrebleu.metrics.BLEU(tokenize="none", lowercase=True, force=True)
        want_tok = tokenised.corpus_score([r["hyp_tok"] for r in rows], [[r["ref_tok"] for r in rows]]).score
        assert metrics["val/bleu_tok"].item() == pytest.approx(want_tok, abs=1e-4)


def test_translation_test_and_predict_commands(cache_dir, tmp_path):
    """The README's `mmlight test` and `mmlight predict --data.init_args.src_file` on a checkpoint of
    the translation quick start: hypotheses files with one line per sentence, in order."""
    import sacrebleu

    config = ROOT / "configs" / "quickstart" / "nmt_multimax.yaml"
    common = [
        "--config",
        str(config),
        "--data.init_args.cache_dir",
        str(cache_dir / "nmt"),
        *SMALL_NMT,
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
    ]
    # no validation: beam search over a validation batch would cost more than the fit, and nothing reads it
    main(["fit", *common, "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0"])
    last = tmp_path / "runs" / "nmt_multimax" / "version_0" / "checkpoints" / "last.ckpt"
    # a --model option on the command line wins over the checkpoint's hyperparameters
    out = tmp_path / "hypotheses"
    main(
        [
            "test",
            *common,
            "--ckpt_path",
            str(last),
            "--trainer.limit_test_batches",
            "1",
            "--model.init_args.output_dir",
            str(out),
        ]
    )
    hyps, refs = (out / "test.hyp").read_text().splitlines(), (out / "test.ref").read_text().splitlines()
    assert 0 < len(hyps) == len(refs)
    written = json.loads((out / "test.bleu.json").read_text())
    assert written["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    lines = ["der hund sieht die rote katze .", "heute findet mein alter koch einen blauen fisch .", ""]
    src_file = tmp_path / "input.de"
    src_file.write_text("\n".join(lines) + "\n")
    main(["predict", *common, "--ckpt_path", str(last), "--data.init_args.src_file", str(src_file)])
    assert len((tmp_path / "runs" / "nmt_multimax" / "version_2" / "predict.hyp").read_text().splitlines()) == 3
    # the same checkpoint on a corpus with another dictionary: the vocabulary comes from the data, so
    # the model built for it does not fit the checkpoint, and the run stops naming what differs
    other = [
        "--config",
        str(config),
        "--data.init_args.cache_dir",
        str(tmp_path / "other"),
        "--data.init_args.train_size",
        "30",
        "--data.init_args.valid_size",
        "5",
        "--data.init_args.test_size",
        "5",
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--ckpt_path",
        str(last),
    ]
    with pytest.raises(
        ValueError, match=r"another model or config.*shapes differ: .*embed.*\(114, 64\) vs \(\d+, 64\)"
    ):
        main(["test", *other])


@pytest.mark.parametrize(
    "config",
    [
        "nmt_iwslt14_softmax.yaml",
        "lm_wikitext103_softmax.yaml",
        "deit_small_softmax.yaml",
        "quickstart/nmt_softmax.yaml",
    ],
)
def test_sizes_the_data_knows_are_not_configured(config, capsys):
    """The vocabulary size and class count are linked from the DataModule: no config sets them, and
    ``--print_config`` (which builds nothing) leaves them out."""
    assert not {"vocab_size", "num_classes"} & set(
        yaml.safe_load((ROOT / "configs" / config).read_text())["model"]["init_args"]["model"]
    )
    printed = resolved_config(ROOT / "configs" / config, capsys)["model"]["init_args"]["model"]
    assert "vocab_size" not in printed and "num_classes" not in printed


def test_linked_sizes_replace_a_given_one_and_say_so(tmp_path, capsys):
    cli = build_cli(
        [
            "--config",
            str(ROOT / "configs" / "quickstart" / "lm_softmax.yaml"),
            "--trainer.logger",
            "false",
            "--data.init_args.num_keys",
            "10",
            "--model.init_args.model.vocab_size",
            "5",
        ],
        run=False,
    )
    assert cli.model.config.vocab_size == cli.datamodule.vocab_size == 4 + 10 + 32
    assert "model.vocab_size=5 was given" in capsys.readouterr().out
    cli = build_cli(
        [
            "--config",
            str(QUICKSTARTS[0]),
            "--trainer.logger",
            "false",
            "--data.init_args.cache_dir",
            str(tmp_path / "digits"),
        ],
        run=False,
    )
    assert cli.model.model.config.num_classes == 10 and not (tmp_path / "digits").exists()  # known before writing


def test_a_task_whose_data_lacks_a_size_stops_before_building(capsys):
    from mmlight.data import DigitsDataModule, RecallDataModule, ToyTranslationDataModule, WikiTextDataModule
    from mmlight.lightning_cli import missing_data_sizes
    from mmlight.tasks import ImageClassifier, LanguageModel, Translator

    assert missing_data_sizes(LanguageModel, DigitsDataModule) == ["vocab_size"]
    assert missing_data_sizes(ImageClassifier, RecallDataModule) == ["num_classes"]
    for task, data in (
        (LanguageModel, WikiTextDataModule),
        (LanguageModel, RecallDataModule),
        (Translator, ToyTranslationDataModule),
        (ImageClassifier, DigitsDataModule),
    ):
        assert missing_data_sizes(task, data) == []
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "quickstart" / "lm_softmax.yaml"),
                "--data",
                "mmlight.data.DigitsDataModule",
            ]
        )
    assert exit_info.value.code == 2
    assert "takes vocab_size from its DataModule" in capsys.readouterr().err


def test_unprepared_data_stops_with_the_file_it_expected(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "nmt_iwslt14_softmax.yaml"),
                "--data.init_args.root",
                str(tmp_path / "nowhere"),
            ]
        )
    assert exit_info.value.code == 2
    assert f"{tmp_path / 'nowhere' / '_info.json'}" in capsys.readouterr().err


def test_model_options_of_a_command_line():
    from mmlight.lightning_cli import model_options

    argv = [
        "test",
        "--config",
        "c.yaml",
        "--model.init_args.beam.beam_size",
        "10",
        "--ckpt_path",
        "x.ckpt",
        "--model.init_args.output_dir=out",
        "--trainer.devices",
        "1",
    ]
    assert model_options(argv) == ["--model.init_args.beam.beam_size", "10", "--model.init_args.output_dir=out"]


def test_ckpt_path_that_is_not_a_checkpoint_is_named(tmp_path):
    """A missing file, a text file and a torch file without Lightning's entries each stop the run
    before any work with a message that names the file."""
    path = tmp_path / "model.ckpt"
    validate = ["validate", "--config", str(QUICKSTARTS[0]), "--ckpt_path", str(path)]
    with pytest.raises(SystemExit) as stop:
        main(validate)
    assert str(stop.value) == f"mmlight: --ckpt_path {path}: no such file"
    path.write_text("version https://git-lfs.github.com/spec/v1\n")  # e.g. an LFS pointer
    with pytest.raises(SystemExit) as stop:
        main(validate)
    assert str(stop.value).startswith(f"mmlight: --ckpt_path {path} is not a Lightning checkpoint (torch.load")
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(SystemExit) as stop:
        main(validate)
    assert "is not a Lightning checkpoint (a torch file without the 'state_dict'" in str(stop.value)
