"""What several sections measure: the attention problems, the kernel switches, the check of a kernel
against the fp32 reference (run in the check pool, :mod:`benchmarks.gpu.pool`) and the timers.

Torch and the kernels are imported inside the functions: the run's plumbing imports this module
before any section has asked for them.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

#: Largest error of a kernel against the fp32 reference, relative to the reference's largest magnitude
#: (``mmlight doctor``'s tolerance for attention in bf16; fp32 under the interpreter).
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}
#: MultiMax's order in every measurement (the paper's second order).
ORDER = 2

#: Kernel switches: ``(module, attribute, values)``; the first value is the shipped one.
ATTENTION_SWITCHES = [
    ("mmlight.kernels.attention", "PARAM_SUMS_PER_PROGRAM", (False, True)),
    ("mmlight.kernels.attention", "MASK_FREE_INTERIOR", (False, True)),
    ("mmlight.kernels.attention", "OUTPUT_IN_CALLER_LAYOUT", (False, True)),
    ("mmlight.kernels.attention", "SINGLE_PASS_BACKWARD", (False, True)),
]
CE_SWITCHES = [("mmlight.kernels.cross_entropy", "GRADIENT_IN_BACKWARD", (False, True))]
ROWWISE_SWITCHES = [("mmlight.kernels.rowwise", "PERSISTENT_ROWS", (False, True))]


@dataclass(frozen=True)
class AttentionShape:
    """One attention problem.

    Args:
        name: label of the records.
        shape: ``(B, H, N, D)`` timed.
        check_batch: B of the correctness check (same H, N and D: the same kernel specialisation).
        causal: causal mask.
    """

    name: str
    shape: tuple[int, int, int, int]
    check_batch: int
    causal: bool

    @property
    def specialisation(self) -> str:
        """The shape whose checks stand for this one's (causal 4,096 compiles what causal 1,024 does)."""
        return "causal_1k" if self.name == "causal_4k" else self.name


def attention_shapes(smoke: bool) -> list[AttentionShape]:
    """DeiT-small (N = 197) and causal N = 1,024 / 4,096 on a GPU; two tiny problems under ``--smoke``."""
    if smoke:
        # one head: the interpreter runs each program in turn, so a second head only doubles the time
        return [AttentionShape("deit", (1, 1, 19, 16), 1, False), AttentionShape("causal", (1, 1, 21, 16), 1, True)]
    return [
        AttentionShape("deit", (256, 6, 197, 64), 2, False),
        AttentionShape("causal_1k", (32, 12, 1024, 64), 2, True),
        AttentionShape("causal_4k", (8, 12, 4096, 64), 2, True),
    ]


def present_switches(switches=ATTENTION_SWITCHES) -> list[tuple[str, str, tuple]]:
    """The switches this code base has (a switch removed once decided drops out)."""
    return [s for s in switches if hasattr(importlib.import_module(s[0]), s[1])]


@contextlib.contextmanager
def switched(settings: dict[str, object]) -> Iterator[None]:
    """Set kernel switches (by attribute name) for the block."""
    every = present_switches(ATTENTION_SWITCHES + CE_SWITCHES + ROWWISE_SWITCHES)
    modules = {name: importlib.import_module(module) for module, name, _ in every}
    old = {name: getattr(modules[name], name) for name in settings}
    for name, value in settings.items():
        setattr(modules[name], name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(modules[name], name, value)


def placement():
    """``(device, dtype)``: CUDA in bf16, else the CPU in fp32 (Triton's interpreter)."""
    import torch

    return (torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else (torch.device("cpu"), torch.float32)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def attention_inputs(shape, dtype, device, seed=0, param_grads=True):
    """``(q, k, v, ranges, ts)``: random q, k, v and bent MultiMax parameters, all leaves."""
    import torch
    from bench_multimax import bent_multimax  # beside the gpu package

    gen = torch.Generator(device).manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen, device=device).to(dtype).requires_grad_() for _ in "qkv")
    module = bent_multimax("triton", device, ORDER)
    module.ranges.requires_grad_(param_grads)
    module.ts.requires_grad_(param_grads)
    return q, k, v, module.ranges, module.ts


