"""A table of experiments as a file: ``configs/tables/<name>.yaml``.

A table names a base config, its cells (each a set of command-line overrides of that config), the
seeds, the metric to report and the checkpoint it is taken from; optionally the paper's numbers::

    title: IWSLT14 de-en, detokenised sacreBLEU (paper Table 4)
    config: ../nmt_iwslt14_softmax.yaml     # relative to this file
    seeds: [0, 1, 2]
    metric: test/bleu                        # a val/* metric runs `validate`, a test/* metric `test`
    checkpoint: best                         # best (by the config's best_checkpoint) | last
    scale: 1                                 # the metric is multiplied by this (100: fraction -> %)
    digits: 1                                # decimals in the written table
    overrides: {}                            # applied to every cell
    cells:
      sparsemax:
        row: BLEU                            # where the cell goes in the written table
        column: SparseMax
        paper: 28.7                          # a number, or one per seed (the paper's runs)
        paper_std: 0.16
        overrides:
          model.init_args.model.attention: {name: sparsemax, options: {}}

Every (cell, seed) pair is one :class:`Run` with an ordinary run directory,
``<out>/<table>/<cell>/seed<seed>/``, holding ``fit/`` (TensorBoard version ``fit``: config,
events, ``checkpoints/``, ``final_metrics.json``) and, when the metric needs another evaluation,
``test/`` or ``validate/`` with that evaluation's ``final_metrics.json``
(:class:`mmlight.callbacks.FinalMetrics` writes both).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

METRICS_FILE = "final_metrics.json"
STATUS_FILE = "sweep_status.json"
TABLE_KEYS = {
    "title",
    "config",
    "seeds",
    "metric",
    "checkpoint",
    "scale",
    "digits",
    "overrides",
    "cells",
    "higher_is_better",
}
#: keys starting with this are ignored (a place for YAML anchors that cells share)
EXTENSION_PREFIX = "x-"
CELL_KEYS = {"row", "column", "config", "overrides", "paper", "paper_std", "metric", "scale"}


class TableError(ValueError):
    """A table file that cannot be used; the message names the file and the key."""


@dataclass
class Cell:
    """One cell of a table: a set of overrides of the base config.

    Args:
        name: the cell's key in the table file; also its folder name.
        row: the row label in the written table (default: the cell name).
        column: the column label (default: the table's metric).
        config: the base config of this cell (default: the table's).
        overrides: dotted config keys and values, given to ``mmlight`` as ``--key value``.
        paper: the paper's number (or one per run).
        paper_std: the paper's standard deviation, when it gives one.
        metric: the metric of this cell (default: the table's), e.g. when columns are different tasks.
        scale: its factor (default: the table's).
    """

    name: str
    row: str
    column: str
    config: Path
    metric: str
    scale: float
    overrides: dict[str, Any] = field(default_factory=dict)
    paper: float | list[float] | None = None
    paper_std: float | None = None

    @property
    def eval_stage(self) -> Literal["validate", "test"]:
        """The subcommand that evaluates the reported checkpoint."""
        return "validate" if self.metric.startswith("val/") else "test"


@dataclass
class Table:
    """A parsed table file (see the module docstring).

    Args:
        name: the file's stem.
        path: the table file.
        title: a heading for the written table.
        cells: the cells, in file order.
        seeds: every cell runs once per seed (``--seed_everything``).
        metric: the logged metric to report, ``val/*`` or ``test/*`` (a cell may name its own).
        checkpoint: ``best`` (the config's ``best_checkpoint``) or ``last`` (the final weights).
        scale: factor applied to the metric (e.g. 100 for a fraction shown in %).
        digits: decimals shown.
        higher_is_better: marks the best cell mean in the written table.
        overrides: applied to every cell, before the cell's own.
    """

    name: str
    path: Path
    title: str
    cells: list[Cell]
    seeds: list[int]
    metric: str
    checkpoint: Literal["best", "last"]
    scale: float = 1.0
    digits: int = 2
    higher_is_better: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)

    def runs(self, out: Path | str = "runs/tables") -> list[Run]:
        """Every (cell, seed) run, cells in file order, seeds inner; the list index is the run's
        task index (``SLURM_ARRAY_TASK_ID`` in ``slurm/sweep.sh``)."""
        return [
            Run(self, cell, seed, Path(out) / self.name / cell.name / f"seed{seed}", index=i * len(self.seeds) + j)
            for i, cell in enumerate(self.cells)
            for j, seed in enumerate(self.seeds)
        ]

    def cell(self, name: str) -> Cell:
        for cell in self.cells:
            if cell.name == name:
                return cell
        raise TableError(f"{self.path}: no cell {name!r}; cells are {[c.name for c in self.cells]}")


def override_args(overrides: dict[str, Any]) -> list[str]:
    """``--key value`` pairs; lists and mappings as JSON, which the config parser reads as YAML."""
    args = []
    for key, value in overrides.items():
        text = json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)
        args += [f"--{key}", text]  # JSON gives true / false / null for the YAML parser
    return args


@dataclass
class Run:
    """One (cell, seed) of a table and its run directory.

    Args:
        table: the table.
        cell: the cell.
        seed: the seed (``--seed_everything``).
        directory: the run directory (see the module docstring).
        index: position in :meth:`Table.runs`.
    """

    table: Table
    cell: Cell
    seed: int
    directory: Path
    index: int

    @property
    def label(self) -> str:
        return f"{self.cell.name}/seed{self.seed}"

    def stage_dir(self, stage: str) -> Path:
        """Where the ``fit``, ``validate`` or ``test`` step of this run logs."""
        return self.directory / stage

    def overrides(self, stage: str, extra: list[str] = ()) -> list[str]:
        """Command-line options of one step, after ``--config``: the table's and the cell's overrides,
        ``extra``, the seed, and a TensorBoard logger whose version is the step's folder."""
        logger = {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(self.directory.parent), "name": self.directory.name, "version": stage},
        }
        return [
            *override_args({**self.table.overrides, **self.cell.overrides}),
            *extra,
            "--seed_everything",
            str(self.seed),
            "--trainer.logger",
            json.dumps(logger),
            "--trainer.default_root_dir",
            str(self.stage_dir(stage)),
        ]

    def fit_args(self, extra: list[str] = ()) -> list[str]:
        """``mmlight`` arguments that train this run, resuming from its newest checkpoint (the run's
        own: ``--ckpt_path last`` searches the default root and the logger's name folder, both
        this run's)."""
        return ["fit", "--config", str(self.cell.config), *self.overrides("fit", extra), "--ckpt_path", "last"]

    def fit_done(self) -> bool:
        """True once fit ended normally (its metrics file exists)."""
        return read_metrics(self.stage_dir("fit")) is not None

    def eval_args(self, extra: list[str] = ()) -> list[str] | None:
        """``mmlight`` arguments that evaluate the reported checkpoint, or None when fit's own final
        metrics already hold the metric for that checkpoint (``last`` with a validation at the
        final step). Needs a finished fit (its metrics file names the checkpoints)."""
        fit = read_metrics(self.stage_dir("fit"))
        if fit is None:
            raise FileNotFoundError(
                f"{self.label}: fit has not finished ({self.stage_dir('fit') / METRICS_FILE} is missing)"
            )
        if self.value_from(fit, fit) is not None:
            return None
        checkpoint = self.reported_checkpoint(fit)
        if not checkpoint:
            raise FileNotFoundError(
                f"{self.label}: fit recorded no {self.table.checkpoint!r} checkpoint "
                f"(checkpoints: {fit.get('checkpoints')}); is best_checkpoint's monitor logged?"
            )
        stage = self.cell.eval_stage
        return [stage, "--config", str(self.cell.config), *self.overrides(stage, extra), "--ckpt_path", checkpoint]

    def reported_checkpoint(self, fit: dict) -> str | None:
        """The file of the table's checkpoint (``best`` or ``last``) that fit recorded."""
        return (fit.get("checkpoints") or {}).get(self.table.checkpoint)

    def value_from(self, record: dict | None, fit: dict) -> float | None:
        """The reported metric (scaled) in a metrics record, if it comes from the table's checkpoint:
        fit's own values count only for ``last`` and only when validated at the final step."""
        entry = (record or {}).get("metrics", {}).get(self.cell.metric)
        if entry is None:
            return None
        if record.get("stage") == "fit":
            if self.table.checkpoint != "last" or entry.get("step") != record.get("global_step"):
                return None
        elif not _same_file(record.get("checkpoint"), self.reported_checkpoint(fit)):
            return None  # evaluated another checkpoint (e.g. the table switched best <-> last)
        return float(entry["value"]) * self.cell.scale

    def result(self) -> float | None:
        """The reported value, or None when the run has not produced it."""
        fit = read_metrics(self.stage_dir("fit"))
        if fit is None:
            return None
        for record in (read_metrics(self.stage_dir(self.cell.eval_stage)), fit):
            value = self.value_from(record, fit)
            if value is not None:
                return value
        return None

    def status(self) -> str:
        """``done``, ``failed`` (the sweep recorded a failure), ``unfinished`` (started, no result)
        or ``missing`` (never started)."""
        if self.result() is not None:
            return "done"
        recorded = read_status(self.directory)
        if recorded and recorded.get("status") == "failed":
            return "failed"
        return "unfinished" if self.directory.is_dir() else "missing"


def _same_file(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def read_metrics(stage_dir: Path) -> dict | None:
    """The ``final_metrics.json`` of a run's stage folder, or None."""
    path = Path(stage_dir) / METRICS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TableError(f"{path} is not valid JSON ({err}); delete it to re-run that step") from None


def read_status(directory: Path) -> dict | None:
    path = Path(directory) / STATUS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_status(directory: Path, **record) -> None:
    """Record a run's outcome for ``collect`` (``status``: ``done``/``failed``, the log, the exit code)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STATUS_FILE).write_text(json.dumps(record, indent=1) + "\n")


def _number(value, what: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TableError(f"{path}: {what} must be a finite number, got {value!r}")
    return float(value)


def _parse_cell(name: str, spec: Any, table: dict, path: Path) -> Cell:
    if not isinstance(spec, dict):
        raise TableError(f"{path}: cell {name!r} must be a mapping with keys from {sorted(CELL_KEYS)}, got {spec!r}")
    unknown = sorted(set(spec) - CELL_KEYS)
    if unknown:
        raise TableError(f"{path}: cell {name!r} has unknown key(s) {unknown}; allowed: {sorted(CELL_KEYS)}")
    overrides = _overrides(spec.get("overrides"), f"cell {name!r}", path)
    paper = spec.get("paper")
    if isinstance(paper, list):
        paper = [_number(p, f"cell {name!r} paper", path) for p in paper]
    elif paper is not None:
        paper = _number(paper, f"cell {name!r} paper", path)
    paper_std = spec.get("paper_std")
    config = _config_path(spec.get("config", table.get("config")), f"cell {name!r}", path)
    metric = _metric(spec.get("metric", table["metric"]), f"cell {name!r} metric", path)
    return Cell(
        name=name,
        row=str(spec.get("row", name)),
        column=str(spec.get("column", metric)),
        config=config,
        metric=metric,
        scale=_number(spec.get("scale", table.get("scale", 1.0)), f"cell {name!r} scale", path),
        overrides=overrides,
        paper=paper,
        paper_std=None if paper_std is None else _number(paper_std, f"cell {name!r} paper_std", path),
    )


def _overrides(value: Any, where: str, path: Path) -> dict[str, Any]:
    value = value or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and not k.startswith("-") for k in value):
        raise TableError(f"{path}: {where}: overrides must map dotted config keys (no leading --) to values")
    return value


def _metric(value: Any, where: str, path: Path) -> str:
    if not isinstance(value, str) or not value.startswith(("val/", "test/")):
        raise TableError(f"{path}: {where} must be a logged val/* or test/* name (e.g. test/bleu), got {value!r}")
    return value


def _config_path(value: Any, where: str, path: Path) -> Path:
    if not isinstance(value, str):
        raise TableError(f"{path}: {where} needs a base config (key `config`, a path relative to the table file)")
    config = Path(
        os.path.normpath(path.parent / value)
    )  # relative to the table file; stays relative to the cwd when the table path is
    if not config.is_file():
        raise TableError(f"{path}: {where}: base config {value!r} not found (looked for {config})")
    return config


def load_table(path: str | Path) -> Table:
    """Parse and check a table file; every problem is a :class:`TableError` naming the file and key."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"table file {path} not found")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise TableError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(spec, dict):
        raise TableError(f"{path}: a table is a mapping with keys {sorted(TABLE_KEYS)}")
    unknown = sorted(k for k in set(spec) - TABLE_KEYS if not str(k).startswith(EXTENSION_PREFIX))
    if unknown:
        raise TableError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(TABLE_KEYS)}")
    metric = _metric(spec.get("metric"), "metric", path)
    checkpoint = spec.get("checkpoint", "best")
    if checkpoint not in ("best", "last"):
        raise TableError(f"{path}: checkpoint must be 'best' or 'last', got {checkpoint!r}")
    seeds = spec.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise TableError(f"{path}: seeds must be a non-empty list of distinct integers, got {seeds!r}")
    cells = spec.get("cells")
    if not isinstance(cells, dict) or not cells:
        raise TableError(f"{path}: cells must be a non-empty mapping of cell name -> cell")
    for name in cells:
        if not isinstance(name, str) or not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            raise TableError(
                f"{path}: cell name {name!r} must be letters, digits, '_', '-' or '.' (it is a folder name)"
            )
    overrides = _overrides(spec.get("overrides"), "table", path)
    digits = spec.get("digits", 2)
    if not isinstance(digits, int) or isinstance(digits, bool) or not 0 <= digits <= 10:
        raise TableError(f"{path}: digits must be an integer from 0 to 10, got {digits!r}")
    return Table(
        name=path.stem,
        path=path,
        title=str(spec.get("title", path.stem)),
        cells=[_parse_cell(name, cell, spec, path) for name, cell in cells.items()],
        seeds=seeds,
        metric=metric,
        checkpoint=checkpoint,
        scale=_number(spec.get("scale", 1.0), "scale", path),
        digits=digits,
        higher_is_better=bool(spec.get("higher_is_better", not metric.endswith(("ppl", "loss")))),
        overrides=overrides,
    )
