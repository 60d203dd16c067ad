"""Section ``attention``: the fused MultiMax attention against SDPA in the same process, at DeiT-small's
shape (N = 197) and causal N = 1,024 and 4,096, forward and backward.

First the check pool checks against fp32, at each kernel specialisation, the kernel as shipped, with
each switch alone set away from its shipped value and with all on (and so compiles them). Then, per
shape: SDPA (flash, cuDNN, memory-efficient), the kernel as shipped (with and without the
sigma-parameter gradients), its plain softmax (order 0), each switch setting that passed alone, all
switches on, and the FlexAttention peer's forward (MultiMax as a ``score_mod`` with sigma's parameters
frozen, ``benchmarks/flex_multimax.py``). Ratios are to SDPA flash. A ``switch_rule`` record per
setting applies the rule for the defaults: a setting becomes the default where it is correct and at
least :data:`FASTER_BY` faster (forward + backward) than shipped at every target shape.
"""

from __future__ import annotations

import importlib

from benchmarks.gpu.common import (
    attention_shapes,
    dtype_name,
    placement,
    present_switches,
    ratios,
    switched,
    time_fused,
    time_pair,
)
from benchmarks.gpu.pool import run_pool
from benchmarks.gpu.record import Run

#: Seconds one timing may take (a compilation not cached by the checks included).
TIMING_LIMIT_S = 45
#: Seconds the FlexAttention peer may take (its torch.compile included).
FLEX_LIMIT_S = 90
#: Seconds one check may take in the pool.
CHECK_LIMIT_S = 120
#: The least speed-up (fraction of forward + backward) that turns a switch on by default.
FASTER_BY = 0.03


def switch_settings() -> list[tuple[str, dict]]:
    """``(label, settings)``: as shipped, each switch alone set to the value it does not ship with, all on."""
    shipped = {name: getattr(importlib.import_module(module), name) for module, name, _ in present_switches()}
    alone = [(f"{name}={not value}", {name: not value}) for name, value in shipped.items()]
    every = [("all switches", dict.fromkeys(shipped, True))] if len(shipped) > 1 else []
    return [("shipped", {}), *alone, *every]


def check_switches(run: Run, jobs: int) -> dict[str, bool]:
    """Each setting checked at each specialisation (recorded as it finishes); ``label -> all passed``."""
    shapes = {s.specialisation: s for s in attention_shapes(run.smoke)}.values()
    tasks, labels = [], []
    for shape in shapes:
        for label, settings in switch_settings():
            tasks.append(("benchmarks.gpu.common:check_attention", (shape, None, None, settings)))
            labels.append((shape.name, label, settings))
    passed: dict[str, bool] = {}

    def record(index: int, verdict: dict) -> None:
        shape_name, label, settings = labels[index]
        run.emit(kind="check", section="attention", shape_name=shape_name, kernel=None, switches=settings, **verdict)
        passed[label] = passed.get(label, True) and bool(verdict.get("ok"))

    for index in run_pool(run, tasks, jobs, CHECK_LIMIT_S, record):
        passed[labels[index][1]] = False  # not checked: not timed either
    return passed