def fused(inputs, causal):
    from mmlight.kernels import attention as attention_kernel

    q, k, v, ranges, ts = inputs
    return attention_kernel.multimax_attention(q, k, v, ranges, ts, causal=causal)


def reference_attention(q, k, v, ranges, ts, causal):
    """Explicit fp32 attention with MultiMax on the scores (the eager definition)."""
    import torch

    from mmlight.reweighting.multimax import multimax_sigma

    x = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = multimax_sigma(x, ranges, ts)
    if causal:
        n, m = x.shape[-2:]
        keep = torch.arange(m, device=x.device)[None, :] <= torch.arange(n, device=x.device)[:, None] + (m - n)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def outputs_and_grads(fn, inputs):
    """The output and the gradients of all leaves that require them, for a fixed upstream gradient."""
    import torch

    out = fn(inputs)
    upstream = torch.cos(torch.arange(out.numel(), device=out.device, dtype=torch.float32)).reshape(out.shape)
    leaves = [t for t in inputs if t.requires_grad]
    return [out.detach(), *torch.autograd.grad(out, leaves, upstream.to(out.dtype))]


def check_attention(shape: AttentionShape, kernel: str | None, cfg, switches: dict) -> dict:
    """Error of the fused kernel with one kernel's tile config and/or switch settings against fp32 (output
    and all gradients). Runs in a worker of the check pool: its first launch compiles into the Triton
    cache that the timings of the main process then load."""
    from mmlight.commands.doctor import relative_error
    from mmlight.kernels.tiles import override_tiles

    device, dtype = placement()
    _, h, n, d = shape.shape
    inputs = attention_inputs((shape.check_batch, h, n, d), dtype, device, seed=1)
    exact = [t.detach().float().requires_grad_() for t in inputs]
    want = outputs_and_grads(lambda t: reference_attention(*t, shape.causal), exact)
    with override_tiles(**({kernel: cfg} if cfg else {})), switched(switches):
        got = outputs_and_grads(lambda t: fused(t, shape.causal), inputs)
    error = max(relative_error(g, w) for g, w in zip(got, want))
    return {"error": error, "ok": error <= TOLERANCE[dtype_name(dtype)]}


def timer(smoke: bool, fn: Callable[[], object], reps: int = 50) -> float:
    """Median milliseconds (``do_bench`` on a GPU); under ``--smoke`` one host-timed call."""
    if smoke:
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3
    from bench_multimax import time_ms

    return time_ms(fn, reps)


def time_pair(smoke: bool, forward: Callable, leaves: list, phases=("fwd", "bwd")) -> dict:
    """Forward and/or backward milliseconds (backward by a retained graph)."""
    import torch

    out = forward()
    upstream = torch.randn_like(out)
    wanted = [t for t in leaves if t.requires_grad]
    timing = {}
    if "fwd" in phases:
        timing["fwd_ms"] = timer(smoke, forward)
    if "bwd" in phases:
        timing["bwd_ms"] = timer(smoke, lambda: torch.autograd.grad(out, wanted, upstream, retain_graph=True))
    return timing


def time_fused(smoke: bool, shape: AttentionShape, param_grads: bool = True, phases=("fwd", "bwd")) -> dict:
    """Milliseconds of the fused kernel at ``shape`` under the current tiles and switches."""
    device, dtype = placement()
    inputs = attention_inputs(shape.shape, dtype, device, param_grads=param_grads)
    return time_pair(smoke, lambda: fused(inputs, shape.causal), list(inputs), phases)


def ratios(record: dict, baseline: dict, phases=("fwd", "bwd")) -> dict:
    """``{phase}_ratio`` of ``record`` to ``baseline`` for each phase both timed."""
    return {
        f"{p}_ratio": round(record[f"{p}_ms"] / baseline[f"{p}_ms"], 3)
        for p in phases
        if record.get(f"{p}_ms") and baseline.get(f"{p}_ms")
    }
