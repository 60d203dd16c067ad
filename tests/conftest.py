"""Shared fixtures: every test starts from the same global state."""

import os
import sys

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")
# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. The variable is read
# when a kernel is decorated, so it is set before any test imports mmlight.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session):
    """Start the Docker test's image builds (minutes of downloads and disk writes) in the background once
    the tests are chosen, when that test is among them: see tests/test_docker_image.py."""
    if not session.config.option.collectonly and any(
        item.path.name == "test_docker_image.py" for item in session.items
    ):
        from tests.test_docker_image import start_background_build

        start_background_build()


def pytest_sessionfinish(session):
    if "tests.test_docker_image" in sys.modules:
        sys.modules["tests.test_docker_image"].stop_background_build()


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


def quiet_trainer(**options):
    """A one-device CPU ``lightning.Trainer`` that writes and prints nothing of its own: no logger, no
    checkpoints, no progress bar, no model summary.

    Args:
        options: any other ``Trainer`` argument (``max_steps``, ``callbacks``, ...), or one of these to override.
    """
    import lightning as L  # here, not at the top: most tests never build a Trainer

    quiet = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**quiet, **options})


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: each test's models are new objects, and
    caches from earlier tests would only count against its recompile limit (8 per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
