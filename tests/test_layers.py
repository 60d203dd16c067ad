"""The package's layers, checked on its source: what each module under ``mmlight/`` imports.

An import is every ``import`` and ``from ... import`` (lazy ones inside functions included) and every
string that names a module the way the command tables do: an entry point (``"mmlight.commands.doctor:main"``,
anywhere) or a module as a value of a dict display (``{"iwslt14": "mmlight.data.prepare.iwslt"}``). The
``mmlight`` command and ``mmlight prepare`` import those on use. ``python -m mmlight.cli`` in a subprocess
is a process started, not an import.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import mmlight
from tests.helpers.imports import imported_names as imports_of

PACKAGE = Path(mmlight.__file__).parent
REPO = PACKAGE.parent

#: Bottom first. A module belongs to the longest container naming it (``mmlight.data.prepare`` is in
#: ``mmlight.data``). It may import its own container and every layer below its own; containers of one layer
#: are independent, neither imports the other.
LAYERS = (
    ("mmlight",),  # the package's root: its version, nothing else
    ("mmlight.kernels", "mmlight.safe_load"),  # Triton kernels; files read as data
    ("mmlight.reweighting",),  # the functions, their registry and backends
    ("mmlight.nn",),  # the attention entry point and its observation point
    ("mmlight.models", "mmlight.data"),  # networks; shards and DataModules
    ("mmlight.tasks", "mmlight.export"),  # LightningModules; networks exported to other ecosystems
    ("mmlight.analysis",),  # statistics and interventions on observed attention
    ("mmlight.callbacks",),
    ("mmlight.ckpt_path", "mmlight.slurm", "mmlight.experiments"),  # run helpers; tables of runs
    ("mmlight.lightning_cli",),  # fit, validate, test and predict
    ("mmlight.commands",),  # prepare, analyze, sweep, collect, export and doctor
    ("mmlight.cli",),  # the `mmlight` command
)

#: where the `mmlight` command finds the commands outside LightningCLI, by name only
COMMAND_TABLE = "mmlight.cli"

#: a string naming a module: ``pkg.module`` or the entry point ``pkg.module:function``
MODULE_STRING = re.compile(r"mmlight(\.\w+)+(:\w+)?")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every dotted name ``source`` imports (:func:`tests.helpers.imports.imported_names`) or names as a
    module string."""
    names = imports_of(source, module, is_package)
    for node in ast.walk(ast.parse(source)):
        if is_module_string(node) and ":" in node.value:
            names.add(node.value.split(":")[0])
        elif isinstance(node, ast.Dict):
            names.update(value.value for value in node.values if is_module_string(value))
    return names


def is_module_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(MODULE_STRING.fullmatch(node.value))


def resolve(name: str) -> str | None:
    """The module of the package that importing ``name`` runs last: ``name`` itself, or the longest
    module prefix of it (``mmlight.tasks.ImageClassifier`` -> ``mmlight.tasks``); None outside."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules():
            return ".".join(parts[:end])
    return None


@cache
def imports() -> dict[str, set[str]]:
    """Module -> the other modules of the package it imports."""
    graph = {}
    for name, path in modules().items():
        found = imported_names(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
        graph[name] = {resolve(n) for n in found if resolve(n) not in (None, name)}
    return graph


def external_imports(module: str) -> set[str]:
    """The top-level names of what ``module`` imports from outside the package."""
    path = modules()[module]
    found = imported_names(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
    return {n.split(".")[0] for n in found if n and resolve(n) is None}


def container_of(module: str) -> tuple[int, str] | None:
    """``(layer index, container)`` of ``module``: its longest declared container, or None."""
    matches = [
        (len(c), i, c)
        for i, layer in enumerate(LAYERS)
        for c in layer
        if module == c or (c != "mmlight" and module.startswith(c + "."))
    ]
    return max(matches)[1:] if matches else None


def violations(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` (module -> the modules it imports) that go up or sideways."""
    bad = []
    for module, targets in graph.items():
        layer, container = container_of(module)
        for target in sorted(targets):
            target_layer, target_container = container_of(target)
            if target_container != container and target_layer >= layer:
                bad.append(f"{module} (layer {layer}) imports {target} (layer {target_layer}, {target_container})")
    return bad


def test_the_reader_sees_every_form_of_import():
    source = '''
"""Docs may name mmlight.cli without importing it."""
import mmlight.data.prepare.iwslt
from mmlight.reweighting import backend, build
from . import sibling
from .. import tasks
TOOLS = {"doctor": Tool("mmlight.commands.doctor:main"), "label": "mmlight is ok", "a": "mmlight.data.prepare.wikitext"}
RUN = ["python", "-m", "mmlight.cli", "fit"]

def later():
    from mmlight.callbacks.step_seed import StepSeed
'''
    names = imported_names(source, "mmlight.data.text", is_package=False)
    assert {
        "mmlight.data.prepare.iwslt",
        "mmlight.reweighting.backend",
        "mmlight.reweighting.build",
        "mmlight.data.sibling",
        "mmlight.tasks",
        "mmlight.commands.doctor",
        "mmlight.callbacks.step_seed",
        "mmlight.data.prepare.wikitext",
    } <= names
    assert "mmlight.cli" not in names and "mmlight is ok" not in names
    assert imported_names("from . import x", "mmlight.data", is_package=True) >= {"mmlight.data.x"}
    assert resolve("mmlight.reweighting.build") == "mmlight.reweighting"
    assert resolve("mmlight.data.prepare.iwslt") == "mmlight.data.prepare.iwslt"
    assert resolve("numpy.random") is None
    assert container_of("mmlight.commands.analyze") == (10, "mmlight.commands")
    assert container_of("mmlight.data.prepare.iwslt") == (4, "mmlight.data")
    assert container_of("mmlight.analysis.stats") == (6, "mmlight.analysis")


