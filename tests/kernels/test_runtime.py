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


def test_the_package_hands_out_each_kernel_from_its_module_and_keeps_it(monkeypatch):
    """``mmlight.kernels`` imports a kernel module on first use only; the name it returns is that module's
    function, stored in the package so that the next lookup skips ``__getattr__``."""
    import mmlight.kernels as package
    from mmlight.kernels import attention, cross_entropy, rowwise

    for name, module in [
        ("multimax_softmax", rowwise),
        ("multimax_attention", attention),
        ("multimax_cross_entropy", cross_entropy),
    ]:
        monkeypatch.delitem(vars(package), name, raising=False)
        assert package.__getattr__(name) is getattr(module, name)
        assert vars(package)[name] is getattr(module, name)
    with pytest.raises(AttributeError, match="^module 'mmlight.kernels' has no attribute 'multimax_loss'$"):
        package.multimax_loss  # noqa: B018
    assert sorted(package.__all__) == ["multimax_attention", "multimax_cross_entropy", "multimax_softmax"]
