"""Table files: every table of the paper parses, has the expected runs, and each cell's command is
accepted by the mmlight config parser; bad table files stop with a message naming the key."""

import json
import re
import sys
from pathlib import Path
from unittest import mock

import pytest

from mmlight.commands import sweep
from mmlight.experiments.table import TableError, load_table, override_args, read_metrics, read_status, write_status
from mmlight.lightning_cli import MmlightCLI, build_cli
from mmlight.models import ReweightingSpec

ROOT = Path(__file__).resolve().parents[2]
TABLES = sorted((ROOT / "configs" / "tables").glob("*.yaml"))
EXPECTED_RUNS = {
    "table1": 12,
    "table2": 12,
    "table3": 3,
    "table4": 15,
    "table5": 4,
    "table6": 6,
    "cpu_reweighting": 90,
    "tiny": 4,
    "cpu_sinks": 105,
    "iwslt14_sinks": 24,
    "wikitext103_sinks": 9,
    "finetune_cifar100": 12,
    "llm_124m": 16,
    "cpu_kv_eviction": 55,
    "cpu_llm": 80,
}


def test_every_table_file_is_known():
    assert {path.stem for path in TABLES} == set(EXPECTED_RUNS)


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_dry_run_lists_every_run(path, capsys, tmp_path):
    sweep.main([str(path), "--dry_run", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    n = EXPECTED_RUNS[path.stem]
    assert out.rstrip().endswith(f"{n} runs")
    listed = [line for line in out.splitlines() if line.startswith("[")]
    assert len(listed) == n and all("(missing)" in line for line in listed)
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("mmlight fit")]
    assert len(commands) == n and len(set(commands)) == n  # one distinct command per run
    table = load_table(path)
    folders = {str(run.directory) for run in table.runs(tmp_path)}
    assert len(folders) == n and all(folder in out for folder in folders)


def parsed_config(args: list[str]):
    """The namespace LightningCLI builds from ``mmlight fit ARGS``, without building the classes."""
    with (
        mock.patch.object(MmlightCLI, "instantiate_classes", lambda self: None),
        mock.patch.object(sys, "argv", ["mmlight"]),
    ):
        return build_cli(args, run=False).config


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_each_cell_parses_and_builds_its_reweighting(path, tmp_path):
    """Each cell's overrides are valid config keys and values, and its reweighting options are
    accepted by the function (checked when the model is built, so build that part here)."""
    table = load_table(path)
    for run in table.runs(tmp_path)[:: len(table.seeds)]:  # one seed per cell: seeds parse alike
        args = run.fit_args()
        assert args[0] == "fit" and args[-2:] == ["--ckpt_path", "last"]
        config = parsed_config(args[1:-2])
        assert config.seed_everything == run.seed
        assert config.trainer.logger.init_args.version == "fit"
        model = config.model.init_args.model
        ReweightingSpec(model.attention.name, model.attention.options).build("reference")
        if "model.init_args.model.attention" in run.cell.overrides:
            assert model.attention.name == run.cell.overrides["model.init_args.model.attention"]["name"]


def test_table5_rows_are_the_ablation():
    cells = {cell.name: cell.overrides for cell in load_table(ROOT / "configs/tables/table5.yaml").cells}
    attention = {name: o.get("model.init_args.model.attention", {"name": "softmax"}) for name, o in cells.items()}
    assert attention["softmax"]["name"] == "softmax"
    assert attention["term1"]["options"] == {"order": 1, "terms": "low"}
    assert attention["terms12"]["options"] == {"order": 1}
    assert attention["second_order"]["options"] == {"order": 2}


def write(tmp_path, text: str) -> Path:
    (tmp_path / "base.yaml").write_text("seed_everything: 0\n")
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, match",
    [
        ("config: base.yaml\nmetric: acc\ncells: {a: {}}\n", r"metric must be a logged val/\* or test/\*"),
        (
            "config: base.yaml\nmetric: val/acc\ncheckpoint: best_ever\ncells: {a: {}}\n",
            "checkpoint must be 'best' or 'last'",
        ),
        (
            "config: base.yaml\nmetric: val/acc\nseeds: [0, 0]\ncells: {a: {}}\n",
            "seeds must be a non-empty list of distinct",
        ),
        ("config: base.yaml\nmetric: val/acc\ncells: {}\n", "cells must be a non-empty mapping"),
        ("config: missing.yaml\nmetric: val/acc\ncells: {a: {}}\n", "base config 'missing.yaml' not found"),
        ("config: base.yaml\nmetric: val/acc\ncels: {a: {}}\n", r"unknown key\(s\) \['cels'\]"),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {a: {overides: {}}}\n",
            r"cell 'a' has unknown key\(s\) \['overides'\]",
        ),
        ("config: base.yaml\nmetric: val/acc\ncells: {a: {overrides: {--x: 1}}}\n", "dotted config keys"),
        ("config: base.yaml\nmetric: val/acc\ncells: {a: {paper: high}}\n", "paper must be a finite number"),
        ("config: base.yaml\nmetric: val/acc\ncells: {a/b: {}}\n", "must be letters, digits"),
        ("config: [base.yaml\n", "not valid YAML"),
    ],
)
def test_bad_tables_name_the_problem(tmp_path, text, match):
    with pytest.raises(TableError, match=match):
        load_table(write(tmp_path, text))


