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


def test_a_length_falls_in_the_first_bucket_at_least_as_long():
    """Against a bisection over the edges, for every length up to past the last edge."""
    import bisect

    edges = tiles.BUCKETS
    for n in range(1, edges[-1] + 600):
        assert tiles.seq_bucket(n) == edges[min(bisect.bisect_left(edges, n), len(edges) - 1)], n
    assert [tiles.seq_bucket(n) for n in (256, 257, 1024, 1025, 16384, 10**6)] == [256, 1024, 1024, 4096, 16384, 16384]


def test_a_row_covers_its_bucket_only(monkeypatch):
    """A row keyed on the bucket of 197 (up to 256 keys) serves 1 to 256 keys, not 257."""
    monkeypatch.setitem(tiles.MEASURED, (90, 64, "bf16", True, 256), {"dq": WIDE})
    assert measured("dq", 90, 64, torch.bfloat16, True, 1) == WIDE
    assert measured("dq", 90, 64, torch.bfloat16, True, 256) == WIDE
    assert measured("dq", 90, 64, torch.bfloat16, True, 257) is None
    assert measured("dq", 90, 64, torch.bfloat16, 1, 100) == WIDE  # a truthy causal reads the causal row


def test_a_dtype_without_a_short_name_is_keyed_by_its_torch_name(monkeypatch):
    monkeypatch.setitem(tiles.MEASURED, (90, 64, "torch.float64", False, 256), {"forward": NARROW})
    assert measured("forward", 90, 64, torch.float64, False, 197) == NARROW
    assert measured("forward", 90, 64, torch.float32, False, 197) is None
    assert [tiles.DTYPE_NAMES[d] for d in (torch.float32, torch.bfloat16, torch.float16)] == ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("major, minor, capability", [(8, 0, 80), (8, 6, 86), (9, 0, 90), (10, 0, 100), (12, 1, 121)])
def test_a_cuda_device_s_capability_is_ten_major_plus_minor(monkeypatch, major, minor, capability):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or (major, minor))
    device = torch.device("cuda", 1)  # a device object needs no GPU; only the patched query reads it
    assert tiles.device_capability(device) == capability and asked == [device]


def test_cpu_tensors_take_the_offline_capability_which_a_compile_check_sets():
    assert tiles.device_capability(torch.device("cpu")) == 90  # the default: Hopper
    token = tiles.OFFLINE_CAPABILITY.set(80)
    try:
        assert tiles.device_capability(torch.device("cpu")) == 80
    finally:
        tiles.OFFLINE_CAPABILITY.reset(token)
    assert tiles.device_capability(torch.device("cpu")) == 90


def test_the_config_functions_launch_a_measured_row_and_the_offline_choice_elsewhere(monkeypatch):
    """A row of the table reaches each kernel's launch: the row-wise kernel takes rows per program from
    ``block_m`` and its warps (its tile width stays the row's power of two); the attention kernels take the
    whole config. A length in another bucket keeps the offline choice."""
    from mmlight.kernels import attention, rowwise

    dq = BlockConfig(64, 16, 2, 1)
    monkeypatch.setitem(tiles.MEASURED, (90, 0, "bf16", False, 256), {"rowwise": BlockConfig(4, 0, 2, 1)})
    monkeypatch.setitem(tiles.MEASURED, (90, 64, "bf16", False, 256), {"forward": WIDE, "dkdv": NARROW, "dq": dq})
    assert rowwise._launch_config(197, torch.bfloat16, 90) == {"long": False, "BLOCK_N": 256, "ROWS": 4, "num_warps": 2}
    assert attention.forward_config(64, torch.bfloat16, 90, False, 197) == WIDE
    assert attention.backward_configs(64, torch.bfloat16, 90, False, 197) == (NARROW, dq)
    # 300 is in the next bucket: offline, 4096 // 512 rows of a 512-wide tile, 8 warps (docs/kernels.md's table)
    assert rowwise._launch_config(300, torch.bfloat16, 90) == {"long": False, "BLOCK_N": 512, "ROWS": 8, "num_warps": 8}
    assert attention.forward_config(64, torch.bfloat16, 90, False, 300) == BlockConfig(128, 64, 8, 3)
    assert attention.backward_configs(64, torch.bfloat16, 90, False, 300) == (
        BlockConfig(32, 64, 8, 2),
        BlockConfig(128, 32, 8, 2),
    )
