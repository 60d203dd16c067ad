"""Where a test lives: every test module either mirrors a module of the code it tests or is listed in
:data:`ALLOWED` with the reason it cannot (docs/testing.md, "Layout")."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

#: test modules that test no single module, with the reason; grouped as docs/testing.md describes them
ALLOWED = {
    # the repository as a whole
    "test_docs.py": "the docs' commands and references",
    "test_doc_names.py": "the config keys, Python names and paths the docs name",
    "test_docker.py": "the Dockerfiles (lint)",
    "test_docker_image.py": "the Docker image, built and run",
    "test_layers.py": "the package's import layers",
    "test_public_api.py": "the whole package's use of third-party private names",
    "test_resume.py": "a killed fit resumed by the command line, compared bitwise",
    "test_test_imports.py": "the suite's own rules",
    "test_test_layout.py": "the suite's own rules",
    "test_benchmarks.py": "the benchmark scripts' smoke runs",
    "test_benchmark_attention_stats.py": "the attention-statistics benchmarks' smoke runs",
    "benchmarks/test_results_files.py": "benchmarks/results/ and BENCHMARKS.md's rendered tables",
    "benchmarks/test_gpu_faults.py": "the GPU run's control flow (the benchmarks/gpu/ package) under injected faults",
    "benchmarks/test_gpu_wheels.py": "benchmarks/gpu_wheels.sh, a shell script, and the documented offline install",
    "experiments/test_slurm_sweep.py": "slurm/sweep.sh submitting a table's runs",
    # behaviour that spans the modules of one package
    "reweighting/test_functions.py": "every registered function, parametrised by the registry",
    "reweighting/test_fallback.py": "the backend fallback across base.py, backend.py and nn/attention.py",
    "callbacks/test_callbacks.py": "the default callbacks together in one fit",
    "data/test_ddp.py": "the streaming DataModules under 2-process DDP",
    "data/test_malformed_shards.py": "every reader of shards against corrupt input",
    "data/test_shard_datamodule.py": "streaming.py's ShardDataModule through its subclasses",
    "kernels/test_compile.py": "every kernel compiled for sm_80/sm_90 (benchmarks/compile_check.py)",
    "kernels/test_flex.py": "the FlexAttention peer against the kernels",
    "kernels/test_gradient_precision.py": "every kernel's gradients against float64",
    "kernels/test_score_recompute.py": "the attention kernels' forward and backward together",
    "models/test_compiled_network.py": "every model compiled with every function",
    "models/test_pinned_forwards.py": "every paper and quick-start config's network, pinned bit for bit",
    "models/test_gated_attention.py": "the output gate in every model (nn/gate.py with models/)",
    "nn/test_observation.py": "the observation point across models",
    "tasks/test_compile_option.py": "the compile option across tasks (compiling.py with each task)",
    "tasks/test_finetune_optim.py": "fine-tuning's parameter groups (optim.py with classification.py)",
    "tasks/test_finetune_quickstart.py": "the fine-tuning quick start end to end",
    "tasks/test_metrics.py": "the tasks' metrics against hand computations",
    "tasks/test_text_ddp.py": "the text tasks under 2-process DDP",
    "analysis/test_gate_and_sink_stats.py": "statistics of gated and sink attention (stats.py with nn/gate.py)",
    "analysis/test_metrics.py": "reweighting/metrics.py as the analysis uses it",
}

#: where each tests/ folder's modules are mirrored from (beside mmlight/<folder>/)
MIRRORED = {"benchmarks": ROOT / "benchmarks", "tools": ROOT / "tools"}


def modules() -> set[str]:
    """Every module the tests may mirror, as ``folder/name`` (``name`` for the package's top level)."""
    found = {p.relative_to(ROOT / "mmlight").with_suffix("").as_posix() for p in (ROOT / "mmlight").rglob("*.py")}
    found |= {f"{folder}/{p.stem}" for folder, root in MIRRORED.items() for p in root.glob("*.py")}
    return found


def mirrors(test: str, known: set[str]) -> bool:
    """Whether ``test`` (a path under tests/) is named after a module: ``folder/test_<module>[_<topic>].py``
    for ``folder/<module>.py`` (or one in a subfolder), ``test_<module>.py`` for a top-level module or a
    folder named like it (``slurm/test_slurm.py``), and ``test_<command>[_<topic>].py`` anywhere for
    ``commands/<command>.py``."""
    folder, _, file = test.rpartition("/")
    name = file.removeprefix("test_").removesuffix(".py")
    prefixes = [name[:i] for i in range(len(name), 0, -1) if i == len(name) or name[i] == "_"]
    for prefix in prefixes:
        candidates = {f"commands/{prefix}", prefix if not folder else f"{folder}/{prefix}"}
        if folder and folder.split("/")[-1] == prefix:
            candidates.add(prefix)
        if candidates & known or any(m.startswith(f"{folder}/") and m.endswith(f"/{prefix}") for m in known):
            return True
    return False


def test_the_mirror_rule_reads_every_form():
    known = {"kernels/attention", "data/prepare/cifar", "slurm", "commands/analyze", "safe_load", "tools/mutation"}
    assert mirrors("kernels/test_attention_kernel.py", known)
    assert mirrors("data/test_cifar.py", known) and mirrors("slurm/test_slurm.py", known)
    assert mirrors("analysis/test_analyze_outputs.py", known) and mirrors("test_safe_load.py", known)
    assert mirrors("tools/test_mutation.py", known)
    assert not mirrors("kernels/test_rowwise.py", known) and not mirrors("nn/test_attention.py", known)


def test_every_test_module_mirrors_a_module_or_is_allowed_with_a_reason():
    known = modules()
    tests = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))
    strays = [t for t in tests if t not in ALLOWED and not mirrors(t, known)]
    assert strays == [], "name them test_<module>.py beside the module's mirror, or add them to ALLOWED"
    stale = sorted(set(ALLOWED) - set(tests))
    assert stale == [], "in ALLOWED but not in tests/"
    needless = sorted(t for t in ALLOWED if mirrors(t, known))
    assert needless == [], "mirror a module: no entry in ALLOWED needed"
