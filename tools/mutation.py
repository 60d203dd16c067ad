"""Mutation testing of the runtime package with mutmut, one module at a time, each against the test
files that cover it (not part of CI; see docs/testing.md). Every module under ``mmlight/`` is in
:data:`MODULES` except the Triton kernel files (:data:`BY_HAND`), whose interpreter tests are too slow
to mutate (their bugs are made by hand, docs/testing.md).

    pip install -e '.[mutation]'
    python tools/mutation.py                    # every module below, one after the other
    python tools/mutation.py cli vit            # some of them
    python tools/mutation.py --report tasks     # summarise an earlier run without running again
    python tools/mutation.py --survivors tasks  # after adding tests: test again what survived
    python tools/mutation.py --changed          # only the functions this branch changed (vs main)
    python tools/mutation.py --changed HEAD     # only the functions changed and not yet committed
    python tools/mutation.py doctor cli --changed 7590573  # changed since a commit, in these sets only
    python tools/mutation.py tasks --only mmlight/tasks/protocol.py  # some of a set's files

Each module runs in ``build/mutation/<name>/``: a pyproject.toml holding mutmut's settings for that
module (what to mutate, which tests to select from) next to links to ``mmlight/``, ``tests/``
and :data:`COPIED`. mutmut copies them to ``mutants/`` there, records
which selected test reaches which function, and then runs only those tests against each mutant, forked from a
warm process (``-x``: a mutant is killed at its first failing test). Results persist in that folder: a second
run re-tests only what changed; ``--fresh`` starts over. The summary and every surviving mutant's diff are written
to ``build/mutation/<name>/report.md``; a survivor already judged in ``tools/mutation_equivalents.toml``
(equivalent, or left with a reason) is marked with that verdict, and the score leaves the equivalent out.

``--changed [BASE]`` reads ``git diff BASE`` (default: the merge base with ``main``; the working tree,
uncommitted changes included), finds the top-level functions and methods whose lines it touches, and
runs mutmut on their mutants only, in the module of :data:`MODULES` that holds each file; the report
(``report-changed.md``) lists those mutants alone, each survivor not judged equivalent is printed as
``SURVIVED <name>``, and the exit status is 1 if one of them is not judged at all. A changed file that no
module covers is an error. ``tools/hooks/pre-commit`` runs ``--changed HEAD`` before each commit.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "mutation"
VERDICTS = Path(__file__).resolve().parent / "mutation_equivalents.toml"


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


#: test files that mirror a mutated module (``tests/<folder>/test_<module>.py``) yet no set runs, and why;
#: any other such file must be in the set that mutates its module (tests/tools/test_mutation.py)
LEFT_OUT: dict[str, str] = {
    "tests/tasks/test_language_model.py": "slow: its fixture prepares WikiText shards and its tests train",
}


#: the Triton kernel files: no set mutates them (their host code runs the kernels, whose tests run under
#: Triton's interpreter, too slow to run once per mutant); their bugs are made by hand (docs/testing.md)
BY_HAND = (
    "mmlight/kernels/attention.py",
    "mmlight/kernels/cross_entropy.py",
    "mmlight/kernels/rowwise.py",
    "mmlight/kernels/sigma.py",
)

MODULES: dict[str, Module] = {
    "streaming": Module(
        ("mmlight/data/streaming.py", "mmlight/data/skips.py"),
        (
            "tests/data/test_streaming.py",
            "tests/data/test_shard_datamodule.py",
            "tests/data/test_shards.py",
            "tests/data/test_skips.py",
            "tests/data/test_malformed_shards.py",  # the training index of broken shards
        ),
    ),
    # test_cli.py's fast_dev_run and subprocess tests take minutes each: only its quick ones are used.
    "cli": Module(
        (
            "mmlight/cli.py",
            "mmlight/lightning_cli.py",
            "mmlight/ckpt_path.py",
            "mmlight/slurm.py",
            "mmlight/safe_load.py",
            "mmlight/data/__init__.py",  # the data package's names on first use (tested beside the commands)
        ),
        (
            "tests/test_cli_units.py",
            "tests/test_safe_load.py",
            *_node_ids(
                "tests/test_cli.py",
                "test_model_options_of_a_command_line",
                "test_bad_config_stops_before_work",
                "test_missing_config_file",
                "test_backend_is_a_config_key",
            ),
        ),
        # reads mmlight/'s source for torch.load calls, which mutmut's copies of every function repeat; imports
        # the package in a new interpreter
        "not (test_the_package_unpickles_only_through_the_safe_loaders or test_prepare_starts_without_lightning)",
    ),
    # every callback's test file; test_callbacks.py's training run with the monitor is left out (the unit
    # tests of test_reweighting_monitor.py cover the same logic), and so is attention_stats' DDP subprocess.
    "callbacks": Module(
        ("mmlight/callbacks/*",),
        tuple(
            f"tests/callbacks/test_{name}.py"
            for name in (
                "attention_stats",
                "callbacks",
                "checkpoint",
                "data_position",
                "data_wait",
                "final_metrics",
                "progress",
                "requeue",
                "reweighting_monitor",
                "skipped_samples",
                "step_seed",
                "throughput",
            )
        ),
        keyword="not test_monitor_logs_parameters_curves_and_final_metrics",
    ),
    # two training runs of test_classification.py are left out: slow (test_language_model.py: LEFT_OUT).
    "tasks": Module(
        ("mmlight/tasks/*",),
        (
            "tests/tasks/test_metrics.py",
            "tests/tasks/test_optim.py",
            "tests/tasks/test_checkpoint.py",
            "tests/tasks/test_classification.py",
            "tests/tasks/test_translator.py",
            "tests/tasks/test_finetune_optim.py",
            "tests/tasks/test_inference.py",
            "tests/tasks/test_protocol.py",
            "tests/tasks/test_compile_option.py",
            # CarriesData.load_from_checkpoint: Lightning's arguments passed on, the file read as data
            *_node_ids(
                "tests/test_safe_load.py",
                "test_load_from_checkpoint_refuses_a_code_running_checkpoint",
                "test_load_from_checkpoint_passes_lightnings_arguments_on_and_reads_as_data_whatever_the_environment_says",
            ),
            # LanguageModel.generate: the fast tests of a file left out as a whole (LEFT_OUT)
            *_node_ids(
                "tests/tasks/test_language_model.py",
                "test_greedy_generation_through_the_cache_is_the_full_forward_argmax",
                "test_generate_decodes_from_the_checkpoint_without_the_data",
                "test_bad_generate_arguments_are_named",
                "test_next_token_samples_from_the_tempered_top_k_distribution",
                "test_generation_stops_before_the_end_of_sequence_token",
            ),
            # the analysis protocol's methods (teacher_forced, query_keep, example_inputs, metric_evaluation)
            # are exercised by what analysis does with them
            "tests/analysis/test_stats.py",
            "tests/analysis/test_robustness.py",
            "tests/analysis/test_figures.py",
        ),
        keyword="not test_lr_scales_with_global_batch and not test_class_count_mismatch_stops_fit",
    ),
    "vit": Module(
        ("mmlight/models/vit.py", "mmlight/models/pretrained.py"),
        (
            "tests/models/test_vit.py",
            "tests/models/test_pretrained.py",
            "tests/models/test_gated_attention.py",
            # read_pretrained's refusal of a code-running .pth (the other safe-loading tests are the cli set's)
            *_node_ids(
                "tests/test_safe_load.py", "test_a_code_running_pth_is_refused_by_timm_s_reader_naming_the_file"
            ),
        ),
        keyword="not triton",
    ),
    "transformer": Module(
        ("mmlight/models/transformer.py",),
        (
            "tests/models/test_transformer_reference.py",
            "tests/models/test_transformer.py",
            "tests/models/test_gated_attention.py",
            # the Llama-style options (RMSNorm, SwiGLU, rotary, grouped-query attention, no biases), checked
            # against transformers' Llama by the export's tests and against pinned forwards
            "tests/models/test_transformer_options.py",
            "tests/models/test_pinned_forwards.py",
            "tests/export/test_hf.py",
        ),
        keyword="not triton",
    ),
    # new code is held to the fast-test standard: the attention statistics and the robustness interventions
    "analysis": Module(
        (
            "mmlight/analysis/stats.py",
            "mmlight/analysis/robustness.py",
            "mmlight/analysis/kv_eviction.py",
            "mmlight/analysis/key_norms.py",
            "mmlight/analysis/extrapolation.py",
            "mmlight/analysis/massive.py",
        ),
        (
            "tests/analysis/test_metrics.py",
            "tests/analysis/test_stats.py",
            "tests/analysis/test_robustness.py",
            "tests/analysis/test_analyze.py",
            "tests/analysis/test_gate_and_sink_stats.py",
            "tests/analysis/test_kv_eviction.py",
            "tests/analysis/test_kv_eviction_kvpress.py",
            "tests/analysis/test_key_norms.py",
            "tests/analysis/test_extrapolation.py",
            "tests/analysis/test_massive.py",
        ),
    ),
    # new code is held to the fast-test standard: table files, sweeps and collection (the slow end-to-end sweep
    # is left out by the "not slow" marker; its fast twins are in test_collect.py and test_table.py)
    "experiments": Module(
        ("mmlight/experiments/*", "mmlight/commands/sweep.py", "mmlight/commands/collect.py"),
        ("tests/experiments/test_table.py", "tests/experiments/test_sweep.py", "tests/experiments/test_collect.py"),
    ),
    # the rest of the runtime package (all but the Triton kernel files, BY_HAND). Interpreter tests are left out by
    # "not triton" where a file mixes them with eager ones.
    "shards": Module(
        ("mmlight/data/shards.py", "mmlight/data/shard_writer.py"),
        (
            "tests/data/test_shards.py",
            "tests/data/test_shard_writer.py",
            "tests/data/test_malformed_shards.py",
            "tests/data/test_imagenet.py",
            "tests/data/test_digits.py",
            "tests/data/test_vocab.py",  # write_info/read_info and version-1 sets
            *_node_ids("tests/data/test_streaming.py", "test_tar_index_matches_tarfile_and_npy_header_matches_numpy"),
        ),
    ),
    # test_streaming.py's image streams are ImageStream's tests (the rest of that file is the streaming set's)
    "image_data": Module(
        (
            "mmlight/data/image_decode.py",
            "mmlight/data/images.py",
            "mmlight/data/on_device.py",
            "mmlight/data/digits.py",
        ),
        (
            "tests/data/test_image_decode.py",
            "tests/data/test_images.py",
            "tests/data/test_on_device.py",
            "tests/data/test_imagenet.py",
            "tests/data/test_digits.py",
            "tests/data/test_shard_datamodule.py",
            "tests/data/test_malformed_shards.py",
            *_node_ids(
                "tests/data/test_streaming.py",
                "test_same_seed_same_batches_other_seed_other_order[images]",
                "test_resume_from_state_continues_with_the_next_batch[images]",
                "test_ranks_get_different_streams",
                "test_resuming_skips_without_decoding",
                "test_corrupt_image_keeps_the_batch_size_and_is_counted",
            ),
        ),
    ),
    "text_data": Module(
        ("mmlight/data/text.py", "mmlight/data/vocab.py", "mmlight/data/recall.py"),
        (
            "tests/data/test_wikitext.py",
            "tests/data/test_recall.py",
            "tests/data/test_vocab.py",
            "tests/data/test_shard_datamodule.py",
            "tests/data/test_text.py",  # prepared text streamed by text.py's DataModule
        ),
    ),
    "translation_data": Module(
        (
            "mmlight/data/translation.py",
            "mmlight/data/translation_shards.py",
            "mmlight/data/tokenizers.py",
            "mmlight/data/toy_translation.py",
        ),
        (
            "tests/data/test_iwslt.py",
            "tests/data/test_translation.py",
            "tests/data/test_tokenizers.py",
            "tests/data/test_toy_translation.py",
        ),
    ),
    # test_tokenizers.py also reaches iwslt.py (its tokenising step and its cache's tokeniser key)
    "prepare": Module(
        ("mmlight/data/prepare/*", "mmlight/commands/prepare.py"),
        (
            "tests/data/test_imagenet.py",
            "tests/data/test_iwslt.py",
            "tests/data/test_tokenizers.py",
            "tests/data/test_wikitext.py",
            "tests/data/test_digits.py",
            "tests/data/test_imagefolder.py",
            "tests/data/test_cifar.py",
            "tests/data/test_flowers102.py",
            "tests/data/test_food101.py",
            "tests/data/test_text.py",
            "tests/data/test_python_docs.py",
        ),
    ),
    "reweighting": Module(
        ("mmlight/reweighting/*",),
        (
            "tests/reweighting/test_functions.py",
            "tests/reweighting/test_multimax.py",
            "tests/reweighting/test_metrics.py",
            "tests/analysis/test_metrics.py",  # the masked statistics of reweighting/metrics.py
            "tests/analysis/test_stats.py",
            "tests/reweighting/test_fallback.py",
            "tests/reweighting/test_base.py",
            "tests/reweighting/test_spec.py",
            "tests/reweighting/test_entmax_ops.py",
            *(
                f"tests/reweighting/test_{name}.py"
                for name in ("softmax1", "sink", "softpick", "sigmoid", "ssmax", "alpha_entmax", "stickbreaking")
            ),
        ),
        keyword="not triton",
    ),
    # the functions whose paths attention() takes (scaled queries, causal-only, the fused branch with a stand-in
    # kernel) and the protocol's network_of; the interpreter tests are left out by name
    "attention": Module(
        ("mmlight/nn/*",),
        (
            "tests/nn/test_attention.py",
            "tests/nn/test_observation.py",
            "tests/nn/test_sites.py",
            "tests/nn/test_gate.py",
            "tests/nn/test_rope.py",
            # attention_observed decides whether a compiled task's call runs eagerly
            *_node_ids(
                "tests/tasks/test_compile_option.py",
                "test_a_compiled_network_runs_eagerly_while_its_attention_is_recorded",
            ),
            "tests/reweighting/test_ssmax.py",
            "tests/reweighting/test_stickbreaking.py",
            "tests/reweighting/test_fallback.py",
            "tests/tasks/test_protocol.py",
        ),
        keyword="not triton and not test_fused_path_is_taken_outside_the_context_only",
    ),
    "beam_search": Module(("mmlight/models/beam_search.py",), ("tests/models/test_beam_search.py",)),
    # analyze.py's end-to-end tests are slow (left out by "not slow"): its fast tests are the errors before work
    "analysis_rest": Module(
        ("mmlight/commands/analyze.py", "mmlight/analysis/figures.py", "mmlight/analysis/batches.py"),
        (
            "tests/analysis/test_analyze_outputs.py",
            "tests/analysis/test_analyze.py",
            "tests/analysis/test_figures.py",
            "tests/analysis/test_stats.py",
            "tests/analysis/test_gate_and_sink_stats.py",
            # the options' table in docs/analysis.md, rendered from OPTIONS and checked against the parser
            *_node_ids(
                "tests/tools/test_render_docs.py",
                "test_the_analyze_options_are_what_its_help_lists_with_the_defaults_it_parses_to",
                "test_each_rendered_block_is_what_the_code_renders[analysis.md:analyze-options]",
            ),
        ),
    ),
    # the export to transformers: its tests build a transformers model beside each mmlight one
    "export": Module(
        ("mmlight/export/*", "mmlight/commands/export.py"),
        ("tests/export/test_hf.py",),
    ),
    # the kernels' Python-only modules: the package's lazy imports, the measured tile table and the
    # interpreter switch (the Triton kernel files, BY_HAND, are not mutated)
    "kernels": Module(
        ("mmlight/kernels/__init__.py", "mmlight/kernels/tiles.py", "mmlight/kernels/runtime.py"),
        ("tests/kernels/test_tiles.py", "tests/kernels/test_runtime.py"),
    ),
    # the two tests that run the real kernels under Triton's interpreter are left out; the others cover the CPU
    # and GPU branches with stand-ins
    "doctor": Module(
        ("mmlight/commands/doctor.py",),
        ("tests/test_doctor.py",),
        keyword="not test_cpu_report_checks_every_kernel and not test_a_wrong_kernel_fails_the_check",
    ),
}

# Arguments added to every pytest run: stop at the first failure, no slow tests, quiet, and the shim
# that keeps Lightning's save_hyperparameters working on mutmut's renamed constructors.
# -n 0: mutmut runs the tests in its own process (the suite's addopts would start xdist workers)
PYTEST_ARGS = ["-x", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not slow", "-p", "tools.mutation_shim"]


@dataclass(frozen=True)
class Verdict:
    """A judged survivor.

    Args:
        kind: ``equivalent`` (no input tells it from the code) or ``left`` (not equivalent; no test in
            its set can show the difference).
        reason: why.
        measured: the date of the run whose numbering names the mutant.
    """

    kind: str
    reason: str
    measured: str


def verdicts(path: Path = VERDICTS) -> dict[str, Verdict]:
    """mutmut name -> :class:`Verdict`, from ``path``'s ``[[equivalent]]`` and ``[[left]]`` entries (a later
    entry on the same mutant wins). Entries with ``where`` instead of ``mutants`` (bugs made by hand, code
    changed since) name no mutmut mutant and are only checked. A malformed entry is an error naming it."""
    data = tomllib.loads(path.read_text())
    unknown = set(data) - {"equivalent", "left"}
    if unknown:
        raise ValueError(f"{path}: unknown tables {sorted(unknown)}; expected [[equivalent]] and [[left]]")
    found: dict[str, Verdict] = {}
    for kind in ("equivalent", "left"):
        for number, entry in enumerate(data.get(kind, []), start=1):
            missing = {"change", "reason", "measured"} - entry.keys()
            if missing or ("mutants" in entry) == ("where" in entry):
                raise ValueError(
                    f"{path}: [[{kind}]] entry {number} needs change, reason, measured and one of mutants or where"
                    f" (missing {sorted(missing)}; has {sorted(entry)})"
                )
            for name in entry.get("mutants", []):
                found[name] = Verdict(kind, entry["reason"], entry["measured"])
    return found


def summary(counts: dict[str, int], equivalent: int) -> str:
    """The score line: caught (killed or timed out) over the mutants tested, and over those not judged
    equivalent. ``counts``: status -> mutants; ``equivalent``: how many of the uncaught are judged so."""
    caught = counts.get("killed", 0) + counts.get("timeout", 0)
    # "no tests" counts as not caught (no selected test reaches it); "not checked" (an interrupted run) is
    # left out and reported as such.
    total = sum(counts.values()) - counts.get("skipped", 0) - counts.get("not checked", 0)
    score = 100 * caught / total if total else float("nan")
    rest = total - equivalent
    over = 100 * caught / rest if rest else float("nan")
    return (
        f"caught (killed or timed out) / mutants tested: {caught}/{total} = {score:.1f}%; "
        f"over the {rest} not judged equivalent: {over:.1f}%"
    )


def toml_value(value) -> str:
    """A TOML literal of a string, number, bool or list of those (JSON's syntax is TOML's for these)."""
    return json.dumps(value)


#: What the mutated package's tests read besides ``mmlight/`` and ``tests/``, copied beside them: docs for the
#: tests that run a documented command; the documents, and benchmarks/ for the targets, for tools/render_docs.py.
COPIED = ("configs", "tools", "docs", "benchmarks", "README.md", "BENCHMARKS.md")


def write_workdir(name: str, module: Module, fresh: bool) -> Path:
    """``build/mutation/<name>/`` with mutmut's config for ``module`` and links to the sources."""
    workdir = BUILD / name
    if fresh and workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for linked in ("mmlight", "tests", *COPIED):
        link = workdir / linked
        if not link.exists():
            link.symlink_to(ROOT / linked, target_is_directory=(ROOT / linked).is_dir())
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    mutmut = {
        "source_paths": ["mmlight"],
        "only_mutate": list(module.mutate),
        "also_copy": list(COPIED),
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
    lines = ["[tool.pytest.ini_options]"] + [
        f"{k} = {toml_value(v)}" for k, v in pytest_options.items() if k != "testpaths"
    ]
    lines += ["", "[tool.mutmut]"] + [f"{k} = {toml_value(v)}" for k, v in mutmut.items()]
    (workdir / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return workdir


def run(name: str, workdir: Path, max_children: int, mutants: list[str] = ()) -> int:
    """``mutmut run`` in ``workdir`` (of ``mutants`` only, if given); returns its exit code."""
    print(f"== {name}: mutmut run in {workdir.relative_to(ROOT)}", flush=True)
    return subprocess.call(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *mutants], cwd=workdir
    )


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
    out = subprocess.run(
        [sys.executable, "-c", _DIFFS, *names], cwd=workdir, capture_output=True, text=True, check=True
    ).stdout
    return out.split("\0\n")[: len(names)]


def report(name: str, workdir: Path, only: list[str] = (), file: str = "report.md") -> dict[str, int]:
    """Write ``file`` (counts, then each surviving or untested mutant's diff) for the mutants matching the
    patterns ``only`` (all if empty); return the counts."""
    found = {
        key: status
        for key, status in statuses(workdir).items()
        if not only or any(fnmatch.fnmatch(key, pattern) for pattern in only)
    }
    counts: dict[str, int] = {}
    for status in found.values():
        counts[status] = counts.get(status, 0) + 1
    uncaught = sorted(key for key, status in found.items() if status not in ("killed", "timeout", "not checked"))
    judged = verdicts()
    equivalent = sum(key in judged and judged[key].kind == "equivalent" for key in uncaught)
    lines = [
        f"# mutation report: {name}",
        "",
        f"counts: {json.dumps(counts, sort_keys=True)}",
        summary(counts, equivalent),
        "",
    ]
    for key, diff in zip(uncaught, diffs(workdir, uncaught)):
        verdict = judged.get(key)
        known = f" (judged {verdict.kind} on {verdict.measured}: {verdict.reason})" if verdict else ""
        lines += [f"## {key}: {found[key]}{known}", "```diff", diff.strip(), "```", ""]
    (workdir / file).write_text("\n".join(lines))
    print(f"== {name}: {lines[2]}; {lines[3]} -> {(workdir / file).relative_to(ROOT)}", flush=True)
    return counts


_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", re.MULTILINE)


def changed_lines(diff: str) -> dict[str, set[int]]:
    """``{path: new-side line numbers}`` that a ``git diff -U0`` touches. A pure deletion marks the
    lines on both sides of the cut, so that the function it was cut from counts as changed."""
    lines: dict[str, set[int]] = {}
    for part in re.split(r"^diff --git ", diff, flags=re.MULTILINE)[1:]:
        target = re.search(r"^\+\+\+ (?:b/)?(.+)$", part, re.MULTILINE)
        if target is None or target.group(1) == "/dev/null":  # a deleted file: nothing left to mutate
            continue
        touched = lines.setdefault(target.group(1), set())
        for start, count in _HUNK.findall(part):
            start, count = int(start), 1 if count == "" else int(count)
            touched.update(range(start, start + count) if count else (start, start + 1))
    return lines


def mutmut_names(source: str, lines: set[int]) -> list[str]:
    """mutmut's names (``x_f``, ``xǁClassǁmethod``) of the top-level functions and methods of ``source``
    that hold one of ``lines`` (decorators included); a nested function counts as its enclosing one."""

    def span(node) -> range:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        return range(first, node.end_lineno + 1)

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, functions) and lines & set(span(node)):
            found.append(f"x_{node.name}")
        elif isinstance(node, ast.ClassDef):
            found += [
                f"x\u01c1{node.name}\u01c1{item.name}"
                for item in node.body
                if isinstance(item, functions) and lines & set(span(item))
            ]
    return found


