"""Tile sizes of the Triton kernels: a table of measured choices, and the hook the sweep uses.

The kernels' config functions (``attention.forward_config``, ``attention.backward_configs``,
``rowwise._launch_config``) ask :func:`measured` first and fall back to their offline choices
(chosen for registers and spills, never timed) where the table has no row. There is no autotuning
at run time: a training job's first step never pays for a search.

A row of :data:`MEASURED` is keyed on ``(capability, head_dim, dtype, causal, bucket)`` and maps
kernel names to a :class:`BlockConfig`:

* ``capability``: ``10 * major + minor`` (80 A100, 90 H100/H200);
* ``head_dim``: the attention head dim, 0 for the row-wise kernel;
* ``dtype``: ``"fp32"``, ``"bf16"`` or ``"fp16"``;
* ``causal``: attention with a causal mask (False for the row-wise kernel);
* ``bucket``: :func:`seq_bucket` of the key length (row length for the row-wise kernel).

Kernel names: ``forward``, ``dkdv`` and ``dq`` (attention; ``dq``'s BLOCK_M is also the delta
kernel's) and ``rowwise`` (``block_m`` = rows per program, ``block_n`` unused: a short row's tile
is its length rounded up to a power of two). ``benchmarks/gpu_run.py`` times candidate configs on a
GPU and writes rows in this format (``tile_rows.py`` in its output folder), each with the record it
came from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = ["BlockConfig", "MEASURED", "device_capability", "measured", "override_tiles", "seq_bucket"]


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch options of one kernel.

    Args:
        block_m: queries per tile (row-wise kernel: rows per program).
        block_n: keys per tile (row-wise kernel: unused, 0).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the loads in the inner loop.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: Upper edges of the sequence-length buckets; longer sequences fall in the last one.
BUCKETS = (256, 1024, 4096, 16384)

#: Measured tile choices (see the module docstring for the key). Rows are pasted from the
#: ``tile_rows.py`` file that ``benchmarks/gpu_run.py`` writes, with the record file they came from.
MEASURED: dict[tuple[int, int, str, bool, int], dict[str, BlockConfig]] = {}

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

#: The capability whose tile sizes CPU tensors get: ``benchmarks/compile_check.py`` sets it to the
#: target it compiles for.
OFFLINE_CAPABILITY: ContextVar[int] = ContextVar("OFFLINE_CAPABILITY", default=90)

# Configs forced by override_tiles, by kernel name (the sweep and the tests set them). A module global,
# not a ContextVar: autograd runs the backward of CUDA tensors on a thread of its own, which a
# ContextVar set by the caller does not reach (the dK/dV and dQ overrides would silently not apply).
_OVERRIDE: dict[str, BlockConfig] = {}


def seq_bucket(n: int) -> int:
    """The bucket of a sequence length: the first of :data:`BUCKETS` that is at least ``n``."""
    return next((edge for edge in BUCKETS if n <= edge), BUCKETS[-1])


def device_capability(device: torch.device) -> int:
    """Compute capability as ``10 * major + minor`` (80: A100, 90: H100) of a CUDA device; for CPU
    tensors (the interpreter, offline compile checks) the value of :data:`OFFLINE_CAPABILITY`."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return OFFLINE_CAPABILITY.get()


def measured(
    kernel: str, capability: int, head_dim: int, dtype: torch.dtype, causal: bool, n: int
) -> BlockConfig | None:
    """The config forced by :func:`override_tiles`, else the table's, else None (use the offline one).

    Args:
        kernel: ``forward``, ``dkdv``, ``dq`` or ``rowwise``.
        capability: compute capability, ``10 * major + minor``.
        head_dim: attention head dim (0 for ``rowwise``).
        dtype: input dtype.
        causal: causal attention.
        n: key length (row length for ``rowwise``).
    """
    forced = _OVERRIDE.get(kernel)
    if forced is not None:
        return forced
    row = MEASURED.get((capability, head_dim, DTYPE_NAMES.get(dtype, str(dtype)), bool(causal), seq_bucket(n)))
    return None if row is None else row.get(kernel)


@contextlib.contextmanager
def override_tiles(**configs: BlockConfig) -> Iterator[None]:
    """Inside the block, the named kernels (``forward=``, ``dkdv=``, ``dq=``, ``rowwise=``) launch
    with the given configs, whatever the table says. For sweeps and tests, never for training."""
    unknown = set(configs) - {"forward", "dkdv", "dq", "rowwise"}
    if unknown:
        raise ValueError(f"unknown kernel names {sorted(unknown)}; use forward, dkdv, dq or rowwise")
    global _OVERRIDE
    saved = _OVERRIDE
    _OVERRIDE = {**saved, **configs}
    try:
        yield
    finally:
        _OVERRIDE = saved
