"""`mmlight analyze`'s pieces that need no trained checkpoint (commands/analyze.py, analysis/batches.py):
argument checks, run labels, the size checks, the evaluation trainer and the files it writes, each
against values written out by hand."""

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmlight.analysis.batches import batch_size, first_samples, map_batch
from mmlight.analysis.stats import HEAD_METRICS, LAYER_METRICS, Settings
from mmlight.commands import analyze
from mmlight.data.vocab import Vocab


def test_parse_args_defaults_and_the_rest_for_the_config_parser():
    args, rest = analyze.parse_args(["--config", "c.yaml", "--ckpt_path", "a.ckpt", "b.ckpt", "--out", "o"])
    assert rest == ["--config", "c.yaml"]
    assert args.ckpt_path == ["a.ckpt", "b.ckpt"] and args.out == "o"
    assert (args.num_samples, args.split, args.robustness, args.kv_skip_layers) == (256, "val", False, 2)
    assert (args.query_patch, args.sink_eps, args.keep_ratios) == (None, 3.0, [1.0, 0.9, 0.7, 0.5, 0.3, 0.1])
    args, rest = analyze.parse_args(["--config=c.yaml", "--ckpt_path", "a", "--out", "o", "--data.x", "1"])
    assert rest == ["--config=c.yaml", "--data.x", "1"]


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "--config CONFIG is required (the config the checkpoints were trained with)"),
        (["--config", "c", "--num_samples", "0"], "--num_samples must be >= 1, got 0"),
        (["--config", "c", "--kv_skip_layers", "-1"], "--kv_skip_layers must be >= 0, got -1"),
        (["--config", "c", "--keep_ratios", "1.5"], "--keep_ratios must each be in (0, 1], got [1.5]"),
        (["--config", "c", "--keep_ratios", "0.5", "0"], "--keep_ratios must each be in (0, 1], got [0.5, 0.0]"),
        (
            ["--config", "c", "--kv_calibrate", "--num_samples", "1"],
            "--kv_calibrate needs --num_samples >= 2 (two disjoint halves), got 1",
        ),
        *(
            (["--config", "c", f"--{name}", "0"], f"--{name} must be >= 1, got 0")
            for name in ("massive_top_k", "extrapolation_windows", "train_context", "position_bucket")
        ),
        (["--config", "c", "--multiples", "1", "0"], "--multiples must each be >= 1, got [1, 0]"),
    ],
)
def test_parse_args_refuses_each_bad_value_by_name(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        analyze.parse_args(["--ckpt_path", "a", "--out", "o", *extra])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"mmlight analyze: error: {message}"
    least = ["--num_samples", "1", "--kv_skip_layers", "0", "--multiples", "1"]
    least += [f"--{n}=1" for n in ("massive_top_k", "extrapolation_windows", "train_context", "position_bucket")]
    args, _ = analyze.parse_args(["--ckpt_path", "a", "--out", "o", "--config", "c", *least])  # each at its least
    assert (args.massive_top_k, args.extrapolation_windows, args.train_context, args.position_bucket) == (1, 1, 1, 1)
    args, _ = analyze.parse_args(
        ["--ckpt_path", "a", "--out", "o", "--config", "c", "--kv_calibrate", "--num_samples=2"]
    )
    assert args.kv_calibrate and args.num_samples == 2


def test_help_says_what_each_option_does_and_where_the_config_goes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        analyze.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    assert text.startswith("usage: mmlight analyze [-h] --ckpt_path CKPT_PATH [CKPT_PATH ...] --out OUT")
    for phrase in (
        "mmlight analyze: attention statistics, figures and robustness of trained checkpoints.",
        "--ckpt_path CKPT_PATH [CKPT_PATH ...] one or more checkpoints to compare",
        "--out OUT output folder (created)",
        "--num_samples NUM_SAMPLES the first N samples of the split (default 256)",
        "--split {val,test} which split (default val)",
        "--robustness also evaluate under sink masking and KV eviction",
        "--kv_skip_layers KV_SKIP_LAYERS KV eviction leaves the first this-many layers untouched (Devoto et al.: 2)",
        "--keep_ratios R [R ...] KV eviction: the keep ratios, each in (0, 1] (default 1 0.9 0.7 0.5 0.3 0.1)",
        "--query_patch QUERY_PATCH ViT: the query patch of the attention-map figure (default: the centre patch)",
        "--sink_eps SINK_EPS a key is a sink above this multiple of the uniform share (default 3)",
        "--config CONFIG (required) and --data.*/--trainer.* options go to the same parser as `mmlight fit`; "
        "the model comes from each checkpoint's own hyperparameters.",
    ):
        assert phrase in text, phrase
    # the description, between the usage and the options, is the module docstring's first paragraph alone
    first_paragraph = "mmlight analyze: attention statistics, figures and robustness of trained checkpoints."
    assert text.split(" options:", 1)[0].endswith(f"] {first_paragraph}")


@pytest.mark.parametrize("query_patch", [None, 0, 15])
def test_a_query_patch_inside_the_grid_is_accepted(query_patch):
    analyze.check_query_patch(query_patch, (2, 8))  # 2 x 8 patches: 0 .. 15
    analyze.check_query_patch(99, None)  # no image: nothing to check


@pytest.mark.parametrize("query_patch", [-1, 16, 64])
def test_a_query_patch_outside_the_grid_is_refused_naming_the_range(query_patch):
    with pytest.raises(analyze.AnalyzeError) as err:
        analyze.check_query_patch(query_patch, (2, 8))
    assert str(err.value) == f"--query_patch must be in [0, 16), got {query_patch}"


def test_a_task_without_what_analysis_needs_is_named_before_any_work(tmp_path, monkeypatch):
    """Lightning's BoringModel trains, but has no attention sites, metric or interventions to analyse."""
    import sys

    from mmlight.cli import main

    monkeypatch.setattr(sys, "argv", ["mmlight"])
    config = tmp_path / "boring.yaml"
    demos = "lightning.pytorch.demos.boring_classes"
    config.write_text(f"model:\n  class_path: {demos}.BoringModel\ndata:\n  class_path: {demos}.BoringDataModule\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "--config", str(config), "--ckpt_path", str(tmp_path / "x.ckpt"), "--out", str(out)])
    assert str(exit_info.value).startswith(
        "mmlight analyze: error: BoringModel lacks what attention analysis needs: task_metric, interventions, "
    )
    assert not out.exists()


def test_parse_args_refuses_a_checkpoint_named_twice_however_it_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        analyze.parse_args(["--config", "c", "--out", "o", "--ckpt_path", "a.ckpt", "b.ckpt", "runs/../b.ckpt"])
    assert exit_info.value.code == 2
    assert "--ckpt_path names runs/../b.ckpt more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # two files repeated: the first repeat is named
        analyze.parse_args(["--config", "c", "--out", "o", "--ckpt_path", "a.ckpt", "a.ckpt", "b.ckpt", "b.ckpt"])
    assert "--ckpt_path names a.ckpt more than once" in capsys.readouterr().err
    args, _ = analyze.parse_args(["--config", "c", "--out", "o", "--ckpt_path", "a.ckpt", "runs/a.ckpt"])
    assert args.ckpt_path == ["a.ckpt", "runs/a.ckpt"]


def test_run_labels_are_the_run_names_extended_only_where_they_repeat(tmp_path):
    def ckpt(*parts):
        return tmp_path.joinpath(*parts)

    runs = [
        ckpt("runs", "a", "version_0", "checkpoints", "last.ckpt"),
        ckpt("runs", "b", "version_0", "checkpoints", "last.ckpt"),
    ]
    assert analyze.run_labels(runs) == ["a", "b"]
    assert analyze.run_labels(runs[:1]) == ["a"]  # one checkpoint: its run name too
    versions = [
        ckpt("runs", "a", "version_0", "checkpoints", "last.ckpt"),
        ckpt("runs", "a", "version_1", "checkpoints", "last.ckpt"),
    ]
    assert analyze.run_labels(versions) == ["a/version_0", "a/version_1"]
    files = [ckpt("runs", "a", "version_0", "checkpoints", n) for n in ("last.ckpt", "best.ckpt")]
    assert analyze.run_labels(files) == ["a/version_0/last", "a/version_0/best"]
    loose = [ckpt("x", "m.ckpt"), ckpt("y", "m.ckpt")]  # not under checkpoints/: folder, then file stem
    assert analyze.run_labels(loose) == ["x", "y"]
    assert analyze.run_labels([ckpt("x", "m.ckpt"), ckpt("x", "n.ckpt")]) == ["x/m", "x/n"]
    same = [ckpt("x", "m.ckpt"), ckpt("x", "m.ckpt")]  # nothing tells them apart: the paths
    assert analyze.run_labels(same) == [str(p) for p in same]


def network(**config):
    """A stand-in task whose network (it names its attention sites) has a config with ``config``."""
    return SimpleNamespace(model=SimpleNamespace(attention_sites=dict, config=SimpleNamespace(**config)))


def test_check_fits_data_compares_vocabulary_and_classes(tmp_path):
    task = network(vocab_size=20, num_classes=None)
    analyze.check_fits_data(task, SimpleNamespace(vocab_size=20), tmp_path / "a.ckpt")
    analyze.check_fits_data(task, SimpleNamespace(num_classes=10), tmp_path / "a.ckpt")  # the model says none
    analyze.check_fits_data(
        SimpleNamespace(model=SimpleNamespace(attention_sites=dict)), SimpleNamespace(vocab_size=3), tmp_path
    )
    with pytest.raises(analyze.AnalyzeError) as err:
        analyze.check_fits_data(task, SimpleNamespace(vocab_size=21), tmp_path / "a.ckpt")
    assert str(err.value) == f"checkpoint {tmp_path / 'a.ckpt'} has vocab_size=20 but the data has 21"
    classes = network(num_classes=5)
    with pytest.raises(analyze.AnalyzeError, match="has num_classes=5 but the data has 10$"):
        analyze.check_fits_data(classes, SimpleNamespace(num_classes=10), tmp_path)


def test_vocabulary_is_the_datas_token_list_or_none():
    tokens = ["<s>", "<pad>", "</s>", "<unk>", "a", "b"]
    assert analyze.vocabulary(SimpleNamespace(vocab=Vocab(tokens))) == tokens
    assert analyze.vocabulary(SimpleNamespace(vocab=tuple(tokens))) is None  # untyped: no labels, not wrong ones
    assert analyze.vocabulary(SimpleNamespace()) is None

    class Unprepared:
        @property
        def vocab(self):
            raise FileNotFoundError("dict.txt")

    assert analyze.vocabulary(Unprepared()) is None


def test_the_evaluation_trainer_keeps_only_the_configs_evaluation_settings():
    trainer = analyze.eval_trainer(
        {
            "accelerator": "cpu",
            "precision": "bf16-mixed",
            "limit_val_batches": 3,
            "max_epochs": 7,
            "deterministic": None,
        }
    )
    assert trainer.num_devices == 1 and trainer.num_nodes == 1 and trainer.logger is None
    assert trainer.precision == "bf16-mixed" and trainer.limit_val_batches == 3
    assert trainer.max_epochs != 7 and trainer.checkpoint_callback is None and not trainer.progress_bar_callback


def stats_of(values: dict[str, list], similarity: list) -> dict:
    """A hand-built ``collect_statistics`` result: layer values per site, and blocks' token similarity."""
    sites = {}
    for i, layer_values in enumerate(zip(*values.values())):
        metrics = dict(zip(values, layer_values))
        # one head, whose value is 100 above the layer's (so that a mean mixing them shows)
        heads = {m: [None if metrics.get(m) is None else metrics[m] + 100] for m in HEAD_METRICS}
        sites[f"blocks.{i}"] = {"heads": heads, "metrics": metrics}
    return {"sites": sites, "blocks": {f"blocks.{i}": {"token_similarity": v} for i, v in enumerate(similarity)}}


def test_layer_means_average_each_metric_over_the_layers_that_have_it():
    values = {m: [1.0, 2.0] for m in HEAD_METRICS}
    values["entropy"] = [0.5, None]  # a layer without a value is left out, not counted as 0
    values["sink_ratio"] = [0.25, 0.75]
    means = analyze.layer_means(stats_of(values, [0.2, 0.6]))
    assert means["entropy"] == 0.5 and means["max_weight"] == 1.5 and means["sink_ratio"] == 0.5
    assert means["token_similarity"] == pytest.approx(0.4, abs=0, rel=1e-15)
    assert math.isnan(means["rollout_discrepancy"]) and math.isnan(means["zero_mass_rows"])
    assert list(means) == list(HEAD_METRICS + LAYER_METRICS)


def test_the_files_written_hold_every_row_the_meta_and_the_summary_table(tmp_path):
    values = {m: [0.125, 0.375] for m in HEAD_METRICS}
    results = {
        "run_a": stats_of(values, [0.5, None]),
        "run_b": stats_of({**values, "entropy": [1.0, 3.0]}, [0.25, 0.25]),
    }
    meta = {"num_samples": 8, "split": "val", "settings": Settings().__dict__, "keep_ratios": [0.5]}
    analyze.write_stats(tmp_path, results, meta)
    with open(tmp_path / "stats.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["checkpoint", "layer", "head", "metric", "value"]
    per_run = 2 * 2 * len(HEAD_METRICS) + 2  # two sites, a head row and a layer row per metric; two blocks
    assert len(rows) == 1 + 2 * per_run
    assert ["run_a", "blocks.0", "0", "entropy", "100.125"] in rows and [
        "run_a",
        "blocks.0",
        "",
        "entropy",
        "0.125",
    ] in rows
    assert ["run_a", "blocks.1", "", "token_similarity", ""] in rows  # None is written as an empty cell
    payload = json.loads((tmp_path / "stats.json").read_text())
    assert payload["num_samples"] == 8 and payload["keep_ratios"] == [0.5] and payload["details"] == results
    assert payload["rows"][0] == {
        "checkpoint": "run_a",
        "layer": "blocks.0",
        "head": 0,
        "metric": "entropy",
        "value": 100.125,
    }
    assert len(payload["rows"]) == 2 * per_run
    assert payload["thresholds"] == {
        "multimodality": "keys with score > row mean + eps_multimodality (and < the row max)",
        "sparsity": "keys with score < row mean + eps_sparsity; s = smallest softmax probability of the row",
        "frac_below_1e-3": 0.001,
        "gate_below_0.1": "fraction of gate values below 0.1 (gated attention)",
        "sink_ratio": "fraction of key positions whose mean incoming attention exceeds 3.0 x the uniform share "
        "(ratio form)",
    }
    assert (tmp_path / "stats.json").read_text().startswith('{\n "num_samples": 8,\n')  # indented, one key a line
    (tmp_path / "nan").mkdir()
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):  # strict JSON
        analyze.write_stats(tmp_path / "nan", results, {**meta, "num_samples": math.nan})

    robustness = [("run_a", "none", 0, "top1", 0.875), ("run_a", "kv_l2", 0.5, "top1", 0.5)]
    analyze.write_summary(tmp_path, results, meta, ["fig.png"], robustness)
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert lines[0] == "# Attention analysis: 8 val samples"
    assert lines[2] == (
        "Thresholds: M above the row mean score + 0.0, S below the row mean + 0.0; near zero < 0.001; sinks above "
        "3.0 x the uniform share. Values are means over layers (all attention kinds together; stats.csv has each "
        "layer)."
    )
    columns = HEAD_METRICS + LAYER_METRICS
    assert lines[4] == "| checkpoint | " + " | ".join(columns) + " |"
    assert lines[5] == "|---" * (len(columns) + 1) + "|"
    cells = dict(zip(columns, lines[7].strip("| ").split(" | ")[1:]))
    assert lines[7].startswith("| run_b | ") and cells["entropy"] == "2" and cells["token_similarity"] == "0.25"
    assert dict(zip(columns, lines[6].split(" | ")[1:]))["token_similarity"] == "0.5"
    assert "| run_a | kv_l2 | 0.5 | top1 | 0.5 |" in lines and "| run_a | none | 0 | top1 | 0.875 |" in lines
    assert lines[-1] == "- [fig.png](fig.png)" and "## Robustness (whole split)" in lines
    analyze.write_summary(tmp_path, results, meta, [], [])
    assert "## Robustness (whole split)" not in (tmp_path / "summary.md").read_text()


def test_batches_their_size_a_map_over_their_tensors_and_the_first_samples():
    images, labels = torch.arange(12.0).view(6, 2), torch.arange(6)
    assert batch_size((images, labels)) == 6 and batch_size({"id": 3, "input": images[:4]}) == 4
    named = next(iter(torch.utils.data.DataLoader([(image, f"{i}.JPEG") for i, image in enumerate(images)], 4)))
    assert named[1] == ("0.JPEG", "1.JPEG", "2.JPEG", "3.JPEG") and batch_size(named) == 4  # the first item's size
    doubled = map_batch({"a": (images, [labels, "name"]), "n": 1}, lambda t: t * 2)
    assert torch.equal(doubled["a"][0], images * 2) and torch.equal(doubled["a"][1][0], labels * 2)
    assert doubled["a"][1][1] == "name" and doubled["n"] == 1 and isinstance(doubled["a"], tuple)
    loader = [(images[:0], labels[:0]), (images[:4], labels[:4]), (images[4:], labels[4:])]  # an empty batch first
    taken = first_samples(loader, 5, "val")
    assert [batch_size(b) for b in taken] == [4, 1]
    assert torch.equal(torch.cat([b[1] for b in taken]), labels[:5])
    assert [batch_size(b) for b in first_samples(loader, 6, "val")] == [4, 2]
    with pytest.raises(ValueError) as err:
        first_samples(loader, 7, "test")
    assert str(err.value) == "--num_samples 7 is larger than the test split, which has 6 samples"


def test_a_missing_or_foreign_checkpoint_is_named(tmp_path):
    with pytest.raises(analyze.AnalyzeError) as err:
        analyze.load_checkpoint(None, tmp_path / "none.ckpt")
    assert str(err.value) == f"checkpoint {tmp_path / 'none.ckpt'} does not exist"
    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}}, path)

    class Task:
        @classmethod
        def load_from_checkpoint(cls, p, map_location):
            assert (Path(p), map_location) == (path, "cpu")
            raise KeyError("hyper_parameters")

    with pytest.raises(analyze.AnalyzeError) as err:
        analyze.load_checkpoint(Task, path)
    assert str(err.value) == f"checkpoint {path} does not match the config's model Task: 'hyper_parameters'"


