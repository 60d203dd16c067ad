"""Names in the docs exist: every backticked config key, ``mmlight.*`` Python name and repository path in
README.md, BENCHMARKS.md and docs/**/*.md resolves in the code as it is today.

* a config key (``model.init_args.compile``, ``--data.init_args.batch_size 8``) is a key of the
  configuration that ``mmlight fit --print_config`` prints for one of the quick starts' tasks (one
  process, the three printouts cached), ``init_args`` optional as the command line allows;
* a dotted ``mmlight.`` name imports (a module, then attributes);
* a path rooted at a folder of the repository (``configs/``, ``docs/``, ``slurm/``, ...) matches a file
  or folder that git knows (``<name>`` and ``*`` match any name).

Code and test references of the form ``path.py::name`` are ``tests/test_docs.py``'s.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch import Trainer

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
#: the repository's top-level folders a path in the docs may start with
TRACKED_ROOTS = ("configs/", "docs/", "mmlight/", "tests/", "benchmarks/", "tools/", "slurm/", "docker/", ".ci/")
#: the quick starts whose printed configs hold every key of their task
CONFIGS = (
    "configs/quickstart/digits_multimax.yaml",
    "configs/quickstart/lm_multimax.yaml",
    "configs/quickstart/nmt_multimax.yaml",
    "configs/finetune/digits_6to9.yaml",
    "configs/deit_small_multimax.yaml",
)
#: config keys the docs name that no printed quick-start config holds, with the reason
NOT_PRINTED = {
    "trainer.callbacks.every_n_epochs": "an AttentionStats option, once the callback is added",
    "trainer.callbacks.num_samples": "an AttentionStats option, once the callback is added",
}


def spans(path: Path) -> list[str]:
    """The backticked spans of a Markdown file outside its fenced blocks."""
    return SPAN.findall(FENCE.sub("", path.read_text(encoding="utf-8")))


def doc_spans() -> list[tuple[str, str]]:
    return sorted({(p.relative_to(ROOT).as_posix(), s) for p in DOCS for s in spans(p)})


SPANS = doc_spans()
CONFIG_KEY = re.compile(r"^(?:--)?((?:model|data|trainer)\.[\w.]+)(?:[ =+].*)?$")
#: a file name that starts like a config key (``model.safetensors``)
FILE_NAME = re.compile(r"\.(safetensors|pth|pt|ckpt|yaml|json|txt)$")
PYTHON_NAME = re.compile(r"^(mmlight(?:\.\w+)+)(?:\(.*\))?$")
PATH = re.compile(r"^(?:" + "|".join(re.escape(r) for r in TRACKED_ROOTS) + r")[\w./<>*{},-]*$")


@functools.cache
def printed_keys() -> frozenset[str]:
    """Every key of the configs ``mmlight fit --print_config`` prints, dotted, with and without
    ``init_args`` (in this process: the suite has imported the CLI anyway)."""
    from mmlight.cli import main

    keys: set[str] = set()
    argv = sys.argv
    try:
        sys.argv = ["mmlight"]  # LightningCLI warns when sys.argv holds pytest's arguments
        for config in CONFIGS:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
                main(["fit", "--config", str(ROOT / config), "--print_config"])
            keys |= dotted_keys(yaml.safe_load(out.getvalue()))
    finally:
        sys.argv = argv
    return frozenset(keys | {k.replace(".init_args", "") for k in keys})


def dotted_keys(tree, prefix: str = "") -> set[str]:
    """Every key path of a nested dict (lists of dicts: their items' keys under the list's key)."""
    found = set()
    items = tree.items() if isinstance(tree, dict) else []
    for key, value in items:
        path = f"{prefix}{key}"
        found.add(path)
        for child in value if isinstance(value, list) else [value]:
            found |= dotted_keys(child, path + ".")
    return found


@functools.cache
def tracked() -> list[str]:
    command = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = listed.split()
    folders = {"/".join(f.split("/")[:i]) + "/" for f in files for i in range(1, f.count("/") + 1)}
    return files + sorted(folders)


def resolves_as_path(span: str) -> bool:
    pattern = re.sub(r"<[^>]+>|\{[^}]*\}", "*", span)
    return any(fnmatch.fnmatch(f, pattern) or fnmatch.fnmatch(f, pattern.rstrip("/") + "/") for f in tracked())


def resolves_as_python(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


KEYS = [(d, s) for d, s in SPANS if CONFIG_KEY.match(s) and not FILE_NAME.search(s)]
NAMES = [(d, s) for d, s in SPANS if PYTHON_NAME.match(s)]
PATHS = [(d, s) for d, s in SPANS if PATH.match(s) and "::" not in s]


def test_the_extraction_finds_each_kind():
    assert CONFIG_KEY.match("--model.init_args.compile true")[1] == "model.init_args.compile"
    assert PYTHON_NAME.match("mmlight.nn.attention")[1] == "mmlight.nn.attention"
    assert PATH.match("configs/tables/<name>.yaml") and not PATH.match("runs/<name>")
    assert len(KEYS) > 5 and len(NAMES) > 5 and len(PATHS) > 20
    assert resolves_as_path("configs/tables/<table>.yaml") and not resolves_as_path("configs/none.yaml")
    assert resolves_as_python("mmlight.reweighting.build") and not resolves_as_python("mmlight.nothing")


@pytest.mark.parametrize("doc, span", KEYS, ids=[f"{d}:{s[:50]}" for d, s in KEYS])
def test_every_config_key_is_in_a_printed_config(doc, span):
    key = CONFIG_KEY.match(span)[1].rstrip(".")
    if key in NOT_PRINTED:
        return
    if key.startswith("trainer.") and hasattr(Trainer, key.split(".")[1]):  # the Trainer's attribute, in Python
        return
    keys = printed_keys()
    short = key.replace(".init_args", "")
    # a nested key may be named from its own level: `model.pretrained` is model.init_args.model.pretrained
    found = key in keys or short in keys or any(k.endswith("." + short) for k in keys)
    assert found, f"{doc}: no config key {key}"


@pytest.mark.parametrize("doc, span", NAMES, ids=[f"{d}:{s[:50]}" for d, s in NAMES])
def test_every_python_name_imports(doc, span):
    assert resolves_as_python(PYTHON_NAME.match(span)[1]), f"{doc}: {span} does not import"


@pytest.mark.parametrize("doc, span", PATHS, ids=[f"{d}:{s[:50]}" for d, s in PATHS])
def test_every_repository_path_exists(doc, span):
    assert resolves_as_path(span), f"{doc}: {span} is not in git"
