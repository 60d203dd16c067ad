"""How the tests share code: a test module imports helpers (``tests/helpers/``, the fixtures of
``tests/conftest.py`` by name) and the ``benchmarks``/``tools`` packages, never another test module, and
reaches nothing through ``sys.path`` edits or files loaded by path."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.imports import imported_names

TESTS = Path(__file__).resolve().parent


def is_test_module(name: str) -> bool:
    """A test module or a conftest, by the last part of its dotted name."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def is_shared_module(name: str) -> bool:
    """A module that neither holds tests nor marks a package: code the tests share."""
    last = name.rsplit(".", 1)[-1]
    return not is_test_module(name) and last != "__init__"


def loads_code_by_path(source: str) -> list[str]:
    """The calls of ``source`` that put code within reach outside the import system: ``sys.path`` edits and
    ``importlib.util.spec_from_file_location``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func)
            if target.startswith("sys.path.") or target.endswith("spec_from_file_location"):
                found.append(target)
    return found


def python_files() -> dict[str, Path]:
    """Every module under ``tests/`` by dotted name."""
    root = TESTS.parent
    return {".".join(p.relative_to(root).with_suffix("").parts): p for p in sorted(TESTS.rglob("*.py"))}


def test_the_readers_see_every_form():
    source = """
import tests.models.test_vit
from tests.helpers.models import micro_vit
from .test_iwslt import write_raw
from . import conftest
import sys; sys.path.insert(0, "x")
spec = importlib.util.spec_from_file_location("m", "m.py")
"""
    names = imported_names(source, "tests.data.test_x", is_package=False)
    assert {"tests.models.test_vit", "tests.helpers.models", "tests.data.test_iwslt", "tests.data.conftest"} <= names
    assert [n for n in sorted(names) if is_test_module(n)] == [
        "tests.data.conftest",
        "tests.data.test_iwslt",
        "tests.models.test_vit",
    ]
    assert not is_test_module("tests.helpers.models") and not is_test_module("tests.helpers.image_fixtures")
    assert is_shared_module("tests.helpers.models") and not is_shared_module("tests.data.test_iwslt")
    assert is_shared_module("tests.data.image_fixtures") and not is_shared_module("tests.data.conftest")
    assert loads_code_by_path(source) == ["sys.path.insert", "importlib.util.spec_from_file_location"]


def test_no_test_module_imports_another_test_module():
    found = {}
    for name, path in python_files().items():
        imported = imported_names(path.read_text(encoding="utf-8"), name, path.name == "__init__.py")
        found[name] = sorted(n for n in imported if is_test_module(n))
    assert {name: imports for name, imports in found.items() if imports} == {}


def test_shared_code_lives_in_tests_helpers():
    """What several test modules share is in ``tests/helpers/`` (or a conftest's fixtures), where a reader
    looks for it, not beside the tests of one folder (docs/testing.md, "Layout")."""
    strays = sorted(n for n in python_files() if is_shared_module(n) and not n.startswith("tests.helpers."))
    assert strays == [], "move them to tests/helpers/ (git mv) and import them from there"


def test_no_test_reaches_code_through_sys_path_or_a_file_path():
    found = {name: loads_code_by_path(path.read_text(encoding="utf-8")) for name, path in python_files().items()}
    assert {name: calls for name, calls in found.items() if calls} == {}


def test_the_shared_scopes_name_tests_that_exist():
    """``SHARED_SCOPES`` (what runs on one xdist worker) names files and tests of the suite, so that renaming
    one cannot quietly let two workers share the SLURM cluster; the scheduler maps them to their scope."""
    from tests.helpers.xdist import SHARED_SCOPES, SharedScopes

    root = TESTS.parent
    for prefix in SHARED_SCOPES:
        path, _, name = prefix.partition("::")
        assert (root / path).is_file(), prefix
        assert not name or f"def {name}(" in (root / path).read_text(encoding="utf-8"), prefix
    scope = SharedScopes._split_scope.__get__(object.__new__(SharedScopes))
    assert scope("tests/slurm/test_slurm.py::test_ddp_job") == scope("tests/test_docs.py::test_sbatch_test_only[a]")
    assert scope("tests/test_docs.py::test_readme_python_runs") == "tests/test_docs.py"
    assert scope("tests/models/test_vit.py::TestX::test_y") == "tests/models/test_vit.py"


def test_the_long_scopes_are_handed_out_first_in_their_order():
    """``LONG_FIRST`` names scopes of the suite (files that exist, or a shared scope), and the scheduler
    hands them out before the scopes xdist put first."""
    from collections import OrderedDict

    from tests.helpers.xdist import LONG_FIRST, SHARED_SCOPES, SharedScopes

    for scope in LONG_FIRST:
        assert scope in SHARED_SCOPES.values() or (TESTS.parent / scope).is_file(), scope
    scheduler = object.__new__(SharedScopes)
    scheduler.workqueue = OrderedDict(
        (name, {}) for name in ["tests/a.py", "tests/test_resume.py", "slurm", "tests/b.py"]
    )
    handed = []
    scheduler.assigned_work, scheduler.registered_collections = {}, {}

    class Node:
        def send_runtest_some(self, indexes):
            pass

    for _ in range(4):
        node = Node()
        scheduler.registered_collections[node] = []
        scheduler._assign_work_unit(node)
        handed += list(scheduler.assigned_work[node])
    assert handed == ["slurm", "tests/test_resume.py", "tests/a.py", "tests/b.py"]
