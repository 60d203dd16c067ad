"""Section ``rowwise``: the device's ceilings, the fused MultiMax cross-entropy against
``F.cross_entropy`` and the row-wise kernel against ``torch.softmax``.

The ceilings (device-to-device copy bandwidth, a bf16 matrix product) are what the row-wise
kernel's bandwidth is judged against. Each kernel setting (shipped, each switch, each rows-per-program
candidate) is checked against the fp32 reference on the same values first, then timed (fwd + bwd
together for the cross-entropy, whose gradient may be computed in either pass). The row-wise records
give each tensor's error (output, input and parameter gradients) against fp32 and against float64,
and a ``reference_error`` record the fp32 reference's own against float64, so that a failed check
says which side is off. The fastest row-wise config that passed becomes a row of ``tile_rows.py``.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import asdict

from benchmarks.gpu.common import (
    CE_SWITCHES,
    ORDER,
    ROWWISE_SWITCHES,
    TOLERANCE,
    dtype_name,
    outputs_and_grads,
    placement,
    present_switches,
    ratios,
    switched,
    time_pair,
    timer,
)
from benchmarks.gpu.record import Run

#: Seconds one setting may take (its compilations included).
SETTING_LIMIT_S = 60


def ceilings(run: Run) -> None:
    import torch

    if not torch.cuda.is_available():
        run.emit(kind="skipped", section="rowwise", what="measured ceilings", reason="needs a CUDA GPU")
        return
    n = 1 << 30  # 1 GiB of bf16: far above L2
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = timer(False, lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in "ab")
    mm_ms = timer(False, lambda: a @ b)
    run.emit(
        kind="ceiling", copy_gbps=round(2 * n / copy_ms / 1e6, 1), bf16_mm_tflops=round(2 * 8192**3 / mm_ms / 1e9, 1)
    )


def settings_of(switches) -> list[dict]:
    """As shipped, then each switch set to each of its other values."""
    return [{}, *({name: value} for _, name, values in present_switches(switches) for value in values[1:])]


def label_of(settings: dict, prefix: str = "multimax/triton") -> str:
    return prefix + "".join(f", {name}={value}" for name, value in settings.items())


def cross_entropy(run: Run) -> None:
    import torch
    import torch.nn.functional as F
    from bench_multimax import bent_multimax

    from mmlight.commands.doctor import relative_error

    device, dtype = placement()
    tokens, vocab = (8, 300) if run.smoke else (8192, 267744)
    gen = torch.Generator(device).manual_seed(0)
    logits = (3 * torch.randn(tokens, vocab, device=device, generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    module = bent_multimax("triton", device, ORDER)
    size = logits.numel() * logits.element_size()
    base = {"kind": "timing", "op": "cross_entropy", "shape": [tokens, vocab], "dtype": dtype_name(dtype)}
    base.update(bytes_fwd=size, bytes_bwd=2 * size)

    def both(loss, *leaves):
        torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])

    plain = run.attempt(
        "F.cross_entropy",
        SETTING_LIMIT_S,
        lambda: {
            "fwd_ms": timer(run.smoke, lambda: F.cross_entropy(logits, target, label_smoothing=0.1)),
            "fwd_bwd_ms": timer(run.smoke, lambda: both(F.cross_entropy(logits, target, label_smoothing=0.1), logits)),
        },
    )
    run.emit(**base, backend="torch.cross_entropy", **plain)
    rows = (logits[:64].detach().float().requires_grad_(), target[:64])  # the check: 64 rows against fp32
    reference = bent_multimax("reference", device, ORDER)
    want = outputs_and_grads(
        lambda t: reference.cross_entropy(t[0], rows[1], label_smoothing=0.1), [rows[0], reference.ranges, reference.ts]
    )

    def measure() -> dict:
        few = logits[:64].detach().requires_grad_()
        got = outputs_and_grads(
            lambda t: module.cross_entropy(t[0], rows[1], label_smoothing=0.1), [few, module.ranges, module.ts]
        )
        error = max(relative_error(g, w) for g, w in zip(got, want))
        ok = error <= TOLERANCE[base["dtype"]]
        fused = lambda: module.cross_entropy(logits, target, label_smoothing=0.1)  # noqa: E731
        timing = {"error_vs_fp32": error, "ok": ok}
        if ok:
            timing["fwd_ms"] = timer(
                run.smoke, lambda: module.cross_entropy(logits.detach(), target, label_smoothing=0.1)
            )
            timing["fwd_bwd_ms"] = timer(run.smoke, lambda: both(fused(), logits, module.ranges, module.ts))
            if plain.get("fwd_bwd_ms"):
                timing["fwd_bwd_ratio"] = round(timing["fwd_bwd_ms"] / plain["fwd_bwd_ms"], 3)
        return timing

    for settings in settings_of(CE_SWITCHES):
        with switched(settings):
            timing = run.attempt(label_of(settings), SETTING_LIMIT_S, measure)
        run.emit(**base, backend=label_of(settings), switches=settings, **timing)


def rowwise_shape(smoke: bool) -> tuple[int, ...]:
    return (1, 2, 19, 19) if smoke else (256, 6, 197, 197)


def rowwise_candidates(smoke: bool):
    from mmlight.kernels.tiles import BlockConfig

    pairs = [(4, 4)] if smoke else [(4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (32, 8)]
    return [BlockConfig(rows, 0, warps, 1) for rows, warps in pairs]


def shipped_rowwise(n: int, dtype):
    """The rows per program and warps the row-wise kernel launches for rows of ``n`` without an override."""
    import torch

    from mmlight.kernels import rowwise as rowwise_kernel
    from mmlight.kernels.tiles import BlockConfig

    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    cfg = rowwise_kernel._launch_config(n, dtype, 10 * major + minor)
    return BlockConfig(cfg["ROWS"], 0, cfg["num_warps"], 1)


def named_errors(got, want) -> dict[str, float]:
    """Relative error of the output and of each gradient (input, ``ranges``, ``ts``)."""
    from mmlight.commands.doctor import relative_error

    return {name: relative_error(g, w) for name, g, w in zip(("out", "x", "ranges", "ts"), got, want)}


def rowwise(run: Run) -> None:
    import torch
    from bench_multimax import bent_multimax

    from benchmarks.gpu.sweep import write_tile_rows
    from mmlight.kernels.tiles import override_tiles

    device, dtype = placement()
    shape = rowwise_shape(run.smoke)
    gen = torch.Generator(device).manual_seed(0)
    x = (3 * torch.randn(shape, device=device, generator=gen)).to(dtype).requires_grad_()
    module = bent_multimax("triton", device, ORDER)
    size = x.numel() * x.element_size()
    base = {"kind": "timing", "op": "rowwise", "shape": list(shape), "dtype": dtype_name(dtype)}
    base.update(bytes_fwd=2 * size, bytes_bwd=3 * size)
    exact = x.detach().float().requires_grad_()
    want = outputs_and_grads(lambda t: module.compute(t[0], None, "reference"), [exact, module.ranges, module.ts])
    # float64 beside the fp32 reference: where the kernel misses fp32, which of the two is off
    double = copy.deepcopy(module).double()
    exact64 = x.detach().double().requires_grad_()
    want64 = outputs_and_grads(lambda t: double.compute(t[0], None, "reference"), [exact64, double.ranges, double.ts])
    run.emit(kind="reference_error", op="rowwise", shape=list(shape), errors_vs_fp64=named_errors(want, want64))
    softmax = run.attempt(
        "torch.softmax", SETTING_LIMIT_S, lambda: time_pair(run.smoke, lambda: torch.softmax(x, -1), [x])
    )
    run.emit(**base, backend="torch.softmax", **softmax)
    leaves = [x, module.ranges, module.ts]

    def measure() -> dict:
        got = outputs_and_grads(lambda t: module.compute(t[0], None, "triton"), leaves)
        errors = named_errors(got, want)
        error = max(errors.values())
        ok = error <= TOLERANCE[base["dtype"]]
        # timed even when a check fails (it cannot be tuned from): the speed is an answer of its own
        timing = time_pair(run.smoke, lambda: module.compute(x, None, "triton"), leaves)
        return {
            "error_vs_fp32": error,
            "errors": errors,
            "errors_vs_fp64": named_errors(got, want64),
            "ok": ok,
            **timing,
        }

    best = None
    for settings, cfg in itertools.product(settings_of(ROWWISE_SWITCHES), [None, *rowwise_candidates(run.smoke)]):
        tiles = f"rows={cfg.block_m} warps={cfg.num_warps}" if cfg else "shipped"
        label = label_of(settings, f"multimax/triton {tiles}")
        with override_tiles(**({"rowwise": cfg} if cfg else {})), switched(settings):
            timing = run.attempt(label, SETTING_LIMIT_S, measure)
        run.emit(**base, backend=label, switches=settings, **timing, **ratios(timing, softmax))
        if timing.get("ok") and (best is None or timing["fwd_ms"] + timing["bwd_ms"] < best[0]):
            # the shipped choice competes too, as the config the kernel launches without an override
            best = (timing["fwd_ms"] + timing["bwd_ms"], cfg or shipped_rowwise(shape[-1], dtype), settings)
    if best:
        run.state.setdefault("tuned", {})["rowwise"] = {"rowwise": best[1]}
        run.emit(
            kind="tuned",
            shape_name="rowwise",
            shape=list(shape),
            configs={"rowwise": asdict(best[1])},
            switches=best[2],
        )
        write_tile_rows(run)


def section(run: Run) -> None:
    ceilings(run)
    cross_entropy(run)
    rowwise(run)
