"""``mmlight analyze``: attention statistics, figures and robustness of trained checkpoints.

::

    mmlight analyze --config CONFIG --ckpt_path A.ckpt [B.ckpt ...] --out DIR [--num_samples N]
                    [--split val|test] [--robustness] [--extrapolation] [--data.* ...] [--trainer.* ...]

The config and its ``--data.*``/``--trainer.*`` overrides are parsed by the same LightningCLI as
``fit``; each checkpoint is rebuilt from its own hyperparameters with the config's task class, so
twins with different reweighting functions compare directly. Writes ``DIR/stats.csv``,
``DIR/stats.json``, ``DIR/massive_activations.csv``, ``DIR/*.png``, ``DIR/summary.md``, for a causal
decoder ``DIR/key_norm_attention.csv``, with ``--robustness`` ``DIR/robustness.csv``,
``DIR/robustness.json`` and (KV eviction) ``DIR/kv_attention_loss.csv``, and, for a language model
with ``--extrapolation``, ``DIR/extrapolation.csv``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch

from mmlight.analysis import figures, kv_eviction
from mmlight.analysis.batches import first_samples
from mmlight.analysis.extrapolation import (
    MULTIPLES,
    extrapolation_rows,
    length_extrapolation,
    position_limit,
    stream_from_batches,
)
from mmlight.analysis.key_norms import key_norm_attention
from mmlight.analysis.kv_eviction import METHODS, calibrate_qfilters, compression_ratio
from mmlight.analysis.massive import MassiveSettings, massive_activations, massive_rows
from mmlight.analysis.robustness import KEEP_RATIOS, KV_METHODS, robustness_rows, robustness_runs
from mmlight.analysis.stats import (
    GATE_METRICS,
    HEAD_METRICS,
    LAYER_METRICS,
    Settings,
    collect_statistics,
    metric_rows,
)
from mmlight.data.vocab import Vocab
from mmlight.models.transformer import TransformerLM
from mmlight.nn.attention import network_of
from mmlight.tasks.protocol import check_analysed_task

#: Trainer settings of the config that the evaluation runs keep (the rest is analysis-specific).
TRAINER_KEYS = ("accelerator", "precision", "limit_val_batches", "limit_test_batches", "deterministic")


class AnalyzeError(ValueError):
    """Bad input to ``mmlight analyze``, reported before any work."""


#: The analysis options, ``(flag, add_argument's keyword arguments)``, in the order ``--help`` lists them
#: (docs/analysis.md renders its table of them from here).
OPTIONS: tuple[tuple[str, dict], ...] = (
    ("--ckpt_path", {"nargs": "+", "required": True, "help": "one or more checkpoints to compare"}),
    ("--out", {"required": True, "help": "output folder (created)"}),
    ("--num_samples", {"type": int, "default": 256, "help": "the first N samples of the split"}),
    ("--split", {"choices": ("val", "test"), "default": "val", "help": "which split"}),
    ("--robustness", {"action": "store_true", "help": "also evaluate under sink masking and KV eviction"}),
    (
        "--kv_skip_layers",
        {
            "type": int,
            "default": 2,
            "help": "KV eviction leaves the first this-many layers untouched (Devoto et al.: 2)",
        },
    ),
    (
        "--keep_ratios",
        {
            "type": float,
            "nargs": "+",
            "default": list(KEEP_RATIOS),
            "metavar": "R",
            "help": "KV eviction: the keep ratios, each in (0, 1]",
        },
    ),
    (
        "--kv_methods",
        {
            "nargs": "+",
            "choices": list(METHODS),
            "default": list(KV_METHODS),
            "metavar": "M",
            "help": f"KV eviction methods, of {', '.join(METHODS)} (qfilters needs --kv_calibrate, now or in an "
            "earlier run)",
        },
    ),
    (
        "--kv_calibrate",
        {
            "action": "store_true",
            "help": "compute Q-filters from the --num_samples sequences of the split and save them beside each "
            "checkpoint (CKPT.qfilters.pt), with their stability over two disjoint halves (qfilters.json)",
        },
    ),
    (
        "--query_patch",
        {
            "type": int,
            "default": None,
            "help": "ViT: the query patch of the attention-map figure (default: the centre patch)",
        },
    ),
    (
        "--sink_eps",
        {
            "type": float,
            "default": Settings.sink_eps,
            "help": "a key is a sink above this multiple of the uniform share",
        },
    ),
    (
        "--massive_top_k",
        {
            "type": int,
            "default": MassiveSettings.top_k,
            "help": "massive activations: the largest entries listed per block",
        },
    ),
    (
        "--extrapolation",
        {
            "action": "store_true",
            "help": "language models: perplexity at multiples of the training context, by position in the window",
        },
    ),
    (
        "--multiples",
        {
            "type": int,
            "nargs": "+",
            "default": list(MULTIPLES),
            "metavar": "M",
            "help": "extrapolation: window lengths as multiples of the training context",
        },
    ),
    (
        "--train_context",
        {
            "type": int,
            "default": None,
            "help": "extrapolation: the training context in tokens (default: the data's block_size, or seq_len)",
        },
    ),
    (
        "--position_bucket",
        {
            "type": int,
            "default": None,
            "help": "extrapolation: positions per bucket (default: a quarter of the training context)",
        },
    ),
    (
        "--extrapolation_windows",
        {
            "type": int,
            "default": 4,
            "help": "extrapolation: windows of the largest multiple evaluated; every multiple scores the same tokens",
        },
    ),
)


def shown_default(options: dict) -> str:
    """An option's default as ``--help`` and the docs show it (``1 0.9 0.5`` for a list, ``3`` for 3.0);
    empty for an option without one (the required ones, the flags, those whose help explains None)."""
    default = options.get("default")
    if default is None:
        return ""
    values = default if isinstance(default, list) else [default]
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def option_parser() -> argparse.ArgumentParser:
    """The parser of :data:`OPTIONS`, each option's help ending with its default."""
    parser = argparse.ArgumentParser(
        prog="mmlight analyze",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="--config CONFIG (required) and --data.*/--trainer.* options go to the same parser as `mmlight fit`; "
        "the model comes from each checkpoint's own hyperparameters.",
    )
    for flag, options in OPTIONS:
        shown = shown_default(options)
        parser.add_argument(flag, **{**options, "help": options["help"] + (f" (default {shown})" if shown else "")})
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The analysis options, each checked; everything else (``--config``, ``--data.*``, ``--trainer.*``)
    is returned for the LightningCLI parser."""
    parser = option_parser()
    args, rest = parser.parse_known_args(argv)
    if "--config" not in rest and not any(a.startswith("--config=") for a in rest):
        parser.error("--config CONFIG is required (the config the checkpoints were trained with)")
    if args.num_samples < 1:
        parser.error(f"--num_samples must be >= 1, got {args.num_samples}")
    if args.kv_calibrate and args.num_samples < 2:
        parser.error(f"--kv_calibrate needs --num_samples >= 2 (two disjoint halves), got {args.num_samples}")
    if args.kv_skip_layers < 0:
        parser.error(f"--kv_skip_layers must be >= 0, got {args.kv_skip_layers}")
    for name in ("massive_top_k", "extrapolation_windows", "train_context", "position_bucket"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if min(args.multiples) < 1:
        parser.error(f"--multiples must each be >= 1, got {args.multiples}")
    if not all(0.0 < r <= 1.0 for r in args.keep_ratios):
        parser.error(f"--keep_ratios must each be in (0, 1], got {args.keep_ratios}")
    resolved = [Path(p).resolve() for p in args.ckpt_path]
    repeated = [p for i, p in enumerate(args.ckpt_path) if resolved[i] in resolved[:i]]
    if repeated:  # one label per file: a repeat would silently replace the first one's results
        parser.error(f"--ckpt_path names {repeated[0]} more than once")
    return args, rest


def run_labels(paths: list[Path]) -> list[str]:
    """A readable unique label per checkpoint: the run name (``runs/NAME/version_0/checkpoints/x.ckpt``
    -> ``NAME``), extended by the version and the file name where names repeat."""

    def parts(p: Path) -> list[str]:
        p = p.resolve()
        if p.parent.name == "checkpoints":
            return [p.parent.parent.parent.name, p.parent.parent.name, p.stem]
        return [p.parent.name, p.stem]

    labels = [parts(p) for p in paths]
    for depth in range(1, 4):
        names = ["/".join(x[:depth]) for x in labels]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]


def load_checkpoint(task_class, path: Path):
    """``task_class`` rebuilt from the checkpoint's own hyperparameters, or an :class:`AnalyzeError`."""
    if not path.is_file():
        raise AnalyzeError(f"checkpoint {path} does not exist")
    try:
        return task_class.load_from_checkpoint(path, map_location="cpu")
    except Exception as err:  # a checkpoint of another task or architecture: say which and why
        raise AnalyzeError(f"checkpoint {path} does not match the config's model {task_class.__name__}: {err}") from err


