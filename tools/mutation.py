"""Mutation testing of the task, callback, CLI, model and streaming code with mutmut, one module at a
time, each against the test files that cover it (not part of CI; see docs/testing.md).

    pip install -e '.[mutation]'
    python tools/mutation.py                    # every module below, one after the other
    python tools/mutation.py cli vit            # some of them
    python tools/mutation.py --report tasks     # summarise an earlier run without running again
    python tools/mutation.py --survivors tasks  # after adding tests: test again what survived

Each module runs in ``build/mutation/<name>/``: a pyproject.toml holding mutmut's settings for that
module (what to mutate, which tests to select from) next to links to ``mmlight/``, ``tests/`` and
``configs/``. mutmut copies them to ``mutants/`` there, records which selected test reaches which
function, and then runs only those tests against each mutant, forked from a warm process (``-x``: a
mutant is killed at its first failing test). Results persist in that folder: a second run re-tests
only what changed; ``--fresh`` starts over. The summary and every surviving mutant's diff are written
to ``build/mutation/<name>/report.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "mutation"


@dataclass(frozen=True)
class Module:
    """What to mutate and the tests that judge it.

    Args:
        mutate: glob patterns of the source files to mutate (relative to the repository root).
        tests: pytest arguments selecting the tests (files or node ids). Chosen to run in seconds:
            slow tests, Triton-interpreter tests and tests that run the code in a subprocess (which
            would import the unmutated package) are left out.
        keyword: a pytest ``-k`` expression narrowing ``tests`` further ("" = none).
    """

    mutate: tuple[str, ...]
    tests: tuple[str, ...]
    keyword: str = ""

    def existing_tests(self) -> list[str]:
        """The selected tests whose file exists (an earlier checkout may lack the newer test files)."""
        return [t for t in self.tests if (ROOT / t.split("::")[0]).exists()]


def _node_ids(path: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{path}::{name}" for name in names)


MODULES: dict[str, Module] = {
    "streaming": Module(("mmlight/data/streaming.py", "mmlight/data/skips.py"), (
        "tests/data/test_streaming.py", "tests/data/test_shard_datamodule.py", "tests/data/test_shards.py",
        "tests/data/test_skips.py")),
    # test_cli.py's fast_dev_run and subprocess tests take minutes each: only its quick ones are used.
    "cli": Module(("mmlight/cli.py", "mmlight/lightning_cli.py", "mmlight/ckpt_path.py", "mmlight/slurm.py"), (
        "tests/test_cli_units.py", *_node_ids(
            "tests/test_cli.py", "test_model_options_of_a_command_line", "test_bad_config_stops_before_work",
            "test_missing_config_file", "test_backend_is_a_config_key"))),
    # every callback's test file; test_callbacks.py's training run with the monitor is left out (the unit
    # tests of test_reweighting_monitor.py cover the same logic), and so is attention_stats' DDP subprocess.
    "callbacks": Module(("mmlight/callbacks/*",), tuple(f"tests/callbacks/test_{name}.py" for name in (
        "attention_stats", "callbacks", "checkpoint", "data_position", "data_wait", "final_metrics", "progress",
        "reweighting_monitor", "skipped_samples", "step_seed")),
        keyword="not test_monitor_logs_parameters_curves_and_final_metrics"),
    # test_language_model.py and two training runs of test_classification.py are left out: slow.
    "tasks": Module(("mmlight/tasks/*",), (
        "tests/tasks/test_metrics.py", "tests/tasks/test_optim.py", "tests/tasks/test_checkpoint.py",
        "tests/tasks/test_classification.py", "tests/tasks/test_translator.py"),
        keyword="not test_lr_scales_with_global_batch and not test_class_count_mismatch_stops_fit"),
    "vit": Module(("mmlight/models/vit.py",), ("tests/models/test_vit.py",), keyword="not triton"),
    "transformer": Module(("mmlight/models/transformer.py",), (
        "tests/models/test_transformer_reference.py", "tests/models/test_transformer.py"),
                          keyword="not triton"),
    # new code is held to the fast-test standard: the attention statistics and the robustness interventions
    "analysis": Module(("mmlight/analysis/metrics.py", "mmlight/analysis/stats.py", "mmlight/analysis/robustness.py"), (
        "tests/analysis/test_metrics.py", "tests/analysis/test_stats.py", "tests/analysis/test_robustness.py",
        "tests/analysis/test_analyze.py")),
    # new code is held to the fast-test standard: table files, sweeps and collection (the slow end-to-end sweep
    # is left out by the "not slow" marker; its fast twins are in test_collect.py and test_table.py)
    "experiments": Module(("mmlight/experiments/*",), (
        "tests/experiments/test_table.py", "tests/experiments/test_sweep.py", "tests/experiments/test_collect.py")),
}

# Arguments added to every pytest run: stop at the first failure, no slow tests, quiet, and the shim
# that keeps Lightning's save_hyperparameters working on mutmut's renamed constructors.
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-p", "tools.mutation_shim"]


def toml_value(value) -> str:
    """A TOML literal of a string, number, bool or list of those (JSON's syntax is TOML's for these)."""
    return json.dumps(value)


def write_workdir(name: str, module: Module, fresh: bool) -> Path:
    """``build/mutation/<name>/`` with mutmut's config for ``module`` and links to the sources."""
    workdir = BUILD / name
    if fresh and workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for linked in ("mmlight", "tests", "configs", "tools"):
        link = workdir / linked
        if not link.exists():
            link.symlink_to(ROOT / linked, target_is_directory=True)
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    mutmut = {
        "source_paths": ["mmlight"],
        "only_mutate": list(module.mutate),
        "also_copy": ["configs", "tools"],
        "pytest_add_cli_args": PYTEST_ARGS + (["-k", module.keyword] if module.keyword else []),
        "pytest_add_cli_args_test_selection": module.existing_tests(),
        "process_isolation": "forkserver",  # torch is not fork-safe once it has run
        # A mutant times out after (test time + timeout_constant) x timeout_multiplier seconds (wall
        # clock; twice that in CPU time). The constant absorbs waiting for a core on a loaded machine
        # (mutmut's 1 s would time out mutants whose tests merely waited); the multiplier is lower than
        # mutmut's 15, which let a mutant that loops forever hold the run for ten minutes.
        "timeout_constant": 30.0,
        "timeout_multiplier": 4.0,
        "use_git_change_detection": False,  # the links hide the repository
        "do_not_mutate_patterns": [r"^\s*log\.(debug|info|warning)\("],  # the wording of log lines
    }
    lines = ["[tool.pytest.ini_options]"] + [f"{k} = {toml_value(v)}" for k, v in pytest_options.items()
                                             if k != "testpaths"]
    lines += ["", "[tool.mutmut]"] + [f"{k} = {toml_value(v)}" for k, v in mutmut.items()]
    (workdir / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return workdir


def run(name: str, workdir: Path, max_children: int, mutants: list[str] = ()) -> int:
    """``mutmut run`` in ``workdir`` (of ``mutants`` only, if given); returns its exit code."""
    print(f"== {name}: mutmut run in {workdir.relative_to(ROOT)}", flush=True)
    return subprocess.call([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *mutants],
                           cwd=workdir)


def statuses(workdir: Path) -> dict[str, str]:
    """Mutant name -> mutmut's status (``killed``, ``survived``, ``timeout``, ``no tests``...)."""
    from mutmut.stats import status_by_exit_code

    found = {}
    for meta in sorted((workdir / "mutants").rglob("*.py.meta")):
        for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            found[key] = status_by_exit_code[code]
    return found


# Prints each named mutant's diff, separated by a NUL line; run in the module's folder (mutmut reads
# its config from the current directory).
_DIFFS = """
import sys
from mutmut.__main__ import find_mutant, get_diff_for_mutant
for name in sys.argv[1:]:
    print(get_diff_for_mutant(name, path=find_mutant(name).path))
    print("\\0")
"""


def diffs(workdir: Path, names: list[str]) -> list[str]:
    """The source diff of each mutant in ``names`` (one process for all of them)."""
    if not names:
        return []
    out = subprocess.run([sys.executable, "-c", _DIFFS, *names], cwd=workdir, capture_output=True, text=True,
                         check=True).stdout
    return out.split("\0\n")[:len(names)]


def report(name: str, workdir: Path) -> dict[str, int]:
    """Write ``report.md`` (counts, then each surviving or untested mutant's diff); return the counts."""
    found = statuses(workdir)
    counts: dict[str, int] = {}
    for status in found.values():
        counts[status] = counts.get(status, 0) + 1
    caught = counts.get("killed", 0) + counts.get("timeout", 0)
    # "no tests" counts as not caught (no selected test reaches it); "not checked" (an interrupted run) is
    # left out and reported as such.
    total = len(found) - counts.get("skipped", 0) - counts.get("not checked", 0)
    score = 100 * caught / total if total else float("nan")
    lines = [f"# mutation report: {name}", "", f"counts: {json.dumps(counts, sort_keys=True)}",
             f"caught (killed or timed out) / mutants tested: {caught}/{total} = {score:.1f}%", ""]
    uncaught = sorted(key for key, status in found.items() if status not in ("killed", "timeout", "not checked"))
    for key, diff in zip(uncaught, diffs(workdir, uncaught)):
        lines += [f"## {key}: {found[key]}", "```diff", diff.strip(), "```", ""]
    (workdir / "report.md").write_text("\n".join(lines))
    print(f"== {name}: {lines[2]}; {lines[3]} -> {(workdir / 'report.md').relative_to(ROOT)}", flush=True)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"modules to run, of {', '.join(MODULES)} (default: all)")
    parser.add_argument("--report", action="store_true", help="only summarise earlier results")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results of these modules")
    parser.add_argument("--survivors", action="store_true",
                        help="test again only the mutants an earlier run did not catch (after adding tests)")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested in parallel")
    args = parser.parse_args(argv)
    unknown = set(args.modules) - MODULES.keys()
    if unknown:
        parser.error(f"unknown module(s) {sorted(unknown)}; choose from {', '.join(MODULES)}")
    failed = 0
    for name in args.modules or list(MODULES):
        workdir = write_workdir(name, MODULES[name], args.fresh and not args.report)
        if not args.report:
            again = []
            if args.survivors:
                again = [k for k, status in statuses(workdir).items() if status in ("survived", "no tests")]
                if not again:
                    print(f"== {name}: no surviving mutants")
                # mutmut maps only tests it has not seen before to the functions they reach: a test
                # that was edited since (a new assertion reaching another function) would not be run
                # against that function's mutants. Forgetting the map makes it map every test again.
                (workdir / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
            if again or not args.survivors:
                failed |= run(name, workdir, args.max_children, again) != 0
        report(name, workdir)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
