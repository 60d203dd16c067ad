"""Render the lists of README.md, docs/*.md and BENCHMARKS.md that mirror the code, from the code.

    python tools/render_docs.py            # names every stale block; exit status 1 when there is one
    python tools/render_docs.py --update   # rewrites the stale blocks in place

A document holds each list between ``<!-- rendered: NAME -->`` and ``<!-- /rendered -->``, where NAME
is a key of :data:`RENDERERS`; the text between the markers is exactly what the renderer returns (a
table or list starts and ends with a blank line, an inline list has none). ``tests/tools/test_render_docs.py``
fails when a block differs from what this script renders today, the way
``tests/benchmarks/test_results_files.py`` checks the tables of ``benchmarks/report.py``.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is a package of the repository, not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.targets import TARGETS  # noqa: E402

#: the documents that may hold rendered blocks
DOCS = ("README.md", "BENCHMARKS.md", "docs")
BLOCK = re.compile(r"<!-- rendered: ([\w-]+) -->(.*?)<!-- /rendered -->", re.S)
#: how each declared row mass reads in a table
ROW_MASS = {"one": "1", "at_most_one": "≤ 1", "unbounded": "unbounded (each weight ≤ 1)"}
#: the kernel modules whose module-level booleans are the kernel switches
SWITCH_MODULES = ("attention", "rowwise", "cross_entropy")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table with a blank line before and after, as a block holds it (the markers on lines of their own)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n\n" + "\n".join(lines) + "\n\n"


def words_list(names: list[str]) -> str:
    """``a``, ``b`` and ``c``, in backticks."""
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def one_line(text: str | None, sentence: bool = False) -> str:
    """The first paragraph (``sentence``: its first sentence) of a docstring or comment on one line, reST
    literals and roles made Markdown code."""
    paragraph = " ".join(inspect.cleandoc(text or "").split("\n\n")[0].split())
    if sentence:
        paragraph = re.split(r"(?<=\.)\s", paragraph.removesuffix("::"), maxsplit=1)[0].removesuffix(":")
    paragraph = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", paragraph)  # Sphinx roles: :class:`~a.B` -> ``a.B``
    return re.sub(r"``(.+?)``", r"`\1`", paragraph).replace("|", "\\|")


def defaults(cls: type, skip: tuple[str, ...] = ("self", "backend")) -> str:
    """``name=default`` of every ``__init__`` argument of ``cls`` but ``skip``."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    shown = [f"`{p.name}={p.default!r}`" for p in parameters if p.name not in skip]
    return ", ".join(shown) or "—"


def reweightings() -> str:
    """Every registered function: what its rows sum to (``Reweighting.row_mass``) and its options."""
    from mmlight.reweighting.registry import available, registered

    rows = [[f"`{name}`", ROW_MASS[registered(name).row_mass], defaults(registered(name))] for name in available()]
    return table(["function", "rows sum to", "options and defaults"], rows)


def null_mass() -> str:
    """The functions whose rows may sum to something other than one, in the registry's order."""
    from mmlight.reweighting.registry import available, registered

    return words_list([name for name in available() if registered(name).row_mass != "one"])


def preparers() -> str:
    """The datasets of ``mmlight prepare``: module, whether ``--src`` is needed, and what each reads."""
    import importlib

    from mmlight.data.prepare import DATASETS

    rows = []
    for name, module_name in DATASETS.items():
        module = importlib.import_module(module_name)
        src = "yes" if getattr(module, "NEEDS_SRC", True) else "no"
        path = module_name.replace(".", "/") + ".py"
        rows.append([f"`{name}`", f"`{path}`", src, one_line(module.__doc__)])
    return table(["dataset", "preparer", "`--src`", "what it reads"], rows)


def commands() -> str:
    """Every ``mmlight`` command with the line ``mmlight --help`` shows."""
    from mmlight.cli import commands as listed

    return table(["command", "what it does"], [[f"`mmlight {name}`", line] for name, line in listed().items()])


def switch_comments(path: Path) -> dict[str, tuple[bool, str]]:
    """The module-level boolean constants of a kernel module, with their value and ``#:`` comment."""
    source = path.read_text()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and type(node.value.value) is bool:
            comment, i = [], node.lineno - 2
            while i >= 0 and lines[i].startswith("#:"):
                comment.insert(0, lines[i][2:].strip())
                i -= 1
            found[node.targets[0].id] = (node.value.value, " ".join(comment))
    return found