def test_summary_md_whole(tmp_path):
    """summary.md of one run, character for character: each head metric averages 0.25 and 0.75 over its
    two layers, the token similarity 0.5 and 0.25; the layer metrics without values show nan."""
    results = {"run": stats_of({m: [0.25, 0.75] for m in HEAD_METRICS}, [0.5, 0.25])}
    meta = {"num_samples": 4, "split": "test", "settings": Settings(sink_eps=2.5).__dict__}
    robustness = [("run", "none", 0, "bleu", 21.5), ("run", "kv_l2", 0.5, "bleu", 20.125)]
    analyze.write_summary(tmp_path, results, meta, ["a.png", "b.png"], robustness)
    columns = (
        "entropy | normalized_entropy | multimodality | sparsity | frac_below_1e-3 | frac_zero | max_weight | "
        "null_mass | frac_zero_mass | token_similarity | rollout_discrepancy | sink_ratio | zero_mass_rows"
    )
    assert (tmp_path / "summary.md").read_text() == (
        "# Attention analysis: 4 test samples\n"
        "\n"
        "Thresholds: M above the row mean score + 0.0, S below the row mean + 0.0; near zero < 0.001; sinks above "
        "2.5 x the uniform share. Values are means over layers (all attention kinds together; stats.csv has each "
        "layer).\n"
        "\n"
        f"| checkpoint | {columns} |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| run | 0.5 | 0.5 | 0.5 | 0.5 | 0.5 | 0.5 | 0.5 | 0.5 | 0.5 | 0.375 | nan | nan | nan |\n"
        "\n"
        "## Robustness (whole split)\n"
        "\n"
        "| checkpoint | intervention | level | metric | value |\n"
        "|---|---|---|---|---|\n"
        "| run | none | 0 | bleu | 21.5 |\n"
        "| run | kv_l2 | 0.5 | bleu | 20.12 |\n"
        "\n"
        "## Figures\n"
        "\n"
        "- [a.png](a.png)\n"
        "- [b.png](b.png)\n"
    )


