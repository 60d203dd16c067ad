"""English text that ships with Python, as BPE token shards (``mmlight prepare python-docs --out DIR``):
a corpus for CPU runs that needs no download.

The documents, in this order:

* every help topic of ``pydoc_data.topics`` (the reference manual's sections that ``help("if")``
  prints), one document per topic, by topic name;
* every module of the standard library (its ``.py`` files, the ``test``/``tests``, ``idlelib`` and
  ``site-packages`` folders left out), one document per module: its docstring and those of its
  classes and functions, in source order, separated by blank lines; a module without any is left out.

:func:`write_corpus` writes them as ``python-docs.jsonl`` (``{"id", "text"}`` per line) under
``DIR/source/``, then :func:`mmlight.data.prepare.text.prepare` makes the shard set from it, with the
same options as ``mmlight prepare text``. The corpus depends on the Python build: its version is
recorded in ``_info.json`` (``python``). A standard-library file that does not parse is skipped and
named there, as any bad input.
"""

from __future__ import annotations

import ast
import json
import logging
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from mmlight.data.prepare import text
from mmlight.data.shard_writer import Skipped
from mmlight.data.shards import write_info, write_text_atomic

log = logging.getLogger(__name__)

NEEDS_SRC = False
SRC_HELP = "not used: the corpus is built from the running Python"
CORPUS_FILE = "source/python-docs.jsonl"
#: folders of the standard library left out (tests are code and data, not prose)
LEFT_OUT = frozenset({"test", "tests", "idlelib", "site-packages"})
add_arguments = text.add_arguments


def topics() -> Iterator[tuple[str, str]]:
    """``(id, text)`` of every ``pydoc_data`` help topic, sorted by name."""
    from pydoc_data.topics import topics as by_name

    for name in sorted(by_name):
        yield f"topic:{name}", by_name[name]


def module_files(stdlib: Path) -> list[Path]:
    """The standard library's ``.py`` files, sorted, without the :data:`LEFT_OUT` folders."""
    return [p for p in sorted(stdlib.rglob("*.py")) if not LEFT_OUT & set(p.relative_to(stdlib).parts[:-1])]


def module_text(source: bytes) -> str:
    """A module's docstrings (module, classes, functions) in source order, separated by blank lines."""
    tree = ast.parse(source)
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [node for node in ast.walk(tree) if isinstance(node, nodes)]
    found.sort(key=lambda node: getattr(node, "lineno", 0))  # the module (no lineno) first
    docs = (ast.get_docstring(node) for node in found)
    return "\n\n".join(doc for doc in docs if doc)


def documents(stdlib: Path, skipped: list[Skipped]) -> Iterator[tuple[str, str]]:
    """``(id, text)`` of the corpus (see the module docstring); a file that does not parse goes to ``skipped``."""
    yield from topics()
    for path in module_files(stdlib):
        try:
            doc = module_text(path.read_bytes())
        except (SyntaxError, ValueError, OSError) as err:  # ValueError: a null byte in the source
            skipped.append(Skipped(str(path), f"does not parse: {type(err).__name__}: {err}"))
            continue
        if doc:
            yield f"module:{path.relative_to(stdlib).with_suffix('').as_posix().replace('/', '.')}", doc


def write_corpus(path: Path, stdlib: Path | None = None) -> list[Skipped]:
    """Write the corpus to ``path`` as jsonl (an identical file is left untouched, so a rerun resumes);
    return the skipped files.

    Args:
        path: the jsonl file to write.
        stdlib: the standard library folder; None is the running Python's.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"]) if stdlib is None else stdlib
    skipped: list[Skipped] = []
    lines = "".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n" for i, t in documents(stdlib, skipped))
    if not (path.is_file() and path.read_text(encoding="utf-8") == lines):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, lines)
    log.info("python-docs corpus %s: %d documents", path, lines.count("\n"))
    return skipped


def prepare(src: Path | None, out: Path, workers: int = 1, stdlib: Path | None = None, **options) -> dict:
    """Write the corpus under ``out`` and prepare it as ``mmlight prepare text`` does (``options`` are
    :func:`mmlight.data.prepare.text.prepare`'s); ``src`` is not used, ``stdlib`` as :func:`write_corpus`."""
    out = Path(out)
    skipped = write_corpus(out / CORPUS_FILE, stdlib)
    info = text.prepare([out / CORPUS_FILE], out, workers, **options)
    for s in skipped:
        log.warning("skipped %s: %s", s.path, s.reason)
    extra = [{"path": s.path, "reason": s.reason} for s in skipped]
    info.update(dataset="python-docs", python=platform.python_version())
    info.update(num_skipped=info["num_skipped"] + len(extra), skipped=extra + info["skipped"])
    return write_info(out, info)