def module_of(path: str) -> str:
    """The name in :data:`MODULES` whose sources hold ``path`` (an error naming the path if none does)."""
    for name, module in MODULES.items():
        if any(fnmatch.fnmatch(path, pattern) for pattern in module.mutate):
            return name
    raise SystemExit(f"{path} is in no module of tools/mutation.py's MODULES: add it there, with its tests")


def changed_mutants(base: str) -> dict[str, list[str]]:
    """``{module name: mutmut name patterns}`` of the functions that ``git diff base`` changes under mmlight/
    (the Triton kernel files, :data:`BY_HAND`, excluded: see docs/testing.md for their hand-made bugs)."""
    diff = subprocess.run(
        ["git", "diff", "-U0", "--no-color", base, "--", "mmlight"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    patterns: dict[str, list[str]] = {}
    for path, lines in sorted(changed_lines(diff).items()):
        if not path.endswith(".py") or path in BY_HAND:
            continue
        dotted = path[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        names = mutmut_names((ROOT / path).read_text(), lines)
        if names:
            patterns.setdefault(module_of(path), []).extend(f"{dotted}.{n}__mutmut_*" for n in names)
    return patterns


def merge_base(branch: str = "main") -> str:
    return subprocess.run(
        ["git", "merge-base", "HEAD", branch], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"modules to run, of {', '.join(MODULES)} (default: all)")
    parser.add_argument("--report", action="store_true", help="only summarise earlier results")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results of these modules")
    parser.add_argument(
        "--survivors",
        action="store_true",
        help="test again only the mutants an earlier run did not catch (after adding tests)",
    )
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested in parallel")
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="FILE",
        help="mutate only these source files of the named set (a set's new files, measured without the rest)",
    )
    parser.add_argument(
        "--changed",
        nargs="?",
        const="",
        metavar="BASE",
        help="mutate only the functions changed since BASE (default: the merge base with main)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.modules) - MODULES.keys()
    if unknown:
        parser.error(f"unknown module(s) {sorted(unknown)}; choose from {', '.join(MODULES)}")
    if args.changed is not None:
        return run_changed(args.changed or merge_base(), args.max_children, args.modules)
    only = file_patterns(args.only, args.modules)
    failed = 0
    for name in args.modules or list(MODULES):
        workdir = write_workdir(name, MODULES[name], args.fresh and not args.report)
        if not args.report:
            again = []
            if args.survivors:
                again = [
                    k
                    for k, status in statuses(workdir).items()
                    if status in ("survived", "no tests") and (not only or any(fnmatch.fnmatch(k, p) for p in only))
                ]
                if not again:
                    print(f"== {name}: no surviving mutants")
                # mutmut maps only tests it has not seen before to the functions they reach: a test
                # that was edited since (a new assertion reaching another function) would not be run
                # against that function's mutants. Forgetting the map makes it map every test again.
                (workdir / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
            if again or not args.survivors:
                failed |= run(name, workdir, args.max_children, again or only) != 0
        report(name, workdir, only, file="report-only.md" if only else "report.md")
    return int(failed)


def file_patterns(paths: list[str], modules: list[str]) -> list[str]:
    """``--only``: mutmut name patterns (``mmlight.tasks.protocol.*``) of ``paths``, each checked to be a
    source of the one set named (an error before any work otherwise)."""
    if not paths:
        return []
    if len(modules) != 1:
        raise SystemExit("--only takes the files of one set: name exactly one set before it")
    patterns = []
    for path in paths:
        if not any(fnmatch.fnmatch(path, pattern) for pattern in MODULES[modules[0]].mutate):
            raise SystemExit(f"--only {path}: not a source of the set {modules[0]!r} ({MODULES[modules[0]].mutate})")
        patterns.append(path.removesuffix(".py").replace("/", ".").removesuffix(".__init__") + ".*")
    return patterns


def run_changed(base: str, max_children: int, sets: list[str] | None = None) -> int:
    """``--changed``: each module's changed functions (of the modules ``sets`` only, where given), their
    mutants only, and a report of those."""
    patterns = {name: only for name, only in changed_mutants(base).items() if not sets or name in sets}
    if not patterns:
        print(f"== no function under mmlight/ changed since {base} (the Triton kernel files aside)")
    failed = 0
    for name, only in patterns.items():
        functions = [pattern.split(".")[-1].removesuffix("__mutmut_*") for pattern in only]
        print(f"== {name}: {len(only)} changed function(s): {', '.join(functions)}")
        workdir = write_workdir(name, MODULES[name], fresh=False)
        # forget the test map (as --survivors does): tests edited with the change must be mapped again
        (workdir / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
        failed |= run(name, workdir, max_children, only) != 0
        report(name, workdir, only, file="report-changed.md")
        for key, judged in uncaught(statuses(workdir), only, verdicts()):
            print(f"SURVIVED {key}" + (f" (judged left: {judged})" if judged else ""), flush=True)
            failed |= not judged
    return int(failed)


def uncaught(found: dict[str, str], only: list[str], judged: dict) -> list[tuple[str, str]]:
    """``(mutant, reason it is left or "")`` of the mutants of ``found`` (name -> status) matching the patterns
    ``only`` that no test caught and that are not judged equivalent in ``judged`` (:func:`verdicts`)."""
    return [
        (key, judged[key].reason if key in judged else "")
        for key, status in sorted(found.items())
        if any(fnmatch.fnmatch(key, pattern) for pattern in only)
        and status not in ("killed", "timeout", "not checked")
        and not (key in judged and judged[key].kind == "equivalent")
    ]


if __name__ == "__main__":
    sys.exit(main())
