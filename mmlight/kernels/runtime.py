"""What the Triton kernels can run on, without importing Triton.

The backend choice (:mod:`mmlight.reweighting.backend`) reads these before deciding whether to
import the kernels at all, so this module imports torch only.
"""

from __future__ import annotations

import os

import torch

#: Input dtypes the Triton kernels take (they compute in fp32 registers).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