def test_summary_md_pools_the_kv_attention_loss_rows_and_lists_the_key_norm_correlations(tmp_path):
    """The KV and key-norm sections of summary.md, character for character: of the attention losses only
    the rows pooled over layers (``"all"``), the method without its ``kv_`` prefix, both ratio conventions,
    4 significant digits and an em dash for a mean over no row; each key-norm row as given. Neither
    section without its rows."""
    results = {"run": stats_of({m: [0.25, 0.75] for m in HEAD_METRICS}, [0.5, 0.25])}
    meta = {"num_samples": 4, "split": "val", "settings": Settings().__dict__}
    losses = [
        ("run", "kv_l2", 0.5, 0.5, 2, 30, 0.9, 0.8),  # one layer's: in kv_attention_loss.csv only
        ("run", "kv_l2", 0.5, 0.5, "all", 60, 0.123456, 0.0625),
        ("run", "kv_streaming", 0.1, 0.9, "all", 0, None, None),
    ]
    key_norms = [
        ("run", "decoder.layers.1.self_attn", 120, -0.4321, 0.25),
        ("run", "decoder.layers.2.self_attn", 0, None, None),
    ]
    analyze.write_summary(tmp_path, results, meta, [], [], losses, key_norms)
    text = (tmp_path / "summary.md").read_text()
    assert text.split("\n\n## Figures")[0].split(" | nan |\n\n")[-1] == (
        "## KV eviction: attention loss (whole split, pooled over the evicted layers)\n"
        "\n"
        "Keep ratio r; compression ratio 1 - r (the fraction dropped). Attention loss: the mean share of a query "
        "row's attention mass on the pairs dropped; oracle: the least possible at the same budget on the same "
        "calls. Each layer's values: kv_attention_loss.csv.\n"
        "\n"
        "| checkpoint | method | keep ratio | compression ratio | attention loss | oracle |\n"
        "|---|---|---|---|---|---|\n"
        "| run | l2 | 0.5 | 0.5 | 0.1235 | 0.0625 |\n"
        "| run | streaming | 0.1 | 0.9 | — | — |\n"
        "\n"
        "## Key norm against received attention (4 val samples)\n"
        "\n"
        "Pairs (key L2 norm, mean attention from the later queries that see the key) over samples and heads.\n"
        "\n"
        "| checkpoint | layer | pairs | Pearson | Spearman |\n"
        "|---|---|---|---|---|\n"
        "| run | decoder.layers.1.self_attn | 120 | -0.4321 | 0.25 |\n"
        "| run | decoder.layers.2.self_attn | 0 | — | — |"
    )
    analyze.write_summary(tmp_path, results, meta, [], [], losses[:1])
    text = (tmp_path / "summary.md").read_text()
    assert "KV eviction" not in text and "Key norm" not in text