def check_fits_data(task, datamodule, path: Path) -> None:
    """Refuse a checkpoint whose vocabulary or number of classes is not the data's."""
    config = getattr(network_of(task), "config", None)  # a network without a config declares no sizes
    for attr in ("vocab_size", "num_classes"):
        data_value, model_value = getattr(datamodule, attr, None), getattr(config, attr, None)
        if data_value is not None and model_value is not None and data_value != model_value:
            raise AnalyzeError(f"checkpoint {path} has {attr}={model_value} but the data has {data_value}")


def eval_loader(datamodule, split: str):
    """The split's batches after ``prepare_data``/``setup``, each as the model sees it in
    ``trainer.validate``: through the DataModule's ``on_after_batch_transfer`` (e.g. uint8 images
    normalised, see ``ImageShardDataModule(normalize_on_device=...)``); an :class:`AnalyzeError` if
    the data has no such split."""
    datamodule.prepare_data()
    datamodule.setup("validate" if split == "val" else "test")
    try:
        loader = datamodule.val_dataloader() if split == "val" else datamodule.test_dataloader()
    except Exception as err:
        raise AnalyzeError(f"the data has no usable {split} split: {err}") from err
    return (datamodule.on_after_batch_transfer(batch, 0) for batch in loader)


def vocabulary(datamodule) -> list[str] | None:
    """The data's token strings (its typed :class:`~mmlight.data.vocab.Vocab`) for the text figures'
    labels; None for data without one."""
    try:
        vocab = getattr(datamodule, "vocab", None)
    except (OSError, KeyError, ValueError):  # a text DataModule whose dictionary is not prepared
        return None
    return list(vocab.tokens) if isinstance(vocab, Vocab) else None


