"""tools/mutation_equivalents.toml and its loader in tools/mutation.py: every judged mutant names a function
of today's code, the loader refuses malformed entries naming them, and the score leaves the equivalent out."""

import ast
import re
from pathlib import Path

import pytest

from tools import mutation

ROOT = Path(__file__).resolve().parents[2]

# mutmut's names: module.x_function__mutmut_N, module.xǁClassǁmethod__mutmut_N
MUTMUT_NAME = re.compile(
    r"(?P<module>mmlight(?:\.\w+)+)\.x(?:_(?P<function>\w+?)|ǁ(?P<cls>\w+)ǁ(?P<method>\w+?))__mutmut_\d+"
)


def functions_of(path: Path) -> set[tuple[str | None, str]]:
    """(class or None, name) of the top-level functions and methods of a source file."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.add((None, node.name))
        elif isinstance(node, ast.ClassDef):
            found |= {(node.name, item.name) for item in node.body if isinstance(item, ast.FunctionDef)}
    return found


def test_every_judged_mutant_names_a_function_of_a_mutated_module():
    judged = mutation.verdicts()
    assert len(judged) > 400
    assert {v.kind for v in judged.values()} == {"equivalent", "left"}
    unknown = []
    for name in judged:
        match = MUTMUT_NAME.fullmatch(name)
        assert match, f"not a mutmut name: {name}"
        module = match["module"].replace(".", "/")
        path = ROOT / f"{module}.py" if (ROOT / f"{module}.py").is_file() else ROOT / module / "__init__.py"
        function = (match["cls"], match["method"]) if match["cls"] else (None, match["function"])
        if not path.is_file() or function not in functions_of(path):
            unknown.append(name)
            continue
        mutation.module_of(path.relative_to(ROOT).as_posix())  # in a set of MODULES (an error if not)
    assert unknown == [], "judged mutants of functions that no longer exist: judge them again or remove them"


def test_a_later_entry_wins_and_where_entries_name_no_mutant(tmp_path):
    path = tmp_path / "verdicts.toml"
    path.write_text(
        '[[equivalent]]\nmutants = ["m.x_f__mutmut_1", "m.x_f__mutmut_2"]\nchange = "a"\nreason = "first"\n'
        'measured = "2026-11-24"\n\n'
        '[[left]]\nmutants = ["m.x_f__mutmut_2"]\nchange = "b"\nreason = "second"\nmeasured = "2026-11-27"\n\n'
        '[[equivalent]]\nwhere = "mmlight/kernels/rowwise.py::f"\nchange = "c"\nreason = "by hand"\n'
        'measured = "2026-11-25"\n'
    )
    assert mutation.verdicts(path) == {
        "m.x_f__mutmut_1": mutation.Verdict("equivalent", "first", "2026-11-24"),
        "m.x_f__mutmut_2": mutation.Verdict("left", "second", "2026-11-27"),
    }


@pytest.mark.parametrize(
    "text, message",
    [
        ('[[equivalent]]\nmutants = ["m.x_f__mutmut_1"]\nchange = "a"\nmeasured = "d"\n', r"entry 1 .*\['reason'\]"),
        (
            '[[left]]\nchange = "a"\nreason = "r"\nmeasured = "d"\n',
            r"\[\[left\]\] entry 1 needs .* one of mutants or where",
        ),
        (
            '[[left]]\nmutants = []\nwhere = "w"\nchange = "a"\nreason = "r"\nmeasured = "d"\n',
            r"one of mutants or where",
        ),
        ("[[equivalents]]\nmutants = []\n", r"unknown tables \['equivalents'\]"),
    ],
)
def test_a_malformed_entry_is_an_error_naming_it(tmp_path, text, message):
    path = tmp_path / "verdicts.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        mutation.verdicts(path)


def test_the_score_leaves_out_the_not_checked_and_then_the_equivalent():
    counts = {"killed": 90, "timeout": 2, "survived": 6, "no tests": 2, "not checked": 5}
    # tested: 90 + 2 + 6 + 2 = 100, caught 92; without 4 equivalent: 92 / 96 = 95.83%
    assert mutation.summary(counts, equivalent=4) == (
        "caught (killed or timed out) / mutants tested: 92/100 = 92.0%; over the 96 not judged equivalent: 95.8%"
    )