def kernel_switches() -> str:
    """The kernel switches (module-level booleans of the kernels), their defaults and what they change."""
    rows = []
    for module in SWITCH_MODULES:
        for name, (value, comment) in switch_comments(ROOT / "mmlight" / "kernels" / f"{module}.py").items():
            rows.append([f"`{module}.{name}`", "on" if value else "off", one_line(comment)])
    return table(["switch", "default", "what it changes"], rows)


def default_callbacks() -> str:
    """The callbacks every ``mmlight fit`` has (``lightning_cli.py::trainer_defaults``) and what they do."""
    from mmlight.lightning_cli import trainer_defaults

    rows = []
    for callback in trainer_defaults()["callbacks"]:
        cls = type(callback)
        rows.append([f"`{public_name(cls)}`", one_line(cls.__doc__, sentence=True)])
    return table(["callback", "what it does"], rows)


def public_name(cls: type) -> str:
    """``package.Name`` for the shortest package of ``cls``'s module that exports it."""
    import importlib

    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        package = ".".join(parts[:end])
        if getattr(importlib.import_module(package), cls.__name__, None) is cls:
            return f"{package}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__name__}"


def protocol_lines(protocol: type) -> list[str]:
    """``- `member`: its doc`` for each member of a protocol class, from the source of tasks/protocol.py."""
    from mmlight.tasks import protocol as module

    source = Path(module.__file__).read_text()
    lines = source.splitlines()
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == protocol.__name__)
    items = []
    for node in body.body:
        if isinstance(node, ast.AnnAssign):
            comment, i = [], node.lineno - 2
            while lines[i].strip().startswith("#:"):
                comment.insert(0, lines[i].strip().removeprefix("#:"))
                i -= 1
            items.append(f"- `{node.target.id}`: {one_line(' '.join(comment))}")
        elif isinstance(node, ast.FunctionDef):
            arguments = ", ".join(a.arg for a in node.args.args[1:])
            items.append(f"- `{node.name}({arguments})`: {one_line(ast.get_docstring(node))}")
    return items


def task_members() -> str:
    """The members of the two task protocols, training's first."""
    from mmlight.tasks.protocol import AnalysedTask, TrainedTask

    lines = ["", "", "For training (`tasks/protocol.py::TrainedTask`):", "", *protocol_lines(TrainedTask)]
    lines += ["", "For attention analysis (`tasks/protocol.py::AnalysedTask`):", "", *protocol_lines(AnalysedTask)]
    return "\n".join(lines) + "\n\n"


def targets() -> str:
    """The performance targets of the MultiMax kernels (``benchmarks/targets.py``)."""
    rows = [[t.label, f"{'≤' if t.at_most else '≥'} {t.bound:g}"] for t in TARGETS.values()]
    return table(["target", "bound"], rows)


def experiment_tables() -> str:
    """The table files of ``configs/tables/``: the runs each holds (cells × seeds) and its title."""
    from mmlight.experiments.table import load_table

    rows = []
    for path in sorted((ROOT / "configs" / "tables").glob("*.yaml")):
        parsed = load_table(path)
        rows.append([f"`{path.name}`", str(len(parsed.runs())), one_line(parsed.title)])
    return table(["table", "runs", "title"], rows)


def analyze_options() -> str:
    """The options of ``mmlight analyze`` (``commands/analyze.py::OPTIONS``): default and help."""
    from mmlight.commands.analyze import OPTIONS, shown_default

    def default(options: dict) -> str:
        if options.get("required"):
            return "required"
        return "off" if options.get("action") == "store_true" else shown_default(options) or "—"

    rows = [[f"`{flag}`", default(options), options["help"].replace("|", "\\|")] for flag, options in OPTIONS]
    return table(["option", "default", "what it sets"], rows)


#: the head dims whose tiles the tile table shows, each standing for its band (the config functions branch at 32 and 64)
HEAD_DIM_BANDS = ((32, "≤ 32"), (64, "33–64"), (128, "> 64"))


def tile(config) -> str:
    """``128 × 64, 8 warps, 2 stages`` of a :class:`~mmlight.kernels.tiles.BlockConfig`."""
    return f"{config.block_m} × {config.block_n}, {config.num_warps} warps, {config.num_stages} stages"