def sdpa_timings(run: Run, shape) -> list[tuple[str, dict]]:
    """SDPA's backends (``math`` on the CPU), each its own attempt."""
    import torch
    import torch.nn.functional as F

    device, dtype = placement()
    backends = [("math", None)]
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        backends = [
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ]
    q, k, v = (torch.randn(shape.shape, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
    found = []
    for name, backend in backends:

        def forward(backend=backend):
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
            with torch.nn.attention.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

        found.append(
            (
                f"sdpa/{name}",
                run.attempt(f"sdpa {name}", TIMING_LIMIT_S, lambda f=forward: time_pair(run.smoke, f, [q, k, v])),
            )
        )
    return found


def order0_timing(run: Run, shape) -> dict:
    """The fused kernel without sigma (order 0): what sigma costs, by difference."""
    import torch

    from mmlight.kernels.attention import multimax_attention

    device, dtype = placement()
    q, k, v = (torch.randn(shape.shape, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
    return time_pair(run.smoke, lambda: multimax_attention(q, k, v, causal=shape.causal), [q, k, v])


def flex_timing(run: Run, shape) -> dict:
    """Forward milliseconds of MultiMax through compiled FlexAttention, sigma's parameters frozen."""
    import torch
    from bench_multimax import bent_multimax
    from flex_multimax import causal_block_mask, flex_multimax_attention
    from torch.nn.attention.flex_attention import flex_attention

    from benchmarks.gpu.common import ORDER, timer

    device, dtype = placement()
    q, k, v = (torch.randn(shape.shape, device=device, dtype=dtype) for _ in "qkv")
    module = bent_multimax("reference", device, ORDER)
    cuda = device.type == "cuda"
    flex = torch.compile(flex_attention) if cuda else flex_attention  # uncompiled on the CPU: the dense path
    n = shape.shape[2]
    mask = causal_block_mask(n, n, device, compile_mask=cuda) if shape.causal else None
    with torch.no_grad():
        forward = lambda: flex_multimax_attention(  # noqa: E731
            q, k, v, module.ranges, module.ts, block_mask=mask, flex=flex, frozen=True
        )
        return {"fwd_ms": timer(run.smoke, forward)}


def section(run: Run, jobs: int) -> None:
    passed = check_switches(run, jobs)
    totals: dict[str, dict[str, float]] = {}  # label -> shape -> fwd + bwd ms
    for shape in attention_shapes(run.smoke)[: 1 if run.smoke else None]:
        base = {"kind": "timing", "op": "attention_causal" if shape.causal else "attention"}
        base.update(shape=list(shape.shape), dtype=dtype_name(placement()[1]))
        records = sdpa_timings(run, shape)
        for label, settings in switch_settings():
            if not passed.get(label):
                run.emit(
                    kind="skipped", section="attention", what=f"{label} at {shape.name}", reason="failed its check"
                )
                continue
            with switched(settings):
                timing = run.attempt(f"{label} at {shape.name}", TIMING_LIMIT_S, lambda: time_fused(run.smoke, shape))
            records.append((f"multimax/triton {label}", {**timing, "switches": settings}))
            if timing.get("fwd_ms") and timing.get("bwd_ms"):
                totals.setdefault(label, {})[shape.name] = timing["fwd_ms"] + timing["bwd_ms"]
        no_grads = run.attempt("no param grads", TIMING_LIMIT_S, lambda: time_fused(run.smoke, shape, False))
        records.append(("multimax/triton shipped, no param grads", no_grads))
        records.append(
            ("softmax/triton (order 0)", run.attempt("order 0", TIMING_LIMIT_S, lambda: order0_timing(run, shape)))
        )
        records.append(
            ("multimax/flex (frozen sigma), fwd", run.attempt("flex", FLEX_LIMIT_S, lambda: flex_timing(run, shape)))
        )
        flash = dict(records).get("sdpa/flash") or records[0][1]
        run.state.setdefault("flash", {})[shape.name] = flash  # the sweep's tuned timing is set beside it
        for backend, timing in records:
            run.emit(**base, backend=backend, **timing, **ratios(timing, flash))
    switch_rules(run, passed, totals)


def switch_rules(run: Run, passed: dict[str, bool], totals: dict[str, dict[str, float]]) -> None:
    """The default each switch's measurements give: on where correct and faster by :data:`FASTER_BY`."""
    shipped = totals.get("shipped", {})
    for label, settings in switch_settings()[1:]:
        speedups = {
            shape: round(1 - ms / shipped[shape], 4) for shape, ms in totals.get(label, {}).items() if shape in shipped
        }
        timed_everywhere = bool(shipped) and set(speedups) == set(shipped)
        run.emit(
            kind="switch_rule",
            switch=label,
            settings=settings,
            correct=bool(passed.get(label)),
            speedup_fwd_bwd=speedups,
            change_default=bool(passed.get(label)) and timed_everywhere and min(speedups.values()) >= FASTER_BY,
            rule=f"the setting becomes the default where correct and at least {FASTER_BY:.0%} faster (fwd + bwd) "
            "than shipped at every shape timed",
        )