def test_the_docs_state_the_defaults_of_the_language_model_analyses():
    """docs/analysis.md states these defaults in prose; they are the code's."""
    from mmlight.analysis.extrapolation import MULTIPLES
    from mmlight.analysis.massive import MassiveSettings

    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "analysis.md").read_text().split())
    args, _ = analyze.parse_args(["--config", "c.yaml", "--ckpt_path", "a.ckpt", "--out", "o"])
    assert f"(`--multiples`, default {' '.join(map(str, MULTIPLES))})" in doc and args.multiples == list(MULTIPLES)
    assert args.extrapolation_windows == 4 and "(default L/4, rounded up;" in doc
    settings = MassiveSettings()
    assert args.massive_top_k == settings.top_k
    assert f"|h| above {settings.min_magnitude:g} and above {settings.min_ratio:g} × the sample's median" in doc


# ------------------------------------------------------------------ --extrapolation's inputs


class StreamData:
    """A DataModule stand-in for ``--extrapolation``: ``rows`` val sequences of ``length`` tokens (ids
    from 3 up, so none is padding), with the given ``block_size``/``seq_len`` attributes."""

    def __init__(self, rows: int = 4, length: int = 6, **attrs):
        self.batch = {
            "input": torch.arange(3, 3 + rows * length).view(rows, length),
            "target": torch.arange(4, 4 + rows * length).view(rows, length),
            "loss_mask": torch.ones(rows, length, dtype=torch.bool),
        }
        self.__dict__.update(attrs)

    def prepare_data(self):
        pass

    def setup(self, stage):
        pass

    def val_dataloader(self):
        return [self.batch]

    def on_after_batch_transfer(self, batch, index):
        return batch