def test_bad_command_lines_stop_before_any_run(tmp_path, capsys):
    path = write(tmp_path, "config: base.yaml\nmetric: val/acc\ncells: {a: {}, b: {}}\n")
    with pytest.raises(SystemExit, match=r"no cell 'c'; cells are \['a', 'b'\]"):
        sweep.main([str(path), "--only", "c"])
    with pytest.raises(SystemExit, match=r"task 2 out of range: the table has 2 runs \(0-1\)"):
        sweep.main([str(path), "--task", "2", "--print", "fit"])
    with pytest.raises(SystemExit, match="table file .* not found"):
        sweep.main([str(tmp_path / "nope.yaml"), "--dry_run"])


def test_overrides_become_options_the_parser_reads(tmp_path):
    path = write(
        tmp_path,
        "config: base.yaml\nmetric: val/acc\noverrides: {trainer.max_epochs: 3}\n"
        "cells: {a: {overrides: {model.x: {name: multimax, options: {order: 1}}, trainer.max_epochs: 5, "
        "model.flag: true, model.none: null}}}\n",
    )
    run = load_table(path).runs(tmp_path / "runs")[0]
    args = run.fit_args(["--data.root", "/d"])
    pairs = dict(zip(args[1::2], args[2::2]))  # after "fit", options come in pairs
    assert json.loads(pairs["--model.x"]) == {"name": "multimax", "options": {"order": 1}}
    assert args.count("--trainer.max_epochs") == 1 and pairs["--trainer.max_epochs"] == "5"  # the cell's wins
    assert pairs["--model.flag"] == "true" and pairs["--model.none"] == "null" and pairs["--data.root"] == "/d"
    assert pairs["--config"] == str(tmp_path / "base.yaml") and pairs["--seed_everything"] == "0"
    logger = json.loads(pairs["--trainer.logger"])["init_args"]
    assert Path(logger["save_dir"]) / logger["name"] / logger["version"] == run.directory / "fit"


