"""How the suite is spread over xdist workers (``-n auto --dist loadfile``, pyproject.toml; tests/conftest.py)."""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

#: tests that share something outside their process, by the scope they run in: one xdist worker runs the
#: tests of a scope one after another (the one-node SLURM cluster of .ci/slurm-cluster.sh)
SHARED_SCOPES = {
    "tests/slurm/test_slurm.py": "slurm",
    "tests/experiments/test_slurm_sweep.py": "slurm",
    "tests/test_docs.py::test_sbatch_test_only": "slurm",
}


#: scopes of few tests that take half a minute or more (``pytest --durations``), handed out first, longest
#: first: xdist orders the rest by their number of tests, which would leave these to the end of the run,
#: each on one worker while the others stand idle (the two DDP files and the kernels' compile check, last
#: in one run on 2 cores, kept one worker busy 48 s after the other had finished)
LONG_FIRST = (
    "slurm",
    "tests/models/test_compiled_network.py",
    "tests/test_docker_image.py",
    "tests/benchmarks/test_gpu_run.py",
    "tests/test_resume.py",
    "tests/experiments/test_sweep.py",
    "tests/analysis/test_analyze.py",
    "tests/test_benchmarks.py",
    "tests/kernels/test_compile.py",
    "tests/benchmarks/test_gpu_faults.py",
    "tests/data/test_ddp.py",
    "tests/callbacks/test_attention_stats.py",
    "tests/tasks/test_text_ddp.py",
)


class SharedScopes(LoadFileScheduling):
    """xdist's ``loadfile`` scheduling (a worker takes a whole test file at a time) with the scopes of
    :data:`SHARED_SCOPES` in place of their files, and those of :data:`LONG_FIRST` first."""

    def _assign_work_unit(self, node) -> None:
        for scope in reversed(LONG_FIRST):
            if scope in self.workqueue:
                self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)

    def _split_scope(self, nodeid: str) -> str:
        shared = (scope for prefix, scope in SHARED_SCOPES.items() if nodeid.startswith(prefix))
        return next(shared, super()._split_scope(nodeid))