def eval_trainer(trainer_config) -> L.Trainer:
    """A single-process trainer for the robustness runs with the config's accelerator and precision
    (and batch limits), no logger, checkpoints or progress bar."""
    kwargs = {k: trainer_config[k] for k in TRAINER_KEYS if trainer_config.get(k) is not None}
    return L.Trainer(
        devices=1,
        num_nodes=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[],
        **kwargs,
    )


def main(argv: list[str]) -> None:
    """Entry point of ``mmlight analyze``: bad input ends with one line naming it, before any work."""
    try:
        analyze(argv)
    except AnalyzeError as err:
        raise SystemExit(f"mmlight analyze: error: {err}") from err


def analyze(argv: list[str]) -> None:
    """Parse ``argv``, check every input, then analyse each checkpoint and write the outputs."""
    from tqdm.auto import tqdm

    args, rest = parse_args(argv)
    cli, labels, tasks, batches = checked_inputs(args, rest)
    stream, context = extrapolation_inputs(args, cli.datamodule, tasks) if args.extrapolation else (None, None)
    trainer = eval_trainer(cli.config.trainer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(sink_eps=args.sink_eps)
    massive_settings = MassiveSettings(top_k=args.massive_top_k)
    vocab = vocabulary(cli.datamodule)
    calibration = {}
    if args.kv_calibrate:
        for label, task, path in zip(labels, tasks, args.ckpt_path):
            calibration[label] = calibrated(task, batches, Path(path))
    options = [kv_options(args.kv_methods, path) for path in args.ckpt_path]
    runs = 0
    if args.robustness:
        runs = len(robustness_runs(tasks[0], args.kv_skip_layers, args.keep_ratios, args.kv_methods, options[0]))
    windows = 0 if stream is None else sum(extrapolation_windows(args, t, len(stream), context) for t in tasks)
    total = len(tasks) * (args.num_samples + runs) + windows
    results, robustness, losses, key_norms, example_files = {}, [], [], {}, []
    massive, extrapolation = {}, {}
    with tqdm(total=total, desc="mmlight analyze", unit="sample") as bar:
        for label, task, kv in zip(labels, tasks, options):
            bar.set_postfix_str(label)
            task.to(trainer.strategy.root_device)
            results[label] = collect_statistics(task, batches, settings, progress=bar.update)
            massive[label] = with_token_text(massive_activations(task, batches, massive_settings), vocab)
            example_files += figures.examples(task, batches[0], label, out, args.query_patch, vocab)
            key_norms[label] = key_norm_attention(task, batches)
            if args.robustness:
                kv_losses = []
                rows = robustness_rows(
                    trainer,
                    task,
                    cli.datamodule,
                    args.split,
                    args.kv_skip_layers,
                    bar.update,
                    args.keep_ratios,
                    args.kv_methods,
                    kv,
                    kv_losses,
                )
                robustness += [(label, *row) for row in rows]
                losses += [(label, kind, r, compression_ratio(r), *rest) for kind, r, *rest in kv_losses]
            if stream is not None:
                extrapolation[label] = length_extrapolation(
                    task, stream, context, args.multiples, args.position_bucket, bar.update
                )
            task.cpu()

    meta = {
        "num_samples": args.num_samples,
        "split": args.split,
        "settings": asdict(settings),
        "kv_skip_layers": args.kv_skip_layers,
        "keep_ratios": args.keep_ratios,
        "compression_ratios": [compression_ratio(r) for r in args.keep_ratios],
        "kv_methods": args.kv_methods,
        "checkpoints": dict(zip(labels, args.ckpt_path)),
    }
    lm = {"massive_activations": massive, **({"extrapolation": extrapolation} if extrapolation else {})}
    write_stats(out, results, meta, lm)
    if calibration:
        (out / "qfilters.json").write_text(json.dumps(calibration, indent=1) + "\n")
    written = figures.comparisons(results, out) + example_files
    correlations = key_norm_rows(key_norms)
    if correlations:
        write_csv(out / "key_norm_attention.csv", KEY_NORM_COLUMNS, correlations)
        written.append(figures.key_norm_attention({k: v for k, v in key_norms.items() if v}, out))
    if robustness:
        write_csv(out / "robustness.csv", ROBUSTNESS_COLUMNS, robustness)
        write_robustness_json(out, meta, robustness, losses)
        written.append(figures.robustness(robustness, out))
    if losses:
        write_csv(out / "kv_attention_loss.csv", LOSS_COLUMNS, losses)
        written.append(figures.attention_loss(losses, out))
    written += write_lm_analyses(out, massive, extrapolation)
    write_summary(out, results, meta, written, robustness, losses, correlations, lm)
    for label, result in extrapolation.items():
        for line in undefined_multiples(result):
            print(f"mmlight analyze: {label}: {line}")
    print(f"mmlight analyze: {len(tasks)} checkpoint(s), {args.num_samples} {args.split} samples -> {out}/summary.md")


def training_context(args: argparse.Namespace, datamodule) -> int:
    """``--train_context``, else the data's training sequence length (``block_size`` of a text
    DataModule, ``seq_len`` of the recall task's), else an :class:`AnalyzeError` asking for it."""
    if args.train_context is not None:
        return args.train_context
    for attr in ("block_size", "seq_len"):
        value = getattr(datamodule, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise AnalyzeError(
        f"--extrapolation needs the training context: {type(datamodule).__name__} has no block_size or "
        "seq_len, give --train_context N"
    )


def extrapolation_inputs(args: argparse.Namespace, datamodule, tasks: list):
    """The evaluation stream and the training context of ``--extrapolation``, checked before any work:
    every checkpoint must be a language model, and the split must hold the windows asked for."""
    for task, path in zip(tasks, args.ckpt_path):
        if not isinstance(network_of(task), TransformerLM):
            raise AnalyzeError(f"--extrapolation needs a language model; {path} holds a {type(task).__name__}")
    context = training_context(args, datamodule)
    needed = args.extrapolation_windows * context * max(args.multiples)
    pad_id = network_of(tasks[0]).config.pad_id
    stream = stream_from_batches(eval_loader(datamodule, args.split), pad_id, needed)
    if len(stream) < needed:
        raise AnalyzeError(
            f"--extrapolation: {args.extrapolation_windows} window(s) of {max(args.multiples)} x {context} tokens "
            f"need {needed} positions, and the {args.split} split holds {len(stream)}: lower "
            "--extrapolation_windows or --multiples"
        )
    return stream, context


def extrapolation_windows(args: argparse.Namespace, task, positions: int, context: int) -> int:
    """Windows that the extrapolation of ``task`` runs over ``positions`` (for the progress bar): those
    of every multiple whose window its position table holds."""
    limit = position_limit(network_of(task))
    return sum(positions // (m * context) for m in args.multiples if limit is None or m * context <= limit)


def undefined_multiples(result: dict) -> list[str]:
    """A line per multiple of an extrapolation result that is not defined, with the reason."""
    return [f"{m}x not evaluated: {e['reason']}" for m, e in result["multiples"].items() if not e["defined"]]


def with_token_text(result: dict, vocab: list[str] | None) -> dict:
    """``result`` of :func:`massive_activations` with each top entry's token spelled (``token_text``)."""
    for entry in result["blocks"].values():
        for top in entry["top"]:
            token = top["token"]
            top["token_text"] = vocab[token] if vocab is not None and token is not None and token < len(vocab) else None
    return result


def write_lm_analyses(out: Path, massive: dict, extrapolation: dict) -> list[str]:
    """``massive_activations.csv`` (``checkpoint,block,metric,value``) and its figure, and with
    extrapolation results ``extrapolation.csv`` and its figure; returns the figures' names."""
    rows = [(label, *row) for label, result in massive.items() for row in massive_rows(result)]
    write_csv(out / "massive_activations.csv", ("checkpoint", "block", "metric", "value"), rows)
    written = [figures.save(figures.massive_figure(massive), out, "massive_activations.png")]
    if extrapolation:
        header = ("checkpoint", "multiple", "length", "part", "start", "stop", "count", "ppl")
        rows = [(label, *row) for label, result in extrapolation.items() for row in extrapolation_rows(result)]
        write_csv(out / "extrapolation.csv", header, rows)
        written.append(figures.save(figures.extrapolation_figure(extrapolation), out, "length_extrapolation.png"))
    return written


def checked_inputs(args: argparse.Namespace, rest: list[str]):
    """Config, checkpoints and samples, each checked before any work: ``(cli, labels, tasks, batches)``."""
    from mmlight.lightning_cli import build_cli

    argv0, sys.argv = sys.argv, sys.argv[:1]  # the CLI parses `rest` only (and would warn about both)
    try:
        cli = build_cli(rest, run=False)
    finally:
        sys.argv = argv0
    try:
        check_analysed_task(cli.model)
    except TypeError as err:
        raise AnalyzeError(str(err)) from err
    paths = [Path(p) for p in args.ckpt_path]
    tasks = [load_checkpoint(type(cli.model), p) for p in paths]
    loader = eval_loader(cli.datamodule, args.split)  # prepares the data, which the checks below read
    for task, path in zip(tasks, paths):
        check_fits_data(task, cli.datamodule, path)
    try:
        batches = first_samples(loader, args.num_samples, args.split)
    except ValueError as err:
        raise AnalyzeError(str(err)) from err
    check_query_patch(args.query_patch, tasks[0].example_inputs(batches[0]).patch_grid)
    check_kv_options(args, tasks[0], paths)
    return cli, run_labels(paths), tasks, batches


def filters_path(checkpoint: Path) -> Path:
    """Where ``--kv_calibrate`` saves a checkpoint's Q-filters: beside it, ``CKPT.qfilters.pt``."""
    return Path(f"{checkpoint}.qfilters.pt")


def kv_options(methods: list[str], checkpoint) -> dict:
    """The eviction methods' options for ``checkpoint``: its Q-filters ``(L, n_kv, hs)``, saved beside
    it, when ``qfilters`` is one of ``methods``."""
    if "qfilters" not in methods:
        return {}
    saved = torch.load(filters_path(Path(checkpoint)), map_location="cpu", weights_only=True)
    return {"qfilters": {"filters": saved["filters"]}}


def calibrated(task, batches: list, checkpoint: Path) -> dict:
    """Calibrate ``task``'s Q-filters on ``batches``, save them beside ``checkpoint`` and return the
    stability summary (the cosine between the two halves' filters, per layer and KV head)."""
    result = calibrate_qfilters(task, batches)
    torch.save(result, filters_path(checkpoint))
    cosine = result["cosine"]
    return {
        "file": str(filters_path(checkpoint)),
        "num_sequences": result["num_sequences"],
        "halves": "the first and the second half of the sequences (disjoint)",
        "cosine": cosine.tolist(),
        "cosine_mean": float(cosine.mean()),
        "cosine_min": float(cosine.min()),
    }


def check_kv_options(args: argparse.Namespace, task, paths: list[Path]) -> None:
    """Refuse, before any work, a KV eviction that would change nothing (``--kv_skip_layers`` past the
    last decoder layer) or ``qfilters`` without filters beside a checkpoint."""
    if not args.robustness or "kv_eviction" not in task.interventions:
        return
    try:
        robustness_runs(task, args.kv_skip_layers, args.keep_ratios, [m for m in args.kv_methods if m != "qfilters"])
    except ValueError as err:
        raise AnalyzeError(str(err)) from err
    if "qfilters" in args.kv_methods and not args.kv_calibrate:
        missing = [str(filters_path(p)) for p in paths if not filters_path(p).is_file()]
        if missing:
            raise AnalyzeError(f"--kv_methods qfilters needs {missing[0]}: add --kv_calibrate (now or earlier)")


def check_query_patch(query_patch: int | None, grid: tuple[int, int] | None) -> None:
    """Refuse a ``--query_patch`` outside the image's ``(rows, cols)`` patch grid (a task without an
    image, whose grid is None, ignores it)."""
    if query_patch is not None and grid is not None and not 0 <= query_patch < grid[0] * grid[1]:
        raise AnalyzeError(f"--query_patch must be in [0, {grid[0] * grid[1]}), got {query_patch}")


ROBUSTNESS_COLUMNS = ("checkpoint", "intervention", "level", "metric", "value")
#: ``kv_attention_loss.csv``: per checkpoint, KV eviction run and evicted layer (then ``all``, pooled over
#: them), the counted query rows, and the mean share of a row's attention mass on the dropped pairs
#: (Devoto thesis, Eq. 4.5) by the method and by the oracle at the same budget on the same calls.
LOSS_COLUMNS = ("checkpoint", "intervention", "keep_ratio", "compression_ratio", *kv_eviction.LOSS_COLUMNS)
#: ``key_norm_attention.csv``: per checkpoint and causal decoder layer, the (key, head, sample) pairs and
#: the correlations of key L2 norm with the mean attention received from later queries.
KEY_NORM_COLUMNS = ("checkpoint", "layer", "pairs", "pearson", "spearman")


def key_norm_rows(key_norms: dict[str, dict[str, dict]]) -> list[tuple]:
    """``KEY_NORM_COLUMNS`` rows of checkpoint -> site -> :func:`key_norm_attention` (NaN as None)."""
    return [
        (label, site, e["pairs"], *(None if math.isnan(e[k]) else e[k] for k in ("pearson", "spearman")))
        for label, sites in key_norms.items()
        for site, e in sites.items()
    ]


def write_robustness_json(out: Path, meta: dict, robustness: list, losses: list) -> None:
    """``robustness.json``: the rows of ``robustness.csv`` and ``kv_attention_loss.csv`` with the split,
    the skipped layers and both ratio conventions."""
    keys = ("split", "kv_skip_layers", "keep_ratios", "compression_ratios", "kv_methods")
    payload = {
        **{k: meta[k] for k in keys},
        "attention_loss": "per counted query row, the share of its full attention mass on the past keys "
        "the method dropped (Devoto thesis, Eq. 4.5), averaged over rows; oracle_loss: the same for the "
        "keys the row itself weighs least, at the same budget on the same calls (the least possible)",
        "rows": [dict(zip(ROBUSTNESS_COLUMNS, r)) for r in robustness],
        "attention_losses": [dict(zip(LOSS_COLUMNS, r)) for r in losses],
    }
    (out / "robustness.json").write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")


def write_csv(path: Path, header: tuple, rows: list) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)  # csv writes None as an empty field


def write_stats(out: Path, results: dict, meta: dict, lm: dict | None = None) -> None:
    """``stats.csv`` (``checkpoint,layer,head,metric,value``) and ``stats.json`` (the same rows, the
    settings, the per-layer histograms, incoming attention and top sinks, and the ``lm`` analyses:
    ``massive_activations`` and ``extrapolation``, each by checkpoint)."""
    rows = [(label, *row) for label, stats in results.items() for row in metric_rows(stats)]
    write_csv(out / "stats.csv", ("checkpoint", "layer", "head", "metric", "value"), rows)
    payload = {
        **meta,
        "thresholds": {
            "multimodality": "keys with score > row mean + eps_multimodality (and < the row max)",
            "sparsity": "keys with score < row mean + eps_sparsity; s = smallest softmax probability of the row",
            "frac_below_1e-3": meta["settings"]["near_zero"],
            "gate_below_0.1": f"fraction of gate values below {meta['settings']['low_gate']} (gated attention)",
            "sink_ratio": f"fraction of key positions whose mean incoming attention exceeds "
            f"{meta['settings']['sink_eps']} x the uniform share (ratio form)",
        },
        "rows": [dict(zip(("checkpoint", "layer", "head", "metric", "value"), r)) for r in rows],
        "details": results,
        **(lm or {}),
    }
    (out / "stats.json").write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")


def gate_columns(results: dict) -> tuple[str, ...]:
    """The gate metrics, when any checkpoint of ``results`` (label -> statistics) has a gated site."""
    gated = any(
        m in entry["heads"] for stats in results.values() for entry in stats["sites"].values() for m in GATE_METRICS
    )
    return GATE_METRICS if gated else ()


def layer_means(stats: dict, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """Each metric (and each of ``extra``) averaged over layers (sites, or blocks for the token
    similarity); NaN where no layer has it."""
    means = {}
    for metric in HEAD_METRICS + LAYER_METRICS + extra:
        values = [v for _, head, m, v in metric_rows(stats) if m == metric and head is None and v is not None]
        means[metric] = sum(values) / len(values) if values else math.nan
    return means


def write_summary(
    out: Path,
    results: dict,
    meta: dict,
    figure_files: list[str],
    robustness: list,
    losses: list = (),
    key_norms: list = (),
    lm: dict | None = None,
) -> None:
    """``summary.md``: one row per checkpoint, one column per metric (mean over layers), the robustness
    rows, the attention loss pooled over layers (``losses`` as ``kv_attention_loss.csv``), the key norm
    correlations (``key_norms`` as ``key_norm_attention.csv``), the ``lm`` analyses (see
    :func:`write_stats`), and the figures."""
    columns = HEAD_METRICS + LAYER_METRICS + gate_columns(results)
    lines = [
        f"# Attention analysis: {meta['num_samples']} {meta['split']} samples",
        "",
        f"Thresholds: M above the row mean score + {meta['settings']['eps_multimodality']}, S below the row "
        f"mean + {meta['settings']['eps_sparsity']}; near zero < {meta['settings']['near_zero']}; sinks above "
        f"{meta['settings']['sink_eps']} x the uniform share. Values are means over layers (all attention "
        "kinds together; stats.csv has each layer)."
        + (
            f" gate_mean and gate_below_0.1 (gate values below {meta['settings']['low_gate']}): over the gated layers."
            if gate_columns(results)
            else ""
        ),
        "",
        "| checkpoint | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for label, stats in results.items():
        means = layer_means(stats, gate_columns(results))
        lines.append(f"| {label} | " + " | ".join(f"{means[c]:.4g}" for c in columns) + " |")
    if robustness:
        lines += [
            "",
            "## Robustness (whole split)",
            "",
            "| checkpoint | intervention | level | metric | value |",
            "|---|---|---|---|---|",
        ]
        lines += [f"| {c} | {i} | {lv} | {m} | {v:.4g} |" for c, i, lv, m, v in robustness]
    pooled = [r for r in losses if r[4] == "all"]
    if pooled:
        lines += [
            "",
            "## KV eviction: attention loss (whole split, pooled over the evicted layers)",
            "",
            "Keep ratio r; compression ratio 1 - r (the fraction dropped). Attention loss: the mean share of a "
            "query row's attention mass on the pairs dropped; oracle: the least possible at the same budget on "
            "the same calls. Each layer's values: kv_attention_loss.csv.",
            "",
            "| checkpoint | method | keep ratio | compression ratio | attention loss | oracle |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c} | {i.removeprefix('kv_')} | {r:g} | {cr:g} | {fmt(loss)} | {fmt(best)} |"
            for c, i, r, cr, _, _, loss, best in pooled
        ]
    if key_norms:
        lines += [
            "",
            f"## Key norm against received attention ({meta['num_samples']} {meta['split']} samples)",
            "",
            "Pairs (key L2 norm, mean attention from the later queries that see the key) over samples and heads.",
            "",
            "| checkpoint | layer | pairs | Pearson | Spearman |",
            "|---|---|---|---|---|",
        ]
        lines += [f"| {c} | {site} | {n} | {fmt(r)} | {fmt(rho)} |" for c, site, n, r, rho in key_norms]
    lines += lm_summary(lm or {})
    lines += ["", "## Figures", ""] + [f"- [{name}]({name})" for name in figure_files]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def fmt(value: float | None) -> str:
    """``value`` to 4 significant digits, or an em dash for None."""
    return "—" if value is None else f"{value:.4g}"


def lm_summary(lm: dict) -> list[str]:
    """The summary's sections of the massive activations (per checkpoint, the block with the largest
    mean ratio, and its largest entry) and of the length extrapolation (perplexity per multiple)."""
    lines = []
    massive = lm.get("massive_activations", {})
    if massive:
        lines += [
            "",
            "## Massive activations (block outputs)",
            "",
            "Per checkpoint, the block whose largest |h| is the most times its sample's median (mean over "
            "samples), and the largest entry of that block over all samples.",
            "",
            "| checkpoint | block | median | top 1 | ratio | massive | largest: position, token, dim, value |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, result in massive.items():
            name, entry = max(result["blocks"].items(), key=lambda kv: kv[1]["ratio"] or -1.0)
            top = entry["top"][0] if entry["top"] else None
            where = (
                "-"
                if top is None
                else f"{top['position']}, {top['token_text'] or top['token']}, {top['dim']}, {top['value']:.4g}"
            )
            top1 = entry["top_mean"][0] if entry["top_mean"] else None
            lines.append(
                f"| {label} | {name} | {fmt(entry['median'])} | {fmt(top1)} | {fmt(entry['ratio'])} | "
                f"{entry['massive']} | {where} |"
            )
    extrapolation = lm.get("extrapolation", {})
    if extrapolation:
        first = next(iter(extrapolation.values()))
        multiples = list(first["multiples"])
        lines += [
            "",
            f"## Length extrapolation ({first['positions']} positions, training context {first['context']})",
            "",
            "Perplexity over the same scored tokens, cut into windows of each multiple of the training context "
            "(—: past the model's learned position table).",
            "",
            "| checkpoint | " + " | ".join(f"{m}x" for m in multiples) + " |",
            "|---" * (len(multiples) + 1) + "|",
        ]
        for label, result in extrapolation.items():
            values = [fmt(e.get("ppl")) for e in result["multiples"].values()]
            lines.append(f"| {label} | " + " | ".join(values) + " |")
    return lines