def test_the_checker_finds_an_upward_and_a_sideways_import():
    graph = {
        "mmlight.nn.attention": {"mmlight.tasks.stages"},
        "mmlight.models.vit": {"mmlight.data.shards"},
        "mmlight.tasks.optim": {"mmlight.tasks.stages", "mmlight.reweighting"},
        "mmlight.commands.analyze": {"mmlight.lightning_cli", "mmlight.analysis.stats"},
        "mmlight.analysis.stats": {"mmlight.commands.analyze"},
    }
    assert violations(graph) == [
        "mmlight.nn.attention (layer 3) imports mmlight.tasks.stages (layer 5, mmlight.tasks)",
        "mmlight.models.vit (layer 4) imports mmlight.data.shards (layer 4, mmlight.data)",
        "mmlight.analysis.stats (layer 6) imports mmlight.commands.analyze (layer 10, mmlight.commands)",
    ]


def test_every_module_has_a_layer():
    assert [m for m in modules() if container_of(m) is None] == []
    assert {"mmlight.cli", "mmlight.kernels.rowwise", "mmlight.data.prepare.iwslt"} <= set(modules())


def test_imports_go_down_the_layers():
    """Kernels are checked on their own, below."""
    assert violations({m: imports()[m] for m in modules() if container_of(m)[1] != "mmlight.kernels"}) == []


def test_kernels_import_nothing_from_the_rest_of_mmlight():
    assert violations({m: imports()[m] for m in modules() if container_of(m)[1] == "mmlight.kernels"}) == []


def test_the_layers_have_no_exceptions():
    """Every container is a whole package or a top-level module: no module is carved out of its package into
    another layer (as ``mmlight prepare``'s and ``mmlight analyze``'s modules once were)."""
    containers = [c for layer in LAYERS for c in layer]
    assert len(containers) == len(set(containers))
    assert [(a, b) for a in containers for b in containers if a != "mmlight" and b.startswith(a + ".")] == []
    assert all(c == "mmlight" or c.count(".") == 1 for c in containers)


def test_the_runtime_never_imports_the_preparers_benchmarks_or_tools():
    """Only the commands and the command table (``--help`` names the datasets) import ``mmlight prepare``'s
    modules; nothing in the package imports the scripts of benchmarks/ or tools/ (by package or by file
    name)."""
    preparers = [m for m in modules() if m.startswith("mmlight.data.prepare")]
    commands = [m for m in modules() if m == COMMAND_TABLE or m.startswith("mmlight.commands")]
    runtime = [m for m in modules() if m not in preparers and m not in commands]
    assert {m: sorted(imports()[m] & set(preparers)) for m in runtime if imports()[m] & set(preparers)} == {}
    folders = ("benchmarks", "tools")
    scripts = {*folders, *(path.stem for folder in folders for path in (REPO / folder).glob("*.py"))}
    assert {m: sorted(external_imports(m) & scripts) for m in modules() if external_imports(m) & scripts} == {}


def reached_from(roots: set[str]) -> set[str]:
    """Every module importing ``roots`` runs: their imports, their parent packages, and the submodules of
    a package that imports all of them (``pkgutil.iter_modules(__path__)``, the reweighting registry)."""
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:end]) for end in range(1, len(parts))]
        todo += imports()[module]
        if "pkgutil.iter_modules(__path__)" in modules()[module].read_text(encoding="utf-8"):
            todo += [m for m in modules() if m.rpartition(".")[0] == module]
    return seen


def test_the_module_graph_has_no_cycle():
    """A package's table of its own submodules (``mmlight prepare``'s datasets, imported on use) is left
    out: the submodules may import helpers from the package."""
    on_path, done = [], set()

    def visit(module):
        assert module not in on_path, f"import cycle: {' -> '.join(on_path[on_path.index(module) :] + [module])}"
        if module in done:
            return
        on_path.append(module)
        for target in sorted(imports()[module]):
            if not target.startswith(module + "."):
                visit(target)
        on_path.pop()
        done.add(module)

    for module in modules():
        visit(module)


def test_every_module_is_used_by_the_runtime():
    """The package holds what the `mmlight` command, the configs and the public packages use; code used
    only by benchmarks or build checks lives beside them."""
    config_classes = {
        resolve(name)
        for path in (REPO / "configs").rglob("*.yaml")
        for name in re.findall(r"mmlight(?:\.\w+)+", path.read_text(encoding="utf-8"))
    }
    packages = {m for m, path in modules().items() if path.name == "__init__.py"}
    assert sorted(set(modules()) - reached_from({"mmlight.cli", *packages, *config_classes} - {None})) == []