def extrapolation_args(**fields) -> SimpleNamespace:
    base = {"train_context": None, "extrapolation_windows": 2, "multiples": [1, 2], "split": "val", "ckpt_path": ["a"]}
    return SimpleNamespace(**{**base, **fields})


def test_the_training_context_is_the_option_then_block_size_then_seq_len_else_an_error():
    args = extrapolation_args()
    assert analyze.training_context(extrapolation_args(train_context=7), StreamData(block_size=5)) == 7
    assert analyze.training_context(args, StreamData(block_size=5, seq_len=9)) == 5
    assert analyze.training_context(args, StreamData(block_size=0, seq_len=9)) == 9  # not a length: passed over
    assert analyze.training_context(args, StreamData(block_size=1, seq_len=9)) == 1
    assert analyze.training_context(args, StreamData(block_size="5", seq_len=9)) == 9
    with pytest.raises(analyze.AnalyzeError) as refused:
        analyze.training_context(args, StreamData(seq_len=None))
    assert str(refused.value) == (
        "--extrapolation needs the training context: StreamData has no block_size or seq_len, give --train_context N"
    )


def test_the_extrapolation_inputs_are_the_stream_of_the_windows_asked_for_or_a_refusal_by_size_or_task():
    from mmlight.tasks import LanguageModel, Translator
    from tests.helpers.models import tiny_transformer

    lm = LanguageModel(tiny_transformer(vocab_size=40))
    data = StreamData(rows=4, length=6, block_size=3)  # 24 positions; 2 windows of 2 x 3 need 12
    stream, context = analyze.extrapolation_inputs(extrapolation_args(), data, [lm])
    assert context == 3 and len(stream) == 12
    assert stream.inputs.tolist() == list(range(3, 15)) and stream.targets.tolist() == list(range(4, 16))
    stream, _ = analyze.extrapolation_inputs(extrapolation_args(extrapolation_windows=4, multiples=[2]), data, [lm])
    assert len(stream) == 24  # the whole split, exactly
    with pytest.raises(analyze.AnalyzeError) as refused:
        analyze.extrapolation_inputs(extrapolation_args(extrapolation_windows=3, multiples=[1, 3]), data, [lm])
    assert str(refused.value) == (
        "--extrapolation: 3 window(s) of 3 x 3 tokens need 27 positions, and the val split holds 24: lower "
        "--extrapolation_windows or --multiples"
    )
    translator = Translator(tiny_transformer(n_encoder_layers=1))
    with pytest.raises(analyze.AnalyzeError) as refused:
        analyze.extrapolation_inputs(extrapolation_args(ckpt_path=["lm.ckpt", "nmt.ckpt"]), data, [lm, translator])
    assert str(refused.value) == "--extrapolation needs a language model; nmt.ckpt holds a Translator"