def test_a_failed_run_is_reported_with_its_log_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    """With mmlight itself replaced by a stand-in (run a fails, run b writes its metrics), the sweep
    reports a's log, finishes b, records both, and exits with status 1."""
    path = write(tmp_path, "config: base.yaml\nmetric: val/acc\ncheckpoint: last\ncells: {a: {}, b: {}}\n")
    calls = []

    def fake_execute(args, log, threads):
        calls.append(args[0])
        run_dir = Path(args[args.index("--trainer.default_root_dir") + 1])
        if "/a/" in str(run_dir):
            log.write_text("Traceback: the data root does not exist\n")
            return 1
        run_dir.mkdir(parents=True)
        (run_dir / "final_metrics.json").write_text(
            json.dumps(
                {"stage": "fit", "global_step": 10, "metrics": {"val/acc": {"value": 0.5, "step": 10, "epoch": 0}}}
            )
        )
        return 0

    monkeypatch.setattr(sweep, "execute", fake_execute)
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([str(path), "--out", str(tmp_path / "runs"), "--parallel", "2"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "[0] a/seed0: FAILED in fit (exit 1)" in out and "Traceback: the data root does not exist" in out
    assert "[1] b/seed0: val/acc = 0.5" in out and "1 run(s) finished, 0 already done, 1 failed" in out
    assert calls == ["fit", "fit"]  # b needs no evaluation: fit validated its final step
    a, b = load_table(path).runs(tmp_path / "runs")
    assert (a.status(), b.status(), b.result()) == ("failed", "done", 0.5)
    assert json.loads((a.directory / "sweep_status.json").read_text())["log"] == str(a.directory / "sweep.log")
    # a second sweep retries only the failed run
    calls.clear()
    with pytest.raises(SystemExit):
        sweep.main([str(path), "--out", str(tmp_path / "runs")])
    assert calls == ["fit"] and "[1] b/seed0: done, skipped" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "- a\n- b\n",
            r"a table is a mapping with keys \['cells', 'checkpoint', 'config', 'digits', 'higher_is_better', "
            r"'metric', 'overrides', 'scale', 'seeds', 'title'\]$",
        ),
        (
            "config: base.yaml\ncells: {a: {}}\n",
            r"metric must be a logged val/\* or test/\* name \(e.g. test/bleu\), got None$",
        ),
        ("config: base.yaml\nmetric: val/acc\nseeds: []\ncells: {a: {}}\n", r"got \[\]$"),
        ("config: base.yaml\nmetric: val/acc\nseeds: 0\ncells: {a: {}}\n", "seeds must be a non-empty list"),
        ("config: base.yaml\nmetric: val/acc\nseeds: [0, true]\ncells: {a: {}}\n", "seeds must be a non-empty list"),
        ("config: base.yaml\nmetric: val/acc\nseeds: [0, 1.5]\ncells: {a: {}}\n", "seeds must be a non-empty list"),
        ("config: base.yaml\nmetric: val/acc\ncells: [a]\n", "cells must be a non-empty mapping of cell name -> cell$"),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {1: {}}\n",
            r"cell name 1 must be letters, digits, '_', '-' or '\.' "
            r"\(it is a folder name\)$",
        ),
        ("config: base.yaml\nmetric: val/acc\ncells: {a b: {}}\n", r"cell name 'a b' must be"),
        ("config: base.yaml\nmetric: val/acc\ncells: {_: {}}\n", r"cell name '_' must be"),  # nothing but separators
        ("config: base.yaml\nmetric: val/acc\ncells: {'-': {}}\n", r"cell name '-' must be"),
        ("config: base.yaml\nmetric: val/acc\ncells: {'..': {}}\n", r"cell name '\.\.' must be"),
        (
            "config: base.yaml\nmetric: val/acc\noverrides: [x]\ncells: {a: {}}\n",
            r"table: overrides must map dotted config keys \(no leading --\) to values$",
        ),
        ("config: base.yaml\nmetric: val/acc\noverrides: {1: x}\ncells: {a: {}}\n", "table: overrides must map"),
        (
            "config: base.yaml\nmetric: val/acc\ndigits: 11\ncells: {a: {}}\n",
            "digits must be an integer from 0 to 10, got 11$",
        ),
        ("config: base.yaml\nmetric: val/acc\ndigits: -1\ncells: {a: {}}\n", "digits must be an integer from 0 to 10"),
        (
            "config: base.yaml\nmetric: val/acc\ndigits: true\ncells: {a: {}}\n",
            "digits must be an integer from 0 to 10",
        ),
        ("config: base.yaml\nmetric: val/acc\ndigits: 1.0\ncells: {a: {}}\n", "digits must be an integer from 0 to 10"),
        (
            "config: base.yaml\nmetric: val/acc\nscale: .nan\ncells: {a: {}}\n",
            "cell 'a' scale must be a finite number, got nan$",
        ),
        (
            "config: base.yaml\nmetric: val/acc\nscale: .nan\ncells: {a: {scale: 1}}\n",
            r"t\.yaml: scale must be a finite number, got nan$",
        ),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {a: {paper: high}}\n",
            "cell 'a' paper must be a finite number, got 'high'$",
        ),
        (
            "config: base.yaml\nmetric: val/acc\nscale: true\ncells: {a: {}}\n",
            "scale must be a finite number, got True$",
        ),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {a: {scale: .inf}}\n",
            "cell 'a' scale must be a finite number, got inf$",
        ),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {a: {paper: [1, x]}}\n",
            "cell 'a' paper must be a finite number, got 'x'$",
        ),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {a: {paper_std: x}}\n",
            "cell 'a' paper_std must be a finite number, got 'x'$",
        ),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {a: {metric: loss}}\n",
            r"cell 'a' metric must be a logged val/\* or test/\*",
        ),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {a: [x]}\n",
            r"cell 'a' must be a mapping with keys from "
            r"\['column', 'config', 'metric', 'overrides', 'paper', 'paper_std', "
            r"'row', 'scale'\], got \['x'\]$",
        ),
        ("config: base.yaml\nmetric: val/acc\ncells: {a: {overrides: x}}\n", "cell 'a': overrides must map dotted"),
        (
            "metric: val/acc\ncells: {a: {}}\n",
            r"cell 'a' needs a base config \(key `config`, a path relative to the table file\)$",
        ),
        (
            "config: base.yaml\nmetric: val/acc\ncells: {a: {config: other.yaml}}\n",
            r"cell 'a': base config 'other.yaml' not found \(looked for .*other.yaml\)$",
        ),
    ],
)
def test_more_bad_tables_name_the_problem(tmp_path, text, match):
    """Every check of load_table, with the message's end; each names the file first."""
    path = write(tmp_path, text)
    with pytest.raises(TableError, match=match) as info:
        load_table(path)
    assert str(info.value).startswith(f"{path}: ")