def tile_sizes() -> str:
    """The offline tiles of the attention kernels (``forward_config``, ``backward_configs``) by capability,
    dtype and head dim, and the row-wise kernel's (``_launch_config``) by row length: what launches where
    ``tiles.MEASURED`` has no row."""
    from unittest import mock

    import torch

    from mmlight.kernels import attention, rowwise, tiles

    with mock.patch.dict(tiles.MEASURED, clear=True):
        rows = []
        for capability in (80, 90):
            for dtype, dtype_name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16, fp16")):
                for head_dim, band in HEAD_DIM_BANDS:
                    configs = (
                        attention.forward_config(head_dim, dtype, capability),
                        *attention.backward_configs(head_dim, dtype, capability),
                    )
                    rows.append([f"sm_{capability}", dtype_name, band, *map(tile, configs)])
        top = rowwise.MAX_SINGLE_BLOCK
        edges = [2**k for k in range(4, top.bit_length())]  # 16, 32, ... up to the longest one-block row
        bands = [(1 if i == 0 else edges[i - 1] + 1, edge) for i, edge in enumerate(edges)]
        launches = [rowwise._launch_config(edge) for edge in edges] + [rowwise._launch_config(top + 1)]
    attention_table = table(["GPU", "dtype", "head dim", "forward", "dK/dV", "dQ (and delta)"], rows)
    names = [f"{low:,}–{high:,}" for low, high in bands] + [f"more than {top:,}"]
    rowwise_rows = [
        [name, str(c["ROWS"]), f"{c['BLOCK_N']:,}", str(c["num_warps"])] for name, c in zip(names, launches)
    ]
    return (
        attention_table
        + "The row-wise kernel, on every GPU and dtype (a tile is as wide as the row rounded up to a power of two,"
        + f" and a longer row loops over tiles of {rowwise.LONG_ROW_BLOCK:,}):"
        + table(["row length", "rows per program", "tile width at the band's top", "warps"], rowwise_rows)
    )


def mutation_sets() -> str:
    """The sets of ``tools/mutation.py`` (``MODULES``) with the files each mutates, and the Triton kernel
    files no set mutates (``BY_HAND``)."""
    from tools.mutation import BY_HAND, MODULES

    rows = [
        [f"`{name}`", ", ".join(f"`{g.removeprefix('mmlight/')}`" for g in module.mutate)]
        for name, module in MODULES.items()
    ]
    return (
        table(["set", "files mutated (under `mmlight/`)"], rows)
        + "Not mutated: "
        + words_list([f.removeprefix("mmlight/") for f in BY_HAND])
        + "."
    )


RENDERERS: dict[str, Callable[[], str]] = {
    "reweightings": reweightings,
    "null-mass": null_mass,
    "preparers": preparers,
    "commands": commands,
    "kernel-switches": kernel_switches,
    "default-callbacks": default_callbacks,
    "task-members": task_members,
    "targets": targets,
    "experiment-tables": experiment_tables,
    "analyze-options": analyze_options,
    "tile-sizes": tile_sizes,
    "mutation-sets": mutation_sets,
}


def documents() -> list[Path]:
    """README.md, BENCHMARKS.md and every Markdown file under docs/."""
    found = []
    for name in DOCS:
        path = ROOT / name
        found += sorted(path.rglob("*.md")) if path.is_dir() else [path]
    return found


def render(text: str, where: str = "") -> str:
    """``text`` with every rendered block as the code gives it today; an unknown block name stops, named."""
    unknown = sorted({name for name, _ in BLOCK.findall(text)} - set(RENDERERS))
    if unknown:
        raise SystemExit(f"{where}: unknown rendered block(s) {unknown}; known: {sorted(RENDERERS)}")
    outputs = {name: RENDERERS[name]() for name in {name for name, _ in BLOCK.findall(text)}}
    return BLOCK.sub(lambda m: f"<!-- rendered: {m[1]} -->{outputs[m[1]]}<!-- /rendered -->", text)


def stale_blocks(path: Path) -> list[str]:
    """The names of the blocks of ``path`` whose text differs from what the code renders."""
    text = path.read_text()
    fresh = dict(BLOCK.findall(render(text, str(path))))
    return [name for name, body in BLOCK.findall(text) if body != fresh[name]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the stale blocks in place")
    args = parser.parse_args(argv)
    stale = 0
    for path in documents():
        names = stale_blocks(path)
        if not names:
            continue
        stale += len(names)
        if args.update:
            path.write_text(render(path.read_text(), str(path)))
        print(f"{path.relative_to(ROOT)}: {'rendered' if args.update else 'stale'}: {', '.join(names)}")
    return 1 if stale and not args.update else 0


if __name__ == "__main__":
    sys.exit(main())