@pytest.mark.parametrize("sinusoidal, expected", [(False, 12 + 6 + 3), (True, 12 + 6 + 3 + 1)])
def test_the_windows_counted_for_the_bar_are_those_of_each_multiple_the_position_table_holds(sinusoidal, expected):
    """100 positions, context 8: 12, 6, 3 and 1 windows of 1x, 2x, 4x and 8x; a learned table of 32
    positions holds up to 4x (32), sinusoidal positions hold every multiple."""
    from mmlight.tasks import LanguageModel
    from tests.helpers.models import tiny_transformer

    task = LanguageModel(tiny_transformer(max_positions=32, sinusoidal_positions=sinusoidal))
    args = extrapolation_args(multiples=[1, 2, 4, 8])
    assert analyze.extrapolation_windows(args, task, 100, 8) == expected
    assert analyze.extrapolation_windows(extrapolation_args(multiples=[4]), task, 31, 8) == 0


def test_each_undefined_multiple_is_said_with_its_reason_in_order():
    result = {
        "multiples": {
            1: {"defined": True},
            4: {"defined": False, "reason": "the table holds 64 positions"},
            8: {"defined": False, "reason": "too long"},
        }
    }
    assert analyze.undefined_multiples(result) == [
        "4x not evaluated: the table holds 64 positions",
        "8x not evaluated: too long",
    ]
    assert analyze.undefined_multiples({"multiples": {2: {"defined": True}}}) == []


def test_each_top_token_is_spelled_from_the_vocabulary_where_it_is_in_it():
    def top(*tokens):
        return {"top": [{"token": t} for t in tokens]}

    result = {"blocks": {"b0": top(0, 2, 3), "b1": top(None, 1)}}
    assert analyze.with_token_text(result, ["a", "b", "c"]) is result
    assert [[t["token_text"] for t in e["top"]] for e in result["blocks"].values()] == [["a", "c", None], [None, "b"]]
    analyze.with_token_text(result, None)
    assert [t["token_text"] for e in result["blocks"].values() for t in e["top"]] == [None] * 5


def lm_results():
    """A massive-activations and an extrapolation result of one checkpoint, written out by hand."""
    top = {"position": 0, "token": 7, "token_text": None, "dim": 3, "value": 812.5}
    massive = {
        "blocks": {
            "layers.0": {"median": 0.5, "top_mean": [2.0], "ratio": 4.0, "massive": 0, "top": []},
            "layers.1": {"median": 0.25, "top_mean": [600.0], "ratio": 2400.0, "massive": 3, "top": [top]},
            "layers.2": {"median": None, "top_mean": [], "ratio": None, "massive": 0, "top": []},
        }
    }
    buckets = [{"start": 0, "stop": 2, "count": 2, "ppl": 3.0}]
    extrapolation = {
        "positions": 96,
        "context": 4,
        "multiples": {
            1: {"defined": True, "length": 4, "count": 20, "ppl": 3.5, "buckets": buckets},
            2: {"defined": False, "length": 8, "reason": "past the table"},
        },
    }
    return massive, extrapolation