def test_table_defaults_and_cell_fields(tmp_path):
    """What a minimal table file means: title = file stem, seeds [0], checkpoint best, scale 1,
    digits 2, higher is better (except for *ppl and *loss metrics), no overrides; a cell's row is its
    name, its column the metric; ``x-`` keys are ignored; values as written otherwise."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "other.yaml").write_text("{}\n")
    table = load_table(
        write(
            tmp_path,
            "config: base.yaml\nmetric: val/acc\nx-anchor: &o {k: 1}\n"
            "cells:\n  a: {}\n  b.c-d_e: {row: R, column: C, config: sub/other.yaml, "
            "metric: test/bleu, scale: 100, paper: 2, paper_std: 0.5, overrides: *o}\n",
        )
    )
    assert (table.name, table.path, table.title, table.metric) == ("t", tmp_path / "t.yaml", "t", "val/acc")
    assert (table.seeds, table.checkpoint, table.scale, table.digits, table.higher_is_better, table.overrides) == (
        [0],
        "best",
        1.0,
        2,
        True,
        {},
    )
    a, b = table.cells
    assert (a.name, a.row, a.column, a.config, a.metric, a.scale, a.overrides, a.paper, a.paper_std) == (
        "a",
        "a",
        "val/acc",
        tmp_path / "base.yaml",
        "val/acc",
        1.0,
        {},
        None,
        None,
    )
    assert (b.name, b.row, b.column, b.config, b.metric, b.scale, b.overrides, b.paper, b.paper_std) == (
        "b.c-d_e",
        "R",
        "C",
        tmp_path / "sub" / "other.yaml",
        "test/bleu",
        100.0,
        {"k": 1},
        2.0,
        0.5,
    )
    assert (a.eval_stage, b.eval_stage) == ("validate", "test")
    assert table.cell("b.c-d_e") is b
    for metric, better in [("val/ppl", False), ("test/loss", False), ("val/acc", True)]:
        assert (
            load_table(write(tmp_path, f"config: base.yaml\nmetric: {metric}\ncells: {{a: {{}}}}\n")).higher_is_better
            is better
        )
    t = load_table(
        write(
            tmp_path,
            "config: base.yaml\nmetric: val/loss\nhigher_is_better: 1\ntitle: 7\n"
            "scale: 3\ndigits: 10\ncheckpoint: last\nseeds: [3, 1]\ncells: {a: {paper: [1, 2]}}\n",
        )
    )
    assert (t.higher_is_better, t.title, t.scale, t.digits, t.checkpoint, t.seeds, t.cells[0].paper) == (
        True,
        "7",
        3.0,
        10,
        "last",
        [3, 1],
        [1.0, 2.0],
    )
    assert t.cells[0].scale == 3.0  # the table's scale for a cell without its own
    assert [r.label for r in t.runs(tmp_path)] == ["a/seed3", "a/seed1"]


def test_runs_are_cells_then_seeds_with_their_index_and_folder(tmp_path):
    table = load_table(write(tmp_path, "config: base.yaml\nmetric: val/acc\nseeds: [5, 6, 7]\ncells: {a: {}, b: {}}\n"))
    runs = table.runs(tmp_path / "out")
    assert [(r.index, r.cell.name, r.seed) for r in runs] == [
        (0, "a", 5),
        (1, "a", 6),
        (2, "a", 7),
        (3, "b", 5),
        (4, "b", 6),
        (5, "b", 7),
    ]
    assert runs[4].directory == tmp_path / "out" / "t" / "b" / "seed6" and runs[4].table is table
    assert runs[4].stage_dir("test") == tmp_path / "out" / "t" / "b" / "seed6" / "test"
    assert table.runs()[0].directory == Path("runs/tables/t/a/seed5")


def test_override_args_formats_values_for_the_parser():
    """Strings and numbers as written; mappings, lists, booleans and None as JSON."""
    assert override_args({"a": "x y", "b": 3, "c": 0.5, "d": [1, "z"], "e": {"k": None}, "f": False, "g": None}) == [
        "--a",
        "x y",
        "--b",
        "3",
        "--c",
        "0.5",
        "--d",
        '[1, "z"]',
        "--e",
        '{"k": null}',
        "--f",
        "false",
        "--g",
        "null",
    ]


def test_read_metrics_and_status(tmp_path):
    """Missing files read as None; invalid JSON names the file; write_status creates the folder."""
    assert read_metrics(tmp_path) is None and read_status(tmp_path) is None
    (tmp_path / "final_metrics.json").write_text('{"stage": "fit"}')
    assert read_metrics(tmp_path) == {"stage": "fit"}
    write_status(tmp_path / "new" / "run", status="failed", returncode=None)
    assert read_status(tmp_path / "new" / "run") == {"status": "failed", "returncode": None}
    assert (
        tmp_path / "new" / "run" / "sweep_status.json"
    ).read_text() == '{\n "status": "failed",\n "returncode": null\n}\n'
    (tmp_path / "final_metrics.json").write_text("{")
    with pytest.raises(TableError, match=re.escape(f"{tmp_path / 'final_metrics.json'} is not valid JSON (")):
        read_metrics(tmp_path)


def recipe_network(args: list[str], vocab_size: int):
    """The network ``mmlight fit ARGS`` builds for a vocabulary of ``vocab_size`` tokens, on the meta device."""
    import torch

    from mmlight.models.transformer import TransformerConfig, TransformerLM

    fields = parsed_config(args).model.init_args.model.as_dict()
    fields["vocab_size"] = vocab_size  # linked from the prepared data's tokenizer at fit time
    attention = fields.pop("attention")
    fields["attention"] = ReweightingSpec(attention["name"], attention.get("options") or {})
    with torch.device("meta"):
        return TransformerLM(TransformerConfig(**fields))


def parameters(network) -> int:
    return sum(p.numel() for p in network.parameters())


def llama_parameters(layers: int, d: int, ffn: int, vocab: int) -> int:
    """A Llama-style decoder with tied embeddings, counted by hand: per layer the q, k, v and output
    projections (4 d^2, no biases), SwiGLU's three (3 d ffn) and two RMSNorm weights; the embedding
    and the final RMSNorm."""
    return layers * (4 * d * d + 3 * d * ffn + 2 * d) + vocab * d + d


@pytest.mark.parametrize(
    "config, layers, d, ffn",
    [("configs/llm/llama_124m_softmax.yaml", 12, 768, 2048), ("configs/llm/llama_350m_softmax.yaml", 24, 1024, 2816)],
)
def test_llm_recipes_have_the_sizes_their_docs_state(config, layers, d, ffn):
    """docs/llm.md's parameter counts (32,768 tokens) against a count by hand and the network the config builds."""
    count = parameters(recipe_network(["--config", str(ROOT / config)], 32_768))
    assert count == llama_parameters(layers, d, ffn, 32_768)
    row = next(line for line in (ROOT / "docs/llm.md").read_text().splitlines() if line.startswith(f"| `{config}`"))
    assert f"| {count:,} |" in row
    assert f"{count:,} parameters" in (ROOT / config).read_text()


def test_every_cell_of_the_124m_table_builds_its_network_with_the_learned_parameters_of_its_function():
    """Each llm_124m cell on the meta device: the softmax cell's size, plus one sink logit per head and layer
    for the learned sink, one scale per head and layer for SSMax, the headwise gate's d x heads projection
    per layer (no bias: the recipe has none) and MultiMax's 8 parameters per layer (order 2)."""
    table = load_table(ROOT / "configs/tables/llm_124m.yaml")
    base = llama_parameters(12, 768, 2048, 32_768)
    learned = {"sink": 12, "ssmax": 12, "multimax": 8}
    for run in table.runs(ROOT / "runs"):
        network = recipe_network(run.fit_args()[1:-2], 32_768)
        name = run.cell.overrides["model.init_args.model.attention"]["name"]
        gated = run.cell.overrides["model.init_args.model.gate"] == "headwise"
        assert (
            network.config.attention.name == name
            and network.config.gate == run.cell.overrides["model.init_args.model.gate"]
        )
        assert parameters(network) == base + 12 * (learned.get(name, 0) + gated * 768 * 12), run.cell.name
