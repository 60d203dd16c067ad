"""tools/render_docs.py: every rendered block of the docs is what the code renders today, and what the
blocks say agrees with the code run another way (weights computed, ``--help`` parsed, constants read)."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from tools import render_docs

pytestmark = pytest.mark.usefixtures("plain_argv")  # LightningCLI reads sys.argv

DOCUMENTS = render_docs.documents()
BLOCKS = [
    (path, name)
    for path in DOCUMENTS
    for name in dict.fromkeys(name for name, _ in render_docs.BLOCK.findall(path.read_text()))
]


def rows(markdown: str) -> list[list[str]]:
    """The body rows of the Markdown table in ``markdown``, cells stripped."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def test_every_renderer_is_used_and_every_block_is_known():
    used = {name for _, name in BLOCKS}
    assert used == set(render_docs.RENDERERS), "a renderer no document uses, or a block no renderer renders"


@pytest.mark.parametrize("path, name", BLOCKS, ids=[f"{p.name}:{n}" for p, n in BLOCKS])
def test_each_rendered_block_is_what_the_code_renders(path, name):
    stale = render_docs.stale_blocks(path)
    assert name not in stale, f"{path.name}: block {name!r} is stale; run: python tools/render_docs.py --update"


def test_a_stale_block_is_named_and_update_rewrites_it(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "README.md"
    doc.write_text("a <!-- rendered: null-mass -->`softmax`<!-- /rendered --> b\n")
    assert render_docs.stale_blocks(doc) == ["null-mass"]
    monkeypatch.setattr(render_docs, "documents", lambda: [doc])
    monkeypatch.setattr(render_docs, "ROOT", tmp_path)
    assert render_docs.main([]) == 1 and "README.md: stale: null-mass" in capsys.readouterr().out
    assert render_docs.main(["--update"]) == 0
    assert doc.read_text() == f"a <!-- rendered: null-mass -->{render_docs.null_mass()}<!-- /rendered --> b\n"
    assert render_docs.main([]) == 0 and render_docs.stale_blocks(doc) == []
    doc.write_text("<!-- rendered: nothing -->x<!-- /rendered -->")
    with pytest.raises(SystemExit, match=r"unknown rendered block\(s\) \['nothing'\]"):
        render_docs.stale_blocks(doc)


def probe_row_sums(name: str) -> torch.Tensor:
    """Row sums of ``name``'s weights on scores that make each kind of row show: large and small, in
    float64, causal (stick-breaking refuses anything else)."""
    from mmlight.reweighting import build

    torch.manual_seed(0)
    scores = torch.cat([torch.randn(4, 16) * 3, torch.full((2, 16), 20.0), torch.full((2, 16), -20.0)])
    scores = scores.double().view(1, 1, 8, 16)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()[:8] if name == "stickbreaking" else None
    fn = build(name, backend="reference")
    return fn(scores, causal).sum(-1).flatten()


def test_the_row_mass_table_says_what_the_weights_sum_to():
    """'1': every row sums to one; '≤ 1': none above one, some below; 'unbounded': some above one (sigmoid
    on high scores weighs every key near one)."""
    table = {name.strip("`"): mass for name, mass, _ in rows(render_docs.reweightings())}
    for name, mass in table.items():
        sums = probe_row_sums(name)
        if mass == "1":
            assert torch.allclose(sums, torch.ones_like(sums)), name
        elif mass == "≤ 1":
            assert (sums <= 1 + 1e-12).all() and (sums < 0.99).any(), name
        else:
            assert mass.startswith("unbounded") and (sums > 1.01).any(), name
    nothing = render_docs.null_mass()
    assert sorted(re.findall(r"`(\w+)`", nothing)) == sorted(n for n, m in table.items() if m != "1")


def test_the_options_column_gives_the_defaults_a_function_is_built_with():
    """Built with the listed values spelt out, every function has the state and the weights it has built
    with no option."""
    import ast

    from mmlight.reweighting import build

    scores = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    for name, _, options in rows(render_docs.reweightings()):
        name = name.strip("`")
        listed = {option: ast.literal_eval(value) for option, value in re.findall(r"`(\w+)=([^`]+)`", options)}
        torch.manual_seed(0)  # MultiMax draws its initial parameters
        plain = build(name)
        torch.manual_seed(0)
        spelt = build(name, **listed)
        assert plain.state_dict().keys() == spelt.state_dict().keys(), name
        assert all(torch.equal(plain.state_dict()[k], spelt.state_dict()[k]) for k in plain.state_dict()), name
        assert torch.equal(plain(scores, causal), spelt(scores, causal)), name


def test_the_preparers_and_commands_are_what_mmlight_help_lists(capsys):
    from mmlight.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    overview = capsys.readouterr().out
    listed = re.findall(r"^  (\w+)  ", overview, re.M)
    assert [name.removeprefix("`mmlight ").strip("`") for name, _ in rows(render_docs.commands())] == listed
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    choices = re.search(r"\{([\w,-]+)\}", capsys.readouterr().out).group(1).split(",")
    assert sorted(name.strip("`") for name, *_ in rows(render_docs.preparers())) == sorted(choices)
    digits = next(r for r in rows(render_docs.preparers()) if r[0] == "`digits`")
    assert digits[2] == "no"  # the one preparer that runs without --src


def test_the_switches_are_the_gpu_runs_and_their_defaults_the_modules_values():
    """The kernel switches listed are the ones the GPU run (``benchmarks/gpu/common.py``) sweeps, each at
    its module's value."""
    from benchmarks.gpu.common import ATTENTION_SWITCHES, CE_SWITCHES, ROWWISE_SWITCHES

    swept = ATTENTION_SWITCHES + CE_SWITCHES + ROWWISE_SWITCHES
    swept_names = sorted(module.rsplit(".", 1)[1] + "." + name for module, name, _ in swept)
    table = {name.strip("`"): default for name, default, _ in rows(render_docs.kernel_switches())}
    assert sorted(table) == swept_names
    for qualified, default in table.items():
        module, name = qualified.split(".")
        value = getattr(importlib.import_module(f"mmlight.kernels.{module}"), name)
        assert default == ("on" if value else "off"), qualified


def test_the_default_callbacks_are_on_the_trainer_of_a_plain_fit(tmp_path):
    """The callbacks listed are those of the trainer ``mmlight fit`` builds from a config naming none."""
    from mmlight.lightning_cli import build_cli

    config = "configs/quickstart/lm_softmax.yaml"
    cli = build_cli(["--config", config, "--trainer.default_root_dir", str(tmp_path)], run=False)
    for name, _ in rows(render_docs.default_callbacks()):
        module, cls = name.strip("`").rsplit(".", 1)
        cls = getattr(importlib.import_module(module), cls)
        assert any(isinstance(callback, cls) for callback in cli.trainer.callbacks), name


def test_the_task_members_are_what_every_task_has():
    """Each member listed is on mmlight's three tasks (``compiled``: on an instance), and the protocols'
    runtime checks accept an instance."""
    from mmlight.tasks import ImageClassifier, LanguageModel, Translator
    from mmlight.tasks.protocol import AnalysedTask, TrainedTask

    members = re.findall(r"^- `(\w+)", render_docs.task_members(), re.M)
    assert {"counts_tokens", "batch_counts", "training_loss", "compiled", "teacher_forced"} <= set(members)
    for task in (ImageClassifier, LanguageModel, Translator):
        missing = [m for m in members if m != "compiled" and not hasattr(task, m)]
        assert missing == [], task.__name__
    from tests.helpers.models import tiny_translator

    task = tiny_translator(vocab_size=12)
    assert isinstance(task, TrainedTask) and isinstance(task, AnalysedTask)


def test_the_experiment_tables_count_cells_times_seeds_of_each_file():
    """Every file of configs/tables/ is listed once, with its cells (keys of ``cells``) times its seeds read
    from the YAML directly, and its title."""
    import yaml

    files = sorted((render_docs.ROOT / "configs" / "tables").glob("*.yaml"))
    listed = {name.strip("`"): (runs, title) for name, runs, title in rows(render_docs.experiment_tables())}
    assert sorted(listed) == [path.name for path in files]
    for path in files:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert listed[path.name] == (str(len(spec["cells"]) * len(spec["seeds"])), spec["title"]), path.name
    assert listed["cpu_reweighting.yaml"][0] == "90"  # 6 functions x 3 tasks x 5 seeds


def test_the_analyze_options_are_what_its_help_lists_with_the_defaults_it_parses_to():
    """docs/analysis.md's table of ``mmlight analyze`` options against the parser: the options of
    ``--help`` in its order, each help sentence in it, and each default what a command line without the
    option parses to (required ones refused when missing)."""
    from mmlight.commands import analyze

    text = (render_docs.ROOT / "docs" / "analysis.md").read_text()
    (body,) = [body for name, body in render_docs.BLOCK.findall(text) if name == "analyze-options"]
    table = rows(body)
    help_text = analyze.option_parser().format_help()
    assert [row[0].strip("`") for row in table] == re.findall(r"^  (--\w+)", help_text, re.M)
    flat_help = " ".join(help_text.split())
    for _, default, sentence in table:  # each help ends with the table's default, if any, before the next option
        shown = "" if default in ("required", "off", "—") else f" (default {default})"
        assert re.search(re.escape(sentence.replace("\\|", "|") + shown) + " --", flat_help), sentence
    args, _ = analyze.parse_args(["--config", "c.yaml", "--ckpt_path", "a.ckpt", "--out", "o"])
    for flag, default, _ in table:
        name = flag.strip("`").removeprefix("--")
        if default == "required":
            with pytest.raises(SystemExit):
                analyze.parse_args(["--config", "c.yaml", *(f"--{n}=x" for n in ("ckpt_path", "out") if n != name)])
            continue
        value = getattr(args, name)
        if value is None or isinstance(value, bool):
            assert {"off": False, "—": None}[default] is value, flag
            continue
        values, cells = (value if isinstance(value, list) else [value]), default.split()
        assert len(cells) == len(values) and all(type(v)(c) == v for v, c in zip(values, cells)), flag


def test_each_tile_row_holds_for_every_head_dim_and_row_length_of_its_band():
    """The table names bands; every head dim from 8 to 256 and every row length up to past the longest
    one-block row launches what its band's row says (the config functions asked one value at a time)."""
    from mmlight.kernels import attention, rowwise

    attention_rows, rowwise_rows = (rows(part) for part in render_docs.tile_sizes().split("The row-wise kernel"))
    assert len(attention_rows) == 2 * 2 * len(render_docs.HEAD_DIM_BANDS) and len(rowwise_rows) == 10

    def band_of(head_dim: int) -> str:
        return "≤ 32" if head_dim <= 32 else "33–64" if head_dim <= 64 else "> 64"

    table = {(gpu, dtype, band): cells for gpu, dtype, band, *cells in attention_rows}
    for capability in (70, 80, 86, 89, 90, 100):
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16, fp16"), (torch.float16, "bf16, fp16")):
            for head_dim in range(8, 257, 8):
                configs = (
                    attention.forward_config(head_dim, dtype, capability),
                    *attention.backward_configs(head_dim, dtype, capability),
                )
                shown = [f"{c.block_m} × {c.block_n}, {c.num_warps} warps, {c.num_stages} stages" for c in configs]
                gpu = "sm_90" if capability == 90 else "sm_80"
                assert table[gpu, name, band_of(head_dim)] == shown, (capability, dtype, head_dim)

    def rowwise_row(n: int) -> list[str]:
        for band, *cells in rowwise_rows:
            low, _, high = band.replace(",", "").partition("–")
            if (band.startswith("more than") and n > int(band.split()[-1].replace(",", ""))) or (
                high and int(low) <= n <= int(high)
            ):
                return cells
        raise AssertionError(f"no band holds {n}")

    for n in range(1, rowwise.MAX_SINGLE_BLOCK + 300):
        config = rowwise._launch_config(n, torch.bfloat16, 80)
        rows_per_program, widest, warps = rowwise_row(n)
        assert [str(config["ROWS"]), str(config["num_warps"])] == [rows_per_program, warps], n
        assert config["BLOCK_N"] == (min(1 << (n - 1).bit_length(), rowwise.LONG_ROW_BLOCK)), n
        assert config["BLOCK_N"] <= int(widest.replace(",", "")), n
