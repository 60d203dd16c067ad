"""Shared fixtures: every test starts from the same global state."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")
# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. The variable is read
# when a kernel is decorated, so it is set before any test imports mmlight.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """In an xdist worker, torch computes on the worker's share of the cores (one thread each under
    ``-n auto``), and so do the processes the tests start: the workers already keep every core busy, and
    torch's default of one thread per core in each of them makes OpenMP's threads spin on cores that
    another worker holds (the seven full-size ``test_paper_text_config_fast_dev_run`` cases under ``-n 2``
    on a loaded 2-core machine: 92 s of CPU time with one thread per worker, 257 s with torch's default of two)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile`` (pyproject.toml's addopts), a worker takes a whole test file at a time, so a
    module builds its module-scoped fixtures (trained checkpoints, prepared shards, the Docker images) once;
    the files and tests of ``tests/helpers/xdist.py``'s ``SHARED_SCOPES`` go together to one worker."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.helpers.xdist import SharedScopes

    return SharedScopes(config, log)


def pytest_collection_finish(session):
    """Start the Docker test's image builds (minutes of downloads and disk writes) in the background once
    the tests are chosen, when that test is among them: see tests/test_docker_image.py. Under xdist the
    controller starts it instead (below), once for the whole run."""
    if hasattr(session.config, "workerinput") or session.config.option.collectonly:
        return
    if any(item.path.name == "test_docker_image.py" for item in session.items):
        from tests.helpers.docker import start_background_build

        start_background_build()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The xdist controller's counterpart of :func:`pytest_collection_finish`: the worker that runs the
    Docker tests finds the build by the run's ``testrunuid``."""
    if any(nodeid.startswith("tests/test_docker_image.py") for nodeid in ids):
        from tests.helpers.docker import start_background_build

        start_background_build(node.workerinput["testrunuid"])


def pytest_sessionfinish(session):
    if "tests.helpers.docker" in sys.modules:
        sys.modules["tests.helpers.docker"].stop_background_build()


@pytest.fixture(autouse=True)
def reset_global_state():
    """Restore torch's default dtype, grad mode and RNG after each test."""
    dtype = torch.get_default_dtype()
    grad = torch.is_grad_enabled()
    rng = torch.random.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)
    torch.random.set_rng_state(rng)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def plain_argv(monkeypatch):
    """``sys.argv`` as the ``mmlight`` console script sees it: LightningCLI warns when it gets args while
    ``sys.argv`` holds pytest's own arguments (modules that call the CLI in-process use it)."""
    monkeypatch.setattr(sys, "argv", ["mmlight"])


@pytest.fixture(scope="module")
def cluster():
    """The one-node SLURM cluster that ``.ci/slurm-cluster.sh`` installs and starts (as root, with apt);
    the test skips, saying why, where it cannot."""
    script = Path(__file__).resolve().parents[1] / ".ci" / "slurm-cluster.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"no SLURM cluster: {result.stderr.strip() or result.stdout.strip()}")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: each test's models are new objects, and
    caches from earlier tests would only count against its recompile limit (8 per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
