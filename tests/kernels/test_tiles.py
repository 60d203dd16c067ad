"""``mmlight/kernels/tiles.py``: the forced configs of ``override_tiles`` and the measured table."""

from __future__ import annotations

import threading

import pytest
import torch

from mmlight.kernels import tiles
from mmlight.kernels.tiles import BlockConfig, measured, override_tiles

WIDE, NARROW = BlockConfig(128, 64, 8, 3), BlockConfig(32, 16, 4, 1)


def read_in_another_thread(kernel: str) -> BlockConfig | None:
    """What ``measured`` returns on a thread of its own, as autograd's backward thread for CUDA
    tensors calls the dK/dV and dQ config functions."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(measured(kernel, 90, 64, torch.bfloat16, False, 197)))
    thread.start()
    thread.join()
    return seen[0]


def test_an_override_reaches_other_threads_and_ends_with_its_block():
    assert read_in_another_thread("dkdv") is None  # nothing forced, and no measured row
    with override_tiles(dkdv=WIDE, dq=NARROW):
        assert read_in_another_thread("dkdv") == WIDE and read_in_another_thread("dq") == NARROW
        assert read_in_another_thread("forward") is None
    assert read_in_another_thread("dkdv") is None


def test_nested_overrides_add_and_restore():
    with override_tiles(forward=WIDE):
        with override_tiles(forward=NARROW, rowwise=WIDE):
            assert measured("forward", 90, 64, torch.bfloat16, False, 197) == NARROW
            assert measured("rowwise", 90, 0, torch.bfloat16, False, 197) == WIDE
        assert measured("forward", 90, 64, torch.bfloat16, False, 197) == WIDE
        assert measured("rowwise", 90, 0, torch.bfloat16, False, 197) is None


def test_an_override_is_undone_when_its_block_raises():
    with pytest.raises(RuntimeError, match="inside"):
        with override_tiles(dq=WIDE):
            raise RuntimeError("inside")
    assert measured("dq", 90, 64, torch.bfloat16, False, 197) is None


def test_a_measured_row_is_read_by_capability_head_dim_dtype_causality_and_bucket(monkeypatch):
    bucket = tiles.seq_bucket(197)
    monkeypatch.setitem(tiles.MEASURED, (90, 64, "bf16", False, bucket), {"forward": WIDE})
    assert measured("forward", 90, 64, torch.bfloat16, False, 197) == WIDE
    assert measured("dkdv", 90, 64, torch.bfloat16, False, 197) is None  # a kernel the row lacks
    for other in [
        (80, 64, torch.bfloat16, False),
        (90, 128, torch.bfloat16, False),
        (90, 64, torch.float16, False),
        (90, 64, torch.bfloat16, True),
    ]:
        assert measured("forward", *other, 197) is None
    with override_tiles(forward=NARROW):  # a forced config wins over the table
        assert measured("forward", 90, 64, torch.bfloat16, False, 197) == NARROW


def test_unknown_kernel_names_are_refused():
    with pytest.raises(ValueError, match="unknown kernel names \\['backward'\\]"):
        with override_tiles(backward=WIDE):
            pass
