"""`mmlight analyze` end to end on tiny checkpoints of each task, including --robustness; its CSV
against weights recorded here; the errors it gives before any work."""

import csv
import json
import re
import shutil
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from mmlight.analysis import figures as analysis_figures
from mmlight.cli import main
from mmlight.lightning_cli import build_cli
from tests.helpers.cli import analyze

pytestmark = pytest.mark.usefixtures("plain_argv")  # LightningCLI reads sys.argv

ROOT = Path(__file__).resolve().parents[2]
QUICK = ROOT / "configs" / "quickstart"


def fit(config: Path, runs: Path, *extra: str) -> Path:
    """A 2-step checkpoint of ``config``; returns its last.ckpt."""
    main(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.logger.init_args.save_dir",
            str(runs),
            "--trainer.enable_model_summary",
            "false",
            *extra,
        ]
    )
    return max(runs.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """Softmax and sparsemax checkpoints of the digits quick start (sharing one data cache)."""
    root = tmp_path_factory.mktemp("digits")
    data = ["--data.init_args.cache_dir", str(root / "cache")]
    softmax = fit(QUICK / "digits_softmax.yaml", root / "runs", *data)
    sparse = fit(
        QUICK / "digits_softmax.yaml",
        root / "runs",
        *data,
        "--model.init_args.model.attention.name",
        "sparsemax",
        "--trainer.logger.init_args.name",
        "digits_sparsemax",
    )
    return root, data, softmax, sparse


@pytest.mark.slow
def test_image_checkpoints_side_by_side_with_robustness(digits, tmp_path, monkeypatch):
    root, data, softmax, sparse = digits
    out = tmp_path / "out"
    limit = ["--trainer.limit_val_batches", "1"]
    queries, draw = [], analysis_figures.attention_map  # the query patch Figure 7 is drawn for
    monkeypatch.setattr(analysis_figures, "attention_map", lambda *args: queries.append(args[-1]) or draw(*args))
    analyze(
        QUICK / "digits_softmax.yaml",
        [softmax, sparse],
        out,
        "--num_samples",
        "24",
        "--robustness",
        "--query_patch",
        "5",
        overrides=[*data, *limit],
    )
    assert queries == [5, 5]
    rows = read_csv(out / "stats.csv")
    assert set(rows[0]) == {"checkpoint", "layer", "head", "metric", "value"}
    labels = {r["checkpoint"] for r in rows}
    assert labels == {"digits_softmax", "digits_sparsemax"}
    value = {(r["checkpoint"], r["layer"], r["head"], r["metric"]): float(r["value"]) for r in rows}
    # each checkpoint was rebuilt from its own hyperparameters: only sparsemax has exact zeros
    assert value[("digits_softmax", "blocks.0", "", "frac_zero")] == 0.0
    assert value[("digits_sparsemax", "blocks.0", "", "frac_zero")] > 0.0
    # entropy per head against weights recorded here, outside the analysis code
    from mmlight.nn.attention import record_attention
    from mmlight.tasks import ImageClassifier

    task = ImageClassifier.load_from_checkpoint(softmax, map_location="cpu").eval()
    cli = build_cli(["--config", str(QUICK / "digits_softmax.yaml"), *data], run=False)
    cli.datamodule.setup("validate")
    images = torch.cat([b[0] for b in cli.datamodule.val_dataloader()])[:24]
    with torch.no_grad(), record_attention(task) as recorder:
        task.model(images)
    weights = recorder["blocks.2"][0].weights.double()  # (24, nh, N, N)
    entropy = -(weights * weights.clamp_min(1e-300).log()).sum(-1).mean((0, 2))
    for h in range(weights.shape[1]):
        assert value[("digits_softmax", "blocks.2", str(h), "entropy")] == pytest.approx(entropy[h].item(), rel=1e-5)
    assert value[("digits_softmax", "blocks.2", "", "max_weight")] == pytest.approx(
        weights.amax(-1).mean().item(), rel=1e-5
    )
    settings = json.loads((out / "stats.json").read_text())
    assert settings["num_samples"] == 24 and settings["split"] == "val" and settings["settings"]["sink_eps"] == 3.0
    for name in (
        "fig4_token_similarity.png",
        "fig5_weight_histogram.png",
        "fig8_weight_cdf.png",
        "fig9_rollout_discrepancy.png",
        "fig7_attention_map_digits_softmax.png",
        "fig6_gradcam_digits_sparsemax.png",
        "robustness.png",
        "summary.md",
    ):
        assert (out / name).stat().st_size > 0, name
    summary = (out / "summary.md").read_text()
    assert "| digits_sparsemax |" in summary and "fig4_token_similarity.png" in summary
    robust = read_csv(out / "robustness.csv")
    assert {(r["intervention"], r["level"]) for r in robust if r["checkpoint"] == "digits_softmax"} == {
        ("none", "0"),
        ("sink_masking", "1"),
        ("sink_masking", "5"),
        ("sink_masking", "10"),
    }
    # no intervention reproduces `mmlight validate` on the same batches
    cli = build_cli(
        [
            "validate",
            "--config",
            str(QUICK / "digits_softmax.yaml"),
            *data,
            *limit,
            "--ckpt_path",
            str(softmax),
            "--trainer.logger",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    plain = next(
        float(r["value"]) for r in robust if r["checkpoint"] == "digits_softmax" and r["intervention"] == "none"
    )
    assert plain == pytest.approx(float(cli.trainer.callback_metrics["val/top1"]))


def test_errors_before_any_work(digits, tmp_path, capsys):
    root, data, softmax, _ = digits
    config = ["--config", str(QUICK / "digits_softmax.yaml"), *data]
    with pytest.raises(SystemExit, match="larger than the val split, which has 359"):
        main(["analyze", *config, "--ckpt_path", str(softmax), "--out", str(tmp_path / "a"), "--num_samples", "5000"])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["analyze", *config, "--ckpt_path", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path / "b")])
    lm_config = ["--config", str(QUICK / "lm_softmax.yaml")]
    with pytest.raises(SystemExit, match="does not match the config's model LanguageModel"):
        main(["analyze", *lm_config, "--ckpt_path", str(softmax), "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match=r"--query_patch must be in \[0, 16\)"):
        main(["analyze", *config, "--ckpt_path", str(softmax), "--out", str(tmp_path / "e"), "--query_patch", "16"])
    with pytest.raises(SystemExit):
        main(["analyze", *config, "--ckpt_path", str(softmax), "--out", str(tmp_path / "d"), "--split", "train"])
    assert "invalid choice: 'train'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            ["analyze", *config, "--ckpt_path", str(softmax), "--out", str(tmp_path / "f"), "--keep_ratios", "0.5", "0"]
        )
    assert "--keep_ratios must each be in (0, 1], got [0.5, 0.0]" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "abcdef")  # nothing written


@pytest.mark.slow
def test_language_model_eviction_at_ratio_1_reproduces_validate(tmp_path):
    config = QUICK / "lm_softmax.yaml"
    data = ["--data.init_args.train_size", "128", "--data.init_args.val_size", "16"]
    ckpt = fit(config, tmp_path / "runs", *data)
    # perplexity, not the recall accuracy (the task metric with accuracy on), which this barely trained
    # model has at chance with or without eviction
    state = torch.load(ckpt, weights_only=False)
    state["hyper_parameters"]["accuracy"] = False
    torch.save(state, ckpt)
    out = tmp_path / "runs"  # a folder that exists already: analyze writes into it
    options = ("--num_samples", "16", "--robustness", "--kv_skip_layers", "1", "--kv_methods", "l2", "streaming")
    analyze(config, [ckpt], out, *options, overrides=data)
    robust = read_csv(out / "robustness.csv")
    ppl = {(r["intervention"], float(r["level"])): float(r["value"]) for r in robust}
    assert all(r["metric"] == "ppl" for r in robust)
    assert ppl[("kv_l2", 1.0)] == pytest.approx(ppl[("none", 0.0)], rel=1e-5)
    assert ppl[("kv_streaming", 1.0)] == pytest.approx(ppl[("none", 0.0)], rel=1e-5)
    assert ppl[("kv_l2", 0.1)] != pytest.approx(ppl[("none", 0.0)], rel=1e-5)  # eviction does something
    assert {lvl for (i, lvl) in ppl if i == "kv_l2"} == {1.0, 0.9, 0.7, 0.5, 0.3, 0.1}
    cli = build_cli(
        [
            "validate",
            "--config",
            str(config),
            *data,
            "--ckpt_path",
            str(ckpt),
            "--trainer.logger",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ]
    )
    assert ppl[("none", 0.0)] == pytest.approx(float(cli.trainer.callback_metrics["val/ppl"]), rel=1e-6)
    layers = {r["layer"] for r in read_csv(out / "stats.csv")}
    assert {"decoder.layers.0.self_attn", "decoder.layers.1.self_attn", "decoder.layers.1"} <= layers
    assert (out / "attention_heatmap_decoder_self_lm_softmax.png").is_file()


@pytest.mark.slow
def test_translation_with_cross_attention_and_bleu_under_sink_masking(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the test runs' hypothesis files must not land in the working directory
    config = QUICK / "nmt_softmax.yaml"
    data = [
        "--data.init_args.cache_dir",
        str(tmp_path / "cache"),
        "--data.init_args.num_workers",
        "0",
        "--data.init_args.train_size",
        "400",
        "--data.init_args.valid_size",
        "12",
        "--data.init_args.test_size",
        "10",
        "--data.init_args.max_tokens",
        "256",
        "--data.init_args.samples_per_shard",
        "10",
    ]
    ckpt = fit(config, tmp_path / "runs", *data)
    out = tmp_path / "out"
    analyze(
        config,
        [ckpt],
        out,
        "--num_samples",
        "6",
        "--split",
        "test",
        "--robustness",
        "--kv_skip_layers",
        "0",
        "--kv_methods",
        "l2",
        "streaming",
        overrides=data,
    )
    rows = read_csv(out / "stats.csv")
    kinds = {r["layer"] for r in rows}
    assert {
        "encoder.layers.0.self_attn",
        "decoder.layers.0.self_attn",
        "decoder.layers.0.cross_attn",
        "encoder.layers.1",
        "decoder.layers.1",
    } <= kinds
    robust = read_csv(out / "robustness.csv")
    bleu = {(r["intervention"], float(r["level"])): float(r["value"]) for r in robust}
    assert {r["metric"] for r in robust} == {"bleu"} and len(robust) == 16
    assert bleu[("kv_l2", 1.0)] == bleu[("none", 0.0)] == bleu[("kv_streaming", 1.0)]  # nothing evicted
    assert (out / "cross_attention_alignment_nmt_softmax.png").is_file()
    assert json.loads((out / "stats.json").read_text())["split"] == "test"
    assert not list(tmp_path.glob("test.*"))
    # the plain run is `mmlight test` of the checkpoint (its files go to a folder of their own)
    tested = tmp_path / "tested"
    cli = build_cli(
        ["test", "--config", str(config), *data, "--ckpt_path", str(ckpt), "--trainer.logger", "false"]
        + ["--trainer.default_root_dir", str(tested)]
    )
    assert bleu[("none", 0.0)] == pytest.approx(float(cli.trainer.callback_metrics["test/bleu"]), abs=1e-9)


def test_eval_loader_batches_are_what_the_model_sees_in_validate(tmp_path):
    """With uint8 batches (``normalize_on_device``), the analysis still reads normalised float32
    images: those of the DataModule's float32 path, through its ``on_after_batch_transfer``."""
    from mmlight.commands.analyze import eval_loader
    from mmlight.data import DigitsDataModule

    on_device = DigitsDataModule(cache_dir=str(tmp_path), batch_size=50, normalize_on_device=True)
    batches = list(eval_loader(on_device, "val"))
    assert next(iter(on_device.val_dataloader()))[0].dtype == torch.uint8  # what the hook turned into floats
    expected = list(DigitsDataModule(cache_dir=str(tmp_path), batch_size=50).val_dataloader())
    assert len(batches) == len(expected) == 8  # 359 validation digits
    for (images, labels), (want_images, want_labels) in zip(batches, expected):
        assert images.dtype == torch.float32 and images.shape[1:] == (1, 8, 8)
        torch.testing.assert_close(images, want_images, atol=1e-6, rtol=1e-6)
        assert torch.equal(labels, want_labels)


class StagedData(L.LightningDataModule):
    """A DataModule in the style of Lightning's docs: ``setup`` builds only the split its stage needs,
    so a loader asked for under another stage fails; it records the stages and dataloader indices it
    is given, and its hook marks each batch (x 10) on its way to the model."""

    def __init__(self):
        super().__init__()
        self.stages, self.indices, self.splits = [], [], {}

    def setup(self, stage):
        self.stages.append(stage)
        split = {"validate": "val", "test": "test"}.get(stage)
        if split is not None:
            self.splits[split] = torch.arange(6.0) + (0 if split == "val" else 100)

    def val_dataloader(self):
        return DataLoader(self.splits["val"], batch_size=4)

    def test_dataloader(self):
        return DataLoader(self.splits["test"], batch_size=4)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.indices.append(dataloader_idx)
        return batch * 10


class Recorder(L.LightningModule):
    """Records the batches that ``trainer.validate``/``trainer.test`` give it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def validation_step(self, batch, batch_idx):
        self.seen.append(batch)

    test_step = validation_step


@pytest.mark.parametrize("split", ["val", "test"])
def test_eval_loader_sets_up_and_reads_the_split_as_lightnings_validate_and_test_do(split):
    """The reference is Lightning itself: the stage passed to ``setup``, the batches and the
    ``dataloader_idx`` of ``eval_loader(data, split)`` are those of ``trainer.validate``/``trainer.test``."""
    from mmlight.commands.analyze import eval_loader

    analysed = StagedData()
    batches = list(eval_loader(analysed, split))

    reference, model = StagedData(), Recorder()
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    (trainer.validate if split == "val" else trainer.test)(model, datamodule=reference)

    assert analysed.stages == reference.stages == ["validate" if split == "val" else "test"]
    assert analysed.indices == reference.indices == [0, 0]
    assert len(batches) == len(model.seen) == 2
    for got, want in zip(batches, model.seen):
        assert torch.equal(got, want)
    first = 0.0 if split == "val" else 1000.0
    assert batches[0].tolist() == [first, first + 10, first + 20, first + 30]


def test_eval_loader_names_a_split_the_data_does_not_have():
    from mmlight.commands.analyze import AnalyzeError, eval_loader

    class ValOnly(L.LightningDataModule):
        def val_dataloader(self):
            return DataLoader(torch.arange(4.0))

    with pytest.raises(AnalyzeError) as err:
        eval_loader(ValOnly(), "test")
    assert str(err.value).startswith("the data has no usable test split: ")
    assert "test_dataloader" in str(err.value)  # Lightning's own message, after ours


def test_analyze_end_to_end_in_seconds_writes_each_checkpoints_statistics_and_robustness(tmp_path, capsys, monkeypatch):
    """The whole of ``analyze()`` on two 1-step recall checkpoints (fast; the slow tests above check each
    task's figures and metrics in depth): each label's entropies against weights recorded here on the
    split's first samples, every option reaching the files it names, and the progress bar's total."""
    from mmlight.data import RecallDataModule
    from mmlight.nn.attention import record_attention
    from mmlight.tasks import LanguageModel

    config = QUICK / "lm_softmax.yaml"
    data = ["--data.init_args.train_size", "64", "--data.init_args.val_size", "8"]
    step = ["--trainer.max_steps", "1"]
    first = fit(config, tmp_path / "runs", *data, *step)
    second = fit(
        config, tmp_path / "runs", *data, *step, "--seed_everything", "1", "--trainer.logger.init_args.name", "lm_seed1"
    )
    argv = ["mmlight", "analyze"]
    monkeypatch.setattr(sys, "argv", argv)
    # the query patch and vocabulary each checkpoint's example figures get (a query patch is the ViT's
    # attention map's; a text task accepts any and draws heat maps, so here it shows only that it is passed on)
    passed, draw = [], analysis_figures.examples
    monkeypatch.setattr(analysis_figures, "examples", lambda *args: passed.append(args[4:]) or draw(*args))
    out = tmp_path / "analyses" / "recall"  # under a folder that does not exist yet
    options = ("--num_samples", "6", "--robustness", "--kv_skip_layers", "1", "--keep_ratios", "1", "0.5")
    options += ("--query_patch", "2")
    options += ("--kv_calibrate", "--kv_methods", "l2", "streaming", "qfilters")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analyze(config, [first, second], out, *options, "--sink_eps", "1.1", overrides=data)
    assert sys.argv is argv and argv == ["mmlight", "analyze"]  # the config parser's argv was put back
    # the config parser saw only the options meant for it, not the command line's (Lightning warns of both)
    assert not [w for w in caught if "provide both args and command line arguments" in str(w.message)]

    # statistics: per label, that checkpoint's weights on the first 6 validation sequences
    recall = RecallDataModule(train_size=64, val_size=8, batch_size=64)
    tokens = ["<s>", "<pad>", "</s>", "<unk>"] + [f"k{i}" for i in range(recall.num_keys)]
    assert passed == [(2, tokens + [f"v{j}" for j in range(recall.num_values)])] * 2
    recall.setup("validate")
    batch = {k: v[:6] for k, v in next(iter(recall.val_dataloader())).items()}
    rows = read_csv(out / "stats.csv")
    value = {(r["checkpoint"], r["layer"], r["head"], r["metric"]): float(r["value"]) for r in rows}
    for label, ckpt in (("lm_softmax", first), ("lm_seed1", second)):
        task = LanguageModel.load_from_checkpoint(ckpt, map_location="cpu").eval()
        with torch.no_grad(), record_attention(task) as recorder:
            task.teacher_forced(batch)
        for layer in ("decoder.layers.0.self_attn", "decoder.layers.1.self_attn"):
            weights = recorder[layer][0].weights.double()  # (6, nh, T, T)
            entropy = -(weights * weights.clamp_min(1e-300).log()).sum(-1).mean((0, 2))
            for h in range(weights.shape[1]):
                assert value[(label, layer, str(h), "entropy")] == pytest.approx(entropy[h].item(), rel=1e-6)
    assert value[("lm_softmax", "decoder.layers.0.self_attn", "0", "entropy")] != pytest.approx(
        value[("lm_seed1", "decoder.layers.0.self_attn", "0", "entropy")], rel=1e-6
    )

    stats = json.loads((out / "stats.json").read_text())
    assert {k: stats[k] for k in ("num_samples", "split", "kv_skip_layers", "keep_ratios", "checkpoints")} == {
        "num_samples": 6,
        "split": "val",
        "kv_skip_layers": 1,
        "keep_ratios": [1.0, 0.5],
        "checkpoints": {"lm_softmax": str(first), "lm_seed1": str(second)},
    }
    assert (
        stats["settings"]["sink_eps"] == 1.1 and "exceeds 1.1 x the uniform share" in stats["thresholds"]["sink_ratio"]
    )
    assert len(stats["rows"]) == len(rows)
    # the LM analyses: massive activations for each checkpoint, and no extrapolation section when not asked for
    assert set(stats["massive_activations"]) == {"lm_softmax", "lm_seed1"} and "extrapolation" not in stats

    robust = read_csv(out / "robustness.csv")
    assert list(robust[0]) == ["checkpoint", "intervention", "level", "metric", "value"]
    levels = {(r["intervention"], r["level"]) for r in robust}
    assert levels == {("none", "0"), ("sink_masking", "1"), ("sink_masking", "5"), ("sink_masking", "10")} | {
        (kind, ratio) for kind in ("kv_l2", "kv_streaming", "kv_qfilters") for ratio in ("1.0", "0.5")
    }
    assert [r["checkpoint"] for r in robust] == ["lm_softmax"] * 10 + ["lm_seed1"] * 10
    assert stats["compression_ratios"] == [0.0, 0.5] and stats["kv_methods"] == ["l2", "streaming", "qfilters"]
    # the Q-filters beside each checkpoint: layer 1's, recomputed here from the 6 sequences' queries
    text = (out / "qfilters.json").read_text()
    calibration = json.loads(text)
    assert text == json.dumps(calibration, indent=1) + "\n"  # indented by one space, as the other JSON files
    for label, ckpt in (("lm_softmax", first), ("lm_seed1", second)):
        saved = torch.load(f"{ckpt}.qfilters.pt", weights_only=True)
        assert calibration[label]["num_sequences"] == saved["num_sequences"] == 6
        assert saved["filters"].shape == (2, 2, 32) and -1 <= calibration[label]["cosine_min"] <= 1
        task = LanguageModel.load_from_checkpoint(ckpt, map_location="cpu").eval()
        net = task.model.decoder.layers[1].self_attn
        with torch.no_grad():
            hidden = {}
            handle = net.register_forward_pre_hook(lambda m, a: hidden.setdefault("x", a[0]))
            task.teacher_forced(batch)
            handle.remove()
        q = net.q_proj(hidden["x"]).detach().view(6, -1, 2, 32)[batch["input"] != task.config.pad_id]  # (N, nh, hs)
        for h in range(2):
            f = saved["filters"][1, h].double()
            _, _, vh = torch.linalg.svd(q[:, h].double(), full_matrices=False)
            assert torch.allclose(f.abs(), vh[0].abs(), atol=1e-5) and (q[:, h].double() @ f).mean() > 0
    assert {r["metric"] for r in robust} == {"acc"}

    # the attention loss of each KV eviction run (layer 1, the only one evicted, then pooled): none at
    # r = 1; at r = 0.5 more than nothing and never below the oracle's at the same budget
    losses = read_csv(out / "kv_attention_loss.csv")
    assert list(losses[0]) == [
        "checkpoint",
        "intervention",
        "keep_ratio",
        "compression_ratio",
        "layer",
        "rows",
        "attention_loss",
        "oracle_loss",
    ]
    assert [(r["checkpoint"], r["intervention"], r["keep_ratio"], r["layer"]) for r in losses] == [
        (label, f"kv_{m}", ratio, layer)
        for label in ("lm_softmax", "lm_seed1")
        for m in ("l2", "streaming", "qfilters")
        for ratio in ("1.0", "0.5")
        for layer in ("1", "all")
    ]
    for r in losses:
        keep, loss, oracle = float(r["keep_ratio"]), float(r["attention_loss"]), float(r["oracle_loss"])
        assert float(r["compression_ratio"]) == pytest.approx(1 - keep)
        assert int(r["rows"]) == 8 * 2 * batch["input"].shape[1]  # every query of the 8 sequences, 2 heads
        assert (loss, oracle) == (0.0, 0.0) if keep == 1.0 else loss >= oracle > 0
    saved = json.loads((out / "robustness.json").read_text())
    assert saved["compression_ratios"] == [0.0, 0.5] and len(saved["rows"]) == len(robust)
    assert [{**row, "layer": str(row["layer"])} for row in saved["attention_losses"]] == [
        {c: r[c] if c in ("checkpoint", "intervention", "layer") else float(r[c]) for c in r} for r in losses
    ]

    # key norm against received attention, per layer: what key_norm_attention gives on the same samples
    from mmlight.analysis.key_norms import key_norm_attention

    correlations = read_csv(out / "key_norm_attention.csv")
    assert [(r["checkpoint"], r["layer"]) for r in correlations] == [
        (label, f"decoder.layers.{n}.self_attn") for label in ("lm_softmax", "lm_seed1") for n in (0, 1)
    ]
    for label, ckpt in (("lm_softmax", first), ("lm_seed1", second)):
        task = LanguageModel.load_from_checkpoint(ckpt, map_location="cpu")
        for site, entry in key_norm_attention(task, [batch]).items():
            (row,) = [r for r in correlations if (r["checkpoint"], r["layer"]) == (label, site)]
            assert int(row["pairs"]) == entry["pairs"]
            assert float(row["spearman"]) == pytest.approx(entry["spearman"], rel=1e-9)
            assert float(row["pearson"]) == pytest.approx(entry["pearson"], rel=1e-9)

    summary = (out / "summary.md").read_text()
    massive_rows = summary.split("## Massive activations")[1].split("\n## ")[0].splitlines()
    largest = [r.split(" | ")[-1].rstrip(" |").split(", ") for r in massive_rows if r.startswith("| lm_")]
    assert len(largest) == 2 and all(cell[1] in passed[0][1] for cell in largest)  # tokens spelled
    assert summary.startswith("# Attention analysis: 6 val samples\n")
    assert "sinks above 1.1 x the uniform share" in summary
    assert "| lm_softmax | " in summary and "| lm_seed1 | " in summary and "## Robustness (whole split)" in summary
    assert "| lm_seed1 | kv_l2 | 0.5 | acc | " in summary
    assert "| lm_seed1 | qfilters | 0.5 | 0.5 | " in summary  # method, keep ratio, compression ratio
    assert "| lm_softmax | decoder.layers.1.self_attn | " in summary  # its key norm correlations
    figures = sorted(p.name for p in out.glob("*.png"))
    assert "robustness.png" in figures and "attention_heatmap_decoder_self_lm_seed1.png" in figures
    assert [line for line in summary.splitlines() if line.startswith("- [")] == [
        f"- [{name}]({name})" for name in sorted(figures, key=summary.index)
    ]
    captured = capsys.readouterr()
    assert f"mmlight analyze: 2 checkpoint(s), 6 val samples -> {out}/summary.md" in captured.out
    total = 2 * (6 + 10)  # per checkpoint: its samples, then one validation run per robustness row
    assert "mmlight analyze: 100%" in captured.err and f"{total}/{total} " in captured.err
    assert "sample/s, lm_softmax]" in captured.err and "sample/s, lm_seed1]" in captured.err  # the run in progress

    # the sink ratio at --sink_eps 1.1, recounted from the per-position shares written beside it (these
    # barely trained models exceed 1.1 x the uniform share at a few positions, the default 3 x at none)
    ratios = []
    for label in ("lm_softmax", "lm_seed1"):
        for site, entry in stats["details"][label]["sites"].items():
            shares = [v for v in entry["incoming_relative"] if v is not None]
            assert value[(label, site, "", "sink_ratio")] == pytest.approx(sum(v > 1.1 for v in shares) / len(shares))
            assert entry["metrics"]["sink_ratio"] == value[(label, site, "", "sink_ratio")]
            ratios.append(value[(label, site, "", "sink_ratio")])
    assert max(ratios) > 0

    # again into the folder that now exists, one checkpoint, no robustness: the bar counts the samples only
    analyze(config, [first], out, "--num_samples", "4", "--massive_top_k", "2", overrides=data)
    assert json.loads((out / "stats.json").read_text())["checkpoints"] == {"lm_softmax": str(first)}
    with (out / "massive_activations.csv").open() as f:
        tops = {row["metric"] for row in csv.DictReader(f) if row["metric"].startswith("top")}
    assert tops == {"top1", "top2"}  # --massive_top_k reaches the recording
    bar = capsys.readouterr().err.split("\r")[-1]
    assert bar.startswith("mmlight analyze: 100%|") and "| 4/4 [" in bar

    # a checkpoint that does not fit the data is refused before any work (16 keys: 4 + 16 + 32 tokens)
    fewer_keys = [*data, "--data.init_args.num_keys", "16"]
    with pytest.raises(SystemExit) as refused:
        analyze(config, [second], tmp_path / "refused", "--num_samples", "4", overrides=fewer_keys)
    assert str(refused.value) == f"mmlight analyze: error: checkpoint {second} has vocab_size=68 but the data has 52"
    assert not (tmp_path / "refused").exists()

    # so is qfilters without filters beside each checkpoint (the first has them, from --kv_calibrate above)
    plain = tmp_path / "plain.ckpt"
    shutil.copy(second, plain)
    with pytest.raises(SystemExit) as refused:
        options = ("--num_samples", "4", "--robustness", "--kv_skip_layers", "1", "--kv_methods", "qfilters")
        analyze(config, [first, plain], tmp_path / "refused", *options, overrides=data)
    assert str(refused.value) == (
        f"mmlight analyze: error: --kv_methods qfilters needs {plain}.qfilters.pt: add --kv_calibrate (now or earlier)"
    )
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_massive_activations_and_extrapolation_reach_their_files_and_past_the_table_is_said(tmp_path, capsys):
    """On a 1-step recall checkpoint (learned positions, 64 of them; sequences of 31 tokens): 1x and 2x are
    evaluated, 4x and 8x are named as past the table; the files hold what the analysis functions return."""
    from mmlight.analysis.extrapolation import length_extrapolation, stream_from_batches
    from mmlight.analysis.massive import massive_activations
    from mmlight.data import RecallDataModule
    from mmlight.tasks import LanguageModel

    config = QUICK / "lm_softmax.yaml"
    data = ["--data.init_args.train_size", "64", "--data.init_args.val_size", "16"]
    ckpt = fit(config, tmp_path / "runs", *data, "--trainer.max_steps", "1")
    with pytest.raises(SystemExit) as refused:  # 4 windows of 8 x 31 tokens: more than 16 sequences hold
        analyze(config, [ckpt], tmp_path / "refused", "--num_samples", "4", "--extrapolation", overrides=data)
    assert "need 992 positions, and the val split holds 496" in str(refused.value)
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "out"
    extrapolation = ("--extrapolation", "--extrapolation_windows", "2", "--position_bucket", "4")  # not the default 8
    analyze(config, [ckpt], out, "--num_samples", "4", *extrapolation, overrides=data)
    captured = capsys.readouterr()
    assert "lm_softmax: 4x not evaluated: the model's learned position table holds 64 positions" in captured.out
    done, total = map(int, re.search(r"\| (\d+)/(\d+) \[", captured.err.split("\r")[-1]).groups())
    assert done == total > 4  # the bar counts the extrapolation windows beside the 4 samples
    recall = RecallDataModule(train_size=64, val_size=16, batch_size=64)
    recall.setup("validate")
    batches = list(recall.val_dataloader())
    task = LanguageModel.load_from_checkpoint(ckpt, map_location="cpu")
    expected = length_extrapolation(task, stream_from_batches(batches, 1, 496), 31, bucket=4)
    rows = read_csv(out / "extrapolation.csv")
    windows = {r["multiple"]: r for r in rows if r["part"] == "window"}
    assert float(windows["1"]["ppl"]) == pytest.approx(expected["multiples"][1]["ppl"], rel=1e-9)
    assert float(windows["2"]["ppl"]) == pytest.approx(expected["multiples"][2]["ppl"], rel=1e-9)
    assert windows["4"]["ppl"] == windows["8"]["ppl"] == ""
    assert [(r["start"], r["stop"]) for r in rows if r["multiple"] == "2" and r["part"] == "bucket"] == [
        (str(s), str(min(s + 4, 62))) for s in range(0, 62, 4)
    ]
    massive = massive_activations(task, [{k: v[:4] for k, v in batches[0].items()}])
    stats = json.loads((out / "stats.json").read_text())
    assert [stats["extrapolation"]["lm_softmax"]["multiples"][m]["ppl"] for m in ("1", "2")] == pytest.approx(
        [expected["multiples"][1]["ppl"], expected["multiples"][2]["ppl"]], rel=1e-9
    )
    written = stats["massive_activations"]["lm_softmax"]["blocks"]["decoder.layers.1"]
    assert written["ratio"] == pytest.approx(massive["blocks"]["decoder.layers.1"]["ratio"], rel=1e-9)
    assert written["top"][0]["token_text"] == f"k{written['top'][0]['token'] - 4}" or written["top"][0][
        "token_text"
    ].startswith("v")
    summary = (out / "summary.md").read_text()
    assert "## Length extrapolation (496 positions, training context 31)" in summary
    assert "- [length_extrapolation.png](length_extrapolation.png)" in summary
    assert (out / "massive_activations.png").is_file() and (out / "massive_activations.csv").is_file()
