"""tools/kernel_bugs.py: each hand-made bug of tools/kernel_bugs.toml still applies to its kernel file as
written, names tests that exist, and is planted exactly where it says."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tools import kernel_bugs, mutation

ROOT = Path(__file__).resolve().parents[2]
BUGS = kernel_bugs.load()


@pytest.mark.parametrize("bug", BUGS, ids=[f"{i + 1}" for i in range(len(BUGS))])
def test_each_bug_changes_one_place_of_a_triton_kernel_file_and_names_tests_that_exist(bug):
    assert bug.file in mutation.BY_HAND  # the files mutmut leaves out; the others have mutation sets
    source = (ROOT / bug.file).read_text()
    changed = kernel_bugs.planted(source, bug)
    assert changed != source and len(changed) == len(source) - len(bug.find) + len(bug.replace)
    ast.parse(changed)  # a bug, not a syntax error: the tests must run to catch it
    for test in bug.tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), test
        if name:
            tree = ast.parse((ROOT / path).read_text())
            assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, test


def test_planted_changes_the_occurrence_asked_for_and_refuses_an_ambiguous_or_missing_find():
    def bug(find: str, occurrence: int | None = None) -> kernel_bugs.Bug:
        return kernel_bugs.Bug("f.py", find, "Z", ("t",), "w", occurrence)

    assert kernel_bugs.planted("a b a", bug("b")) == "a Z a"
    assert kernel_bugs.planted("a b a", bug("a", 2)) == "a b Z"
    assert kernel_bugs.planted("a b a", bug("a", 1)) == "Z b a"
    with pytest.raises(ValueError, match="occurs 2 times, not once"):
        kernel_bugs.planted("a b a", bug("a"))
    with pytest.raises(ValueError, match="occurs 0 times, not once"):
        kernel_bugs.planted("a b a", bug("c"))
    with pytest.raises(ValueError, match="occurs 2 times, not 3 or more"):
        kernel_bugs.planted("a b a", bug("a", 3))
