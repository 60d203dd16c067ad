"""What the kernels run on, read without importing Triton (``mmlight.kernels.runtime``)."""

import pytest
import torch

from mmlight.kernels.runtime import triton_interpreting
from mmlight.reweighting.backend import resolve_backend


@pytest.mark.parametrize("value, interpreting", [(None, False), ("0", False), ("1", True), ("", False)])
def test_the_interpreter_is_on_only_when_asked_for(monkeypatch, value, interpreting):
    """Unset is off: on a GPU machine the compiled kernels run, and on a CPU-only one without the
    variable ``backend="triton"`` says it needs CUDA tensors rather than launching a kernel on them."""
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreting() is interpreting
    if not interpreting:
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            resolve_backend("triton", torch.randn(2), True, "MultiMax")
