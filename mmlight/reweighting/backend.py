"""Which implementation computes a reweighting function: the one place the choice is made.

* ``reference``: eager PyTorch, the single definition of the mathematics;
* ``compile``: ``torch.compile`` of the reference;
* ``triton``: the fused kernels in :mod:`mmlight.kernels` (MultiMax and fixed-temperature softmax);
* ``auto`` (default): ``triton`` for CUDA tensors of a supported dtype when the function has a
  kernel, ``reference`` otherwise. ``auto`` never breaks a run: a kernel that fails to compile or
  launch on the device is replaced by ``compile`` for the rest of the process, with one warning
  that names it and the error (:func:`run_fused`); an explicit ``triton`` raises instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal, TypeVar, get_args

import torch

from mmlight.kernels.runtime import TRITON_DTYPES, triton_interpreting

Backend = Literal["auto", "reference", "compile", "triton"]
BACKENDS: tuple[str, ...] = get_args(Backend)


def check_backend(backend: str) -> str:
    """Return ``backend`` if it is a known name, else raise a ``ValueError`` listing the names."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    return backend


def triton_runs_on(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``tensor``: a CUDA tensor, or any under the interpreter."""
    return tensor.is_cuda or triton_interpreting()


def resolve_backend(backend: str, tensor: torch.Tensor, has_kernel: bool, owner: str) -> str:
    """The concrete backend (``reference``, ``compile`` or ``triton``) for one call.

    Args:
        backend: the requested name, possibly ``auto``.
        tensor: the input, whose device and dtype decide ``auto``.
        has_kernel: whether a Triton kernel exists for this function and configuration.
        owner: what is being computed, for error messages.
    """
    if backend == "auto":
        usable = has_kernel and tensor.is_cuda and tensor.dtype in TRITON_DTYPES
        return "triton" if usable else "reference"
    if backend == "triton":
        if not has_kernel:
            raise ValueError(f"{owner} has no Triton kernel; use backend 'reference' or 'compile'")
        if not triton_runs_on(tensor):
            raise ValueError(
                f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), "
                f"got a tensor on {tensor.device}"
            )
        if tensor.dtype not in TRITON_DTYPES:
            raise ValueError(f"backend 'triton' takes {[str(d) for d in TRITON_DTYPES]}, got {tensor.dtype}")
    return backend


T = TypeVar("T")
#: Kernels that failed under ``auto`` in this process, by :func:`kernel_key`, with the error.
FAILED_KERNELS: dict[str, str] = {}
# Kernels whose backward pass ``auto`` has already launched once (see run_fused).
_PROBED: set[str] = set()


def kernel_key(kernel: str, inputs: tuple) -> str:
    """``kernel`` with the dtype of its first tensor input and the power of two at or above its last
    dim (what the kernels' tile sizes follow), e.g. ``MultiMax attention (torch.bfloat16, <=64)``:
    failures are remembered, and backward passes tried, per such key."""
    first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        return kernel
    return f"{kernel} ({first.dtype}, <={1 << max(first.shape[-1] - 1, 0).bit_length()})"


def run_fused(requested: str, kernel: str, fused: Callable[..., T], fallback: Callable[..., T], *inputs) -> T:
    """``fused(*inputs)``, a Triton kernel; under ``auto``, ``fallback(*inputs)`` if it cannot run.

    Under ``auto`` the first call of a kernel for a dtype and last dim also runs its backward pass
    once on detached copies of the inputs (when one requires grad), since the backward kernels are
    compiled only at their first launch, after the forward has committed to the kernel. A failure
    of either (compile error, too many resources, a launch error) is remembered in
    :data:`FAILED_KERNELS`: one warning names the kernel and the error, and ``fallback`` (the
    ``compile`` backend) computes every later call. Out-of-memory errors are raised: the fallback
    would need more memory, not less.

    Args:
        requested: the backend the user asked for; only ``auto`` falls back.
        kernel: what the kernel computes, for the warning (e.g. ``MultiMax attention``).
        fused: calls the kernel.
        fallback: computes the same on the ``compile`` backend.
        inputs: the arguments of both.
    """
    if requested != "auto":
        return fused(*inputs)
    if torch.compiler.is_compiling():
        # Inside a network compiled whole (a task's `compile` option) the kernels are opaque operators
        # of the graph: no probe (its backward pass would break the graph) and no fallback while the
        # graph runs. A kernel that failed earlier in the process keeps its fallback; one that fails
        # while the compiled graph runs raises its own error.
        if FAILED_KERNELS and kernel_key(kernel, inputs) in FAILED_KERNELS:
            return fallback(*inputs)
        return fused(*inputs)
    key = kernel_key(kernel, inputs)
    if key in FAILED_KERNELS:
        return fallback(*inputs)
    try:
        if key not in _PROBED and torch.is_grad_enabled():
            _run_backward_once(fused, inputs)
            _PROBED.add(key)
        return fused(*inputs)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - any kernel failure; auto must not break the run
        FAILED_KERNELS[key] = (
            f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        )
        warnings.warn(
            f"mmlight: the Triton kernel for {key} failed on this device ({FAILED_KERNELS[key]}); "
            "backend 'auto' computes it with 'compile' from now on. Run `mmlight doctor` for details, "
            "or set backend 'triton' to get the error raised.",
            RuntimeWarning,
            stacklevel=2,
        )
        return fallback(*inputs)


def _run_backward_once(fused: Callable, inputs: tuple) -> None:
    """Forward and backward of ``fused`` on detached copies of ``inputs`` (none accumulates a
    gradient anywhere), when any tensor input requires grad."""
    copies = tuple(
        t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs
    )
    leaves = [t for t in copies if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return
    out = fused(*copies)
    if out is not None:  # None: no kernel for these inputs (the caller takes another path)
        torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