def test_the_lm_analyses_files_hold_each_checkpoint_s_rows(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(analyze.figures, "save", lambda fig, out, name: saved.append((fig, out)) or name)
    massive, extrapolation = lm_results()
    assert analyze.write_lm_analyses(tmp_path, {"run": massive}, {}) == ["massive_activations.png"]
    assert not (tmp_path / "extrapolation.csv").exists()
    rows = list(csv.reader((tmp_path / "massive_activations.csv").open()))
    assert rows[0] == ["checkpoint", "block", "metric", "value"]
    assert rows[1:5] == [
        ["run", "layers.0", "median", "0.5"],
        ["run", "layers.0", "top1", "2.0"],
        ["run", "layers.0", "ratio", "4.0"],
        ["run", "layers.0", "massive", "0"],
    ]
    assert rows[-3:] == [
        ["run", "layers.2", "median", ""],
        ["run", "layers.2", "ratio", ""],
        ["run", "layers.2", "massive", "0"],
    ]
    written = analyze.write_lm_analyses(tmp_path, {"run": massive}, {"run": extrapolation})
    assert written == ["massive_activations.png", "length_extrapolation.png"]
    assert len(saved) == 3 and all(isinstance(fig, Figure) and out == tmp_path for fig, out in saved)
    assert list(csv.reader((tmp_path / "extrapolation.csv").open())) == [
        ["checkpoint", "multiple", "length", "part", "start", "stop", "count", "ppl"],
        ["run", "1", "4", "window", "0", "4", "20", "3.5"],
        ["run", "1", "4", "bucket", "0", "2", "2", "3.0"],
        ["run", "2", "8", "window", "0", "8", "", ""],
    ]


def test_the_summary_names_each_checkpoint_s_most_massive_block_and_its_perplexity_per_multiple():
    massive, extrapolation = lm_results()
    lines = analyze.lm_summary({"massive_activations": {"run": massive}, "extrapolation": {"run": extrapolation}})
    assert lines == [
        "",
        "## Massive activations (block outputs)",
        "",
        "Per checkpoint, the block whose largest |h| is the most times its sample's median (mean over samples), "
        "and the largest entry of that block over all samples.",
        "",
        "| checkpoint | block | median | top 1 | ratio | massive | largest: position, token, dim, value |",
        "|---|---|---|---|---|---|---|",
        "| run | layers.1 | 0.25 | 600 | 2400 | 3 | 0, 7, 3, 812.5 |",  # no token text: the id
        "",
        "## Length extrapolation (96 positions, training context 4)",
        "",
        "Perplexity over the same scored tokens, cut into windows of each multiple of the training context "
        "(—: past the model's learned position table).",
        "",
        "| checkpoint | 1x | 2x |",
        "|---|---|---|",
        "| run | 3.5 | — |",
    ]
    massive["blocks"]["layers.1"]["top"][0]["token_text"] = "the"
    for name in ("layers.0", "layers.1"):
        massive["blocks"][name]["ratio"] = None  # no ratio anywhere: the first block, without a top entry
    (row,) = [
        line for line in analyze.lm_summary({"massive_activations": {"run": massive}}) if line.startswith("| run")
    ]
    assert row == "| run | layers.0 | 0.5 | 2 | — | 0 | - |"
    empty = massive["blocks"]["layers.2"]  # no median, no top entry, no ratio
    flat = {"median": 1.0, "top_mean": [1.0], "ratio": 1.0, "massive": 0, "top": []}  # the least a ratio can be

    def row_of(blocks):
        (row,) = [
            line for line in analyze.lm_summary({"massive_activations": {"run": {"blocks": blocks}}}) if "| run" in line
        ]
        return row

    assert row_of({"layers.2": empty, "layers.3": flat}) == "| run | layers.3 | 1 | 1 | 1 | 0 | - |"
    assert row_of({"layers.2": empty}) == "| run | layers.2 | — | — | — | 0 | - |"
    assert analyze.lm_summary({}) == []


class Unsafe:
    """An object a weights-only load refuses to build."""


def test_the_qfilters_are_read_from_beside_the_checkpoint_with_a_weights_only_load(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    assert analyze.filters_path(ckpt) == tmp_path / "run.ckpt.qfilters.pt"
    assert analyze.kv_options(["l2", "random"], ckpt) == {}  # no qfilters asked for: no file read
    filters = torch.arange(12.0).view(1, 2, 6)
    torch.save({"filters": filters, "cosine": torch.ones(1, 2)}, analyze.filters_path(ckpt))
    options = analyze.kv_options(["l2", "qfilters"], str(ckpt))
    assert list(options) == ["qfilters"] and list(options["qfilters"]) == ["filters"]
    assert torch.equal(options["qfilters"]["filters"], filters)
    torch.save({"filters": filters, "extra": Unsafe()}, analyze.filters_path(ckpt))
    with pytest.raises(Exception, match="Weights only load failed"):
        analyze.kv_options(["qfilters"], ckpt)


def test_calibration_saves_the_filters_beside_the_checkpoint_and_summarises_their_stability(tmp_path, monkeypatch):
    cosine = torch.tensor([[0.5, 1.0], [0.25, 0.75]])  # (layers, KV heads)
    result = {"filters": torch.ones(2, 2, 4), "cosine": cosine, "num_sequences": 6}
    seen = []
    monkeypatch.setattr(analyze, "calibrate_qfilters", lambda task, batches: seen.append((task, batches)) or result)
    ckpt = tmp_path / "run.ckpt"
    summary = analyze.calibrated("task", ["batch"], ckpt)
    assert seen == [("task", ["batch"])]
    assert summary == {
        "file": str(tmp_path / "run.ckpt.qfilters.pt"),
        "num_sequences": 6,
        "halves": "the first and the second half of the sequences (disjoint)",
        "cosine": [[0.5, 1.0], [0.25, 0.75]],
        "cosine_mean": 0.625,
        "cosine_min": 0.25,
    }
    saved = torch.load(tmp_path / "run.ckpt.qfilters.pt", weights_only=True)
    assert saved.keys() == result.keys() and torch.equal(saved["cosine"], cosine) and saved["num_sequences"] == 6


def test_key_norm_rows_are_one_per_checkpoint_and_layer_with_an_undefined_coefficient_empty():
    entry = {"pairs": 12, "pearson": 0.25, "spearman": math.nan}
    rows = analyze.key_norm_rows({"a": {"layers.0": entry, "layers.1": {**entry, "pearson": -1.0}}, "b": {}})
    assert rows == [("a", "layers.0", 12, 0.25, None), ("a", "layers.1", 12, -1.0, None)]


def test_robustness_json_holds_the_settings_both_row_kinds_and_what_the_losses_mean(tmp_path):
    meta = {
        "split": "val",
        "kv_skip_layers": 2,
        "keep_ratios": [1.0, 0.5],
        "compression_ratios": [0.0, 0.5],
        "kv_methods": ["l2"],
        "num_samples": 4,  # not a robustness setting: left out
    }
    robustness = [("run", "kv_l2", 0.5, "ppl", 12.5)]
    losses = [("run", "kv_l2", 0.5, 0.5, "all", 30, 0.125, 0.0625)]
    analyze.write_robustness_json(tmp_path, meta, robustness, losses)
    payload = json.loads((tmp_path / "robustness.json").read_text())
    assert payload == {
        "split": "val",
        "kv_skip_layers": 2,
        "keep_ratios": [1.0, 0.5],
        "compression_ratios": [0.0, 0.5],
        "kv_methods": ["l2"],
        "attention_loss": "per counted query row, the share of its full attention mass on the past keys the "
        "method dropped (Devoto thesis, Eq. 4.5), averaged over rows; oracle_loss: the same for the keys the "
        "row itself weighs least, at the same budget on the same calls (the least possible)",
        "rows": [{"checkpoint": "run", "intervention": "kv_l2", "level": 0.5, "metric": "ppl", "value": 12.5}],
        "attention_losses": [
            {
                "checkpoint": "run",
                "intervention": "kv_l2",
                "keep_ratio": 0.5,
                "compression_ratio": 0.5,
                "layer": "all",
                "rows": 30,
                "attention_loss": 0.125,
                "oracle_loss": 0.0625,
            }
        ],
    }


def test_robustness_json_is_strict_json_one_space_indented(tmp_path):
    meta = {"split": "val", "kv_skip_layers": 0, "keep_ratios": [1.0], "compression_ratios": [0.0], "kv_methods": []}
    analyze.write_robustness_json(tmp_path, meta, [], [])
    assert (tmp_path / "robustness.json").read_text().startswith('{\n "split": "val",\n "kv_skip_layers": 0,')
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        analyze.write_robustness_json(tmp_path, meta, [("run", "none", 0, "ppl", math.nan)], [])


def test_kv_options_are_refused_before_any_work_when_eviction_would_change_nothing_or_lacks_filters(tmp_path):
    """A 2-layer LM: skipping 2 layers leaves none to evict; qfilters need CKPT.qfilters.pt beside every
    checkpoint, or --kv_calibrate. Without --robustness, or for a task that evicts nothing, nothing is checked."""
    from mmlight.tasks import LanguageModel
    from tests.helpers.models import tiny_transformer

    task = LanguageModel(tiny_transformer())
    first, second = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    torch.save({"filters": torch.zeros(2, 2, 8)}, analyze.filters_path(first))

    def check(**fields):
        base = {
            "robustness": True,
            "kv_skip_layers": 1,
            "keep_ratios": [0.5],
            "kv_methods": ["l2"],
            "kv_calibrate": False,
        }
        analyze.check_kv_options(SimpleNamespace(**{**base, **fields}), task, [first, second])

    check()
    check(kv_methods=["l2", "qfilters"], kv_calibrate=True)  # calibrated now: the files are written then
    with pytest.raises(analyze.AnalyzeError) as refused:
        check(kv_skip_layers=2)
    assert str(refused.value) == (
        "--kv_skip_layers 2 leaves no layer to evict in: the decoder self-attention has layers [0, 1]; "
        "pass --kv_skip_layers 1 or less"
    )
    with pytest.raises(analyze.AnalyzeError) as refused:
        check(kv_methods=["qfilters"])
    assert str(refused.value) == (
        f"--kv_methods qfilters needs {tmp_path / 'b.ckpt.qfilters.pt'}: add --kv_calibrate (now or earlier)"
    )
    check(robustness=False, kv_skip_layers=2, kv_methods=["qfilters"])
    analyze.check_kv_options(
        SimpleNamespace(robustness=True, kv_skip_layers=9, kv_methods=["qfilters"], kv_calibrate=False),
        SimpleNamespace(interventions=("sink_masking",)),
        [second],
    )
