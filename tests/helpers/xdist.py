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


class SharedScopes(LoadFileScheduling):
    """xdist's ``loadfile`` scheduling (a worker takes a whole test file at a time) with the scopes of
    :data:`SHARED_SCOPES` in place of their files."""

    def _split_scope(self, nodeid: str) -> str:
        shared = (scope for prefix, scope in SHARED_SCOPES.items() if nodeid.startswith(prefix))
        return next(shared, super()._split_scope(nodeid))
