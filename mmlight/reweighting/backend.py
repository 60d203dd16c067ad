"""Which implementation computes a reweighting function: the one place the choice is made.

* ``reference``: eager PyTorch, the single definition of the mathematics;
* ``compile``: ``torch.compile`` of the reference;
* ``triton``: the fused kernels in :mod:`mmlight.kernels` (MultiMax and fixed-temperature softmax);
* ``auto`` (default): ``triton`` for CUDA tensors of a supported dtype when the function has a
  kernel, ``reference`` otherwise.
"""

from __future__ import annotations

import os
from typing import Literal, get_args

import torch

Backend = Literal["auto", "reference", "compile", "triton"]
BACKENDS: tuple[str, ...] = get_args(Backend)
#: Input dtypes the Triton kernels take (they compute in fp32 registers).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_backend(backend: str) -> str:
    """Return ``backend`` if it is a known name, else raise a ``ValueError`` listing the names."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    return backend


def triton_interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
            raise ValueError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), "
                             f"got a tensor on {tensor.device}")
        if tensor.dtype not in TRITON_DTYPES:
            raise ValueError(f"backend 'triton' takes {[str(d) for d in TRITON_DTYPES]}, got {tensor.dtype}")
    return backend
