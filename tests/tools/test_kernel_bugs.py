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


def test_main_reports_each_bug_caught_or_not_restores_the_file_and_refuses_a_failing_baseline(
    tmp_path, monkeypatch, capsys
):
    """With pytest stood in for: exit status 1 (a test failed) is caught, anything else is not; the planted
    file is back as it was after each bug; a baseline that does not pass stops before any bug is planted."""
    (tmp_path / "tree" / "k").mkdir(parents=True)
    kernel = tmp_path / "tree" / "k" / "f.py"
    bugs = [
        kernel_bugs.Bug("k/f.py", "a + b", "a - b", ("t::one",), "a sign"),
        kernel_bugs.Bug("k/f.py", "return", "yield", ("t::two",), "a generator"),
        kernel_bugs.Bug("k/f.py", "b\n", "b +\n", ("t::one",), "a syntax error"),
    ]
    seen = []

    def fake_pytest(tree, tests):
        seen.append((tests, kernel.read_text()))
        # t::one sees the sign; nothing sees the generator; the syntax error stops pytest before any test
        if "b +\n" in kernel.read_text():
            return 2, "1 error"
        return (1, "t::one[x]") if "t::one" in tests and "a - b" in kernel.read_text() else (0, "passed")

    monkeypatch.setattr(kernel_bugs, "BUILD", tmp_path)
    monkeypatch.setattr(kernel_bugs, "load", lambda: bugs)
    monkeypatch.setattr(kernel_bugs, "copy_tree", lambda dest: kernel.write_text("def f(a, b):\n    return a + b\n"))
    monkeypatch.setattr(kernel_bugs, "run_tests", fake_pytest)
    assert kernel_bugs.main([]) == 1
    original = "def f(a, b):\n    return a + b\n"
    assert seen == [
        (("t::one", "t::two"), original),  # the baseline: every named test, on the unchanged file
        (("t::one",), "def f(a, b):\n    return a - b\n"),
        (("t::two",), "def f(a, b):\n    yield a + b\n"),
        (("t::one",), "def f(a, b):\n    return a + b +\n"),
    ]
    assert kernel.read_text() == original
    report = (tmp_path / "report.md").read_text().splitlines()
    assert report[2].startswith("| 1 | `k/f.py` | a sign | caught by `t::one[x]` |")
    assert report[3].startswith("| 2 | `k/f.py` | a generator | NOT CAUGHT (pytest exit status 0) |")
    assert report[4].startswith("| 3 | `k/f.py` | a syntax error | NOT CAUGHT (pytest exit status 2) |")
    assert "1 of 3 caught" in capsys.readouterr().out

    seen.clear()
    assert kernel_bugs.main(["--bug", "1"]) == 0 and [tests for tests, _ in seen] == [("t::one",), ("t::one",)]

    seen.clear()
    monkeypatch.setattr(kernel_bugs, "run_tests", lambda tree, tests: seen.append(tests) or (1, "t::one"))
    assert kernel_bugs.main([]) == 1 and seen == [("t::one", "t::two")]  # stopped after the baseline
    assert "do not pass on the unchanged tree (pytest exit status 1): t::one" in capsys.readouterr().out

    for outside in ("0", "4"):
        with pytest.raises(SystemExit):
            kernel_bugs.main(["--bug", "1", outside])
        assert f"--bug takes numbers from 1 to 3 (tools/kernel_bugs.toml's order), got [{outside}]" in (
            capsys.readouterr().err
        )
