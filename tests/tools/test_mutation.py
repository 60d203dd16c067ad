"""tools/mutation.py: every runtime module is in a mutation set, and ``--changed`` finds the functions a
diff touches (hunks read by hand from git's unified format; mutmut's naming of functions and methods)."""

import fnmatch
from pathlib import Path

import pytest

from tools import mutation

ROOT = Path(__file__).resolve().parents[2]


def test_every_runtime_module_but_the_triton_kernels_is_mutated_against_tests_that_exist():
    """A file outside every set must define no function (mutmut mutates only inside functions), or be a
    Triton kernel file of ``BY_HAND``, which a set may not mutate."""
    left_out = []
    for path in sorted(ROOT.glob("mmlight/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in mutation.BY_HAND:
            continue
        covered = any(fnmatch.fnmatch(rel, g) for module in mutation.MODULES.values() for g in module.mutate)
        if not covered and mutation.mutmut_names(path.read_text(), set(range(1, 10**6))):
            left_out.append(rel)
    assert left_out == []
    for name, module in mutation.MODULES.items():
        assert module.existing_tests() == list(module.tests), name  # no test file named wrongly
        assert not [f for f in mutation.BY_HAND if any(fnmatch.fnmatch(f, g) for g in module.mutate)], name
    assert all((ROOT / path).is_file() for path in mutation.BY_HAND)


def test_every_test_file_of_a_mutated_module_is_in_its_set():
    """``tests/<folder>/test_<module>.py`` judges ``mmlight/<folder>/<module>.py``: a new one (a new
    reweighting function's, say) runs in the set that mutates that module, or is left out with a reason."""
    missing = []
    for test in sorted(ROOT.glob("tests/**/test_*.py")):
        rel = test.relative_to(ROOT).as_posix()
        module = (Path("mmlight") / test.relative_to(ROOT / "tests").parent / test.name[len("test_") :]).as_posix()
        sets = [m for m in mutation.MODULES.values() if any(fnmatch.fnmatch(module, g) for g in m.mutate)]
        listed = any(t.split("::")[0] == rel for m in sets for t in m.tests)
        if sets and (ROOT / module).is_file() and not listed and rel not in mutation.LEFT_OUT:
            missing.append(rel)
    assert missing == [], "add them to their module's set in tools/mutation.py, or to LEFT_OUT with the reason"
    assert all((ROOT / path).is_file() for path in mutation.LEFT_OUT)


DIFF = """\
diff --git a/mmlight/a.py b/mmlight/a.py
index 1111111..2222222 100644
--- a/mmlight/a.py
+++ b/mmlight/a.py
@@ -3 +3 @@ def f():
-    return 1
+    return 2
@@ -10,2 +10,3 @@ class C:
-        x = 1
-        y = 2
+        x = 3
+        y = 4
+        z = 5
@@ -20,3 +21,0 @@ def g():
-    a
-    b
-    c
diff --git a/mmlight/gone.py b/mmlight/gone.py
deleted file mode 100644
--- a/mmlight/gone.py
+++ /dev/null
@@ -1,2 +0,0 @@
-def h():
-    pass
diff --git a/mmlight/new.py b/mmlight/new.py
new file mode 100644
--- /dev/null
+++ b/mmlight/new.py
@@ -0,0 +1,2 @@
+def k():
+    pass
"""


def test_changed_lines_reads_each_hunk_of_a_zero_context_diff():
    """One line; three lines; a pure deletion (both lines around the cut); a deleted file (nothing);
    a new file (its lines)."""
    assert mutation.changed_lines(DIFF) == {"mmlight/a.py": {3, 10, 11, 12, 21, 22}, "mmlight/new.py": {1, 2}}


SOURCE = """\
import functools

LIMIT = 3  # line 3


def plain():  # line 6
    return 1


@functools.cache  # line 10
def decorated():
    def inner():  # line 12
        return 2
    return inner()


class Box:  # line 17
    size = 4

    def __init__(self):  # line 20
        self.size = 5

    @property  # line 23
    def area(self):
        return self.size ** 2
"""


@pytest.mark.parametrize(
    "lines, names",
    [
        ({3}, []),  # module level: nothing for mutmut
        ({6}, ["x_plain"]),
        ({10}, ["x_decorated"]),  # the decorator line belongs to its function
        ({13}, ["x_decorated"]),  # a nested function counts as the enclosing one
        ({18}, []),  # a class attribute
        ({21}, ["x\u01c1Box\u01c1__init__"]),  # mutmut's name of a method
        ({23, 7}, ["x_plain", "x\u01c1Box\u01c1area"]),
        ({8, 9, 16, 19, 22}, []),  # blank lines between definitions
    ],
)
def test_mutmut_names_of_the_functions_that_hold_the_lines(lines, names):
    assert mutation.mutmut_names(SOURCE, lines) == names


def test_a_changed_file_in_no_module_is_named():
    with pytest.raises(SystemExit, match="mmlight/elsewhere.py is in no module"):
        mutation.module_of("mmlight/elsewhere.py")
    assert mutation.module_of("mmlight/data/shards.py") == "shards"
    assert mutation.module_of("mmlight/data/prepare/iwslt.py") == "prepare"


def test_only_turns_a_sets_files_into_mutmut_name_patterns():
    assert mutation.file_patterns([], ["tasks"]) == []
    assert mutation.file_patterns(["mmlight/tasks/protocol.py", "mmlight/tasks/inference.py"], ["tasks"]) == [
        "mmlight.tasks.protocol.*",
        "mmlight.tasks.inference.*",
    ]
    # the pattern matches mutmut's names of that file's mutants and no other file's
    pattern = mutation.file_patterns(["mmlight/data/shards.py"], ["shards"])[0]
    assert fnmatch.fnmatch("mmlight.data.shards.x_read_info__mutmut_3", pattern)
    assert not fnmatch.fnmatch("mmlight.data.shard_writer.x_write__mutmut_3", pattern)


def test_only_refuses_a_file_outside_the_set_or_several_sets():
    with pytest.raises(SystemExit, match=r"--only mmlight/cli.py: not a source of the set 'tasks'"):
        mutation.file_patterns(["mmlight/cli.py"], ["tasks"])
    with pytest.raises(SystemExit, match="name exactly one set"):
        mutation.file_patterns(["mmlight/tasks/protocol.py"], ["tasks", "vit"])
    with pytest.raises(SystemExit, match="name exactly one set"):
        mutation.file_patterns(["mmlight/tasks/protocol.py"], [])


def test_uncaught_names_the_survivors_of_the_changed_functions_not_judged_equivalent():
    """What ``--changed`` prints as ``SURVIVED``: survivors and untested mutants of the patterns, with the reason
    of a ``left`` verdict; killed, timed-out, unchecked, equivalent or other functions' mutants are not."""
    from types import SimpleNamespace

    found = {
        "m.x_f__mutmut_1": "survived",
        "m.x_f__mutmut_2": "killed",
        "m.x_f__mutmut_3": "no tests",
        "m.x_f__mutmut_4": "survived",
        "m.x_f__mutmut_5": "survived",
        "m.x_f__mutmut_6": "timeout",
        "m.x_f__mutmut_7": "not checked",
        "m.x_g__mutmut_1": "survived",
    }
    judged = {
        "m.x_f__mutmut_4": SimpleNamespace(kind="equivalent", reason="same value"),
        "m.x_f__mutmut_5": SimpleNamespace(kind="left", reason="needs a GPU"),
    }
    assert mutation.uncaught(found, ["m.x_f__mutmut_*"], judged) == [
        ("m.x_f__mutmut_1", ""),
        ("m.x_f__mutmut_3", ""),
        ("m.x_f__mutmut_5", "needs a GPU"),
    ]


def test_the_pre_commit_hook_runs_the_changed_functions_only():
    hook = ROOT / "tools" / "hooks" / "pre-commit"
    assert hook.stat().st_mode & 0o111  # executable, as git requires
    assert hook.read_text().rstrip().endswith("tools/mutation.py --changed HEAD")


def test_changed_keeps_to_the_named_sets(monkeypatch):
    """``doctor cli --changed BASE`` runs those sets' changed functions only; with no set named, every set's."""
    ran = []
    monkeypatch.setattr(
        mutation, "changed_mutants", lambda base: {"doctor": ["d.x_f__mutmut_*"], "cli": ["c.*"], "vit": ["v.*"]}
    )
    monkeypatch.setattr(mutation, "write_workdir", lambda name, module, fresh: Path("/nonexistent") / name)
    monkeypatch.setattr(mutation, "run", lambda name, workdir, children, only: ran.append((name, only)) or 0)
    monkeypatch.setattr(mutation, "report", lambda *args, **kwargs: None)
    monkeypatch.setattr(mutation, "statuses", lambda workdir: {})
    assert mutation.main(["doctor", "vit", "--changed", "BASE"]) == 0
    assert ran == [("doctor", ["d.x_f__mutmut_*"]), ("vit", ["v.*"])]
    ran.clear()
    assert mutation.main(["--changed", "BASE"]) == 0
    assert [name for name, _ in ran] == ["doctor", "cli", "vit"]
