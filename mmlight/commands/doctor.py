"""``mmlight doctor``: the first command to run on a new GPU machine.

It prints the device, CUDA, torch, Triton and the compute capability, then runs every MultiMax
kernel on the backends ``triton`` (the fused kernels), ``reference`` (eager PyTorch) and
``compile`` (``torch.compile`` of the reference) at representative shapes:

* row-wise MultiMax over DeiT-small attention scores (6 heads x 197 x 197);
* fused attention at DeiT-small's shape (6 heads of 64 over 197 tokens);
* fused causal attention at N = 1,024 (8 heads of 64);
* MultiMax cross-entropy over an LM vocabulary row (267,744 words).

Each kernel's output and gradients (inputs and the 8 MultiMax parameters) are compared with the
reference computed in fp32 from the same bf16 inputs, and each backend's forward + backward is
timed (median of ``triton.testing.do_bench``). One table, then a verdict: whether ``backend: auto``
will use the kernels on this machine, and which kernels the ``compile`` backend beats there. Exit
status 1 if a kernel fails, or on a GPU if the ``reference`` or ``compile`` backend fails to run.

Without a CUDA GPU it says so, and checks what it can: the same four computations at tiny shapes
in fp32 under Triton's CPU interpreter (in a fresh process with ``TRITON_INTERPRET=1``), without
timings. That shows the installation works, not that a GPU will; the
offline compile check of the kernels for sm_80/sm_90 is ``python benchmarks/compile_report.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKENDS = ("triton", "reference", "compile")
#: Tolerance of the fp32 interpreter checks (the kernels agree with eager fp32 to ~1e-6 there).
FP32_TOLERANCE = 1e-4
# MultiMax parameters that bend sigma visibly (the 0.02-std init is almost the identity).
RANGES = (-0.5, 0.5, -1.0, 1.0)
TS = (0.3, 0.2, 0.1, 0.05)


@dataclass
class Check:
    """One computation checked on every backend.

    Args:
        name: what it is, for the table.
        gpu_shape: input shape on a GPU (bf16).
        cpu_shape: input shape under the interpreter (fp32).
        make: ``make(shape, dtype, device, generator) -> inputs`` (tensors, first ones require grad).
        run: ``run(module, inputs, backend) -> output`` through mmlight's own dispatch.
        tolerance: largest error allowed in bf16 on a GPU, relative to the reference's largest
            magnitude (fp32 under the interpreter: :data:`FP32_TOLERANCE`).
    """

    name: str
    gpu_shape: tuple
    cpu_shape: tuple
    make: Callable
    run: Callable
    tolerance: float


def _scores(shape, dtype, device, gen):
    return [(3 * torch.randn(shape, generator=gen, device=device)).to(dtype).requires_grad_()]


def _qkv(shape, dtype, device, gen):
    return [torch.randn(shape, generator=gen, device=device).to(dtype).requires_grad_() for _ in "qkv"]


def _logits(shape, dtype, device, gen):
    logits = (3 * torch.randn(shape, generator=gen, device=device)).to(dtype).requires_grad_()
    return [logits, torch.randint(0, shape[-1], shape[:1], generator=gen, device=device)]


def _rowwise(module, inputs, backend):
    return module.compute(inputs[0], None, backend)


def _attention(causal: bool):
    def run(module, inputs, backend):
        from mmlight.nn.attention import attention

        return attention(*inputs, module, is_causal=causal, backend=backend)

    return run


def _cross_entropy(module, inputs, backend):
    module.backend = backend
    return module.cross_entropy(*inputs)


CHECKS = [
    Check("row-wise MultiMax (DeiT-small scores)", (64, 6, 197, 197), (2, 2, 13, 13), _scores, _rowwise, 2e-2),
    Check("attention (DeiT-small)", (64, 6, 197, 64), (1, 2, 19, 16), _qkv, _attention(False), 3e-2),
    Check("causal attention N=1024", (8, 8, 1024, 64), (1, 2, 37, 16), _qkv, _attention(True), 3e-2),
    Check("cross-entropy (LM vocabulary)", (64, 267744), (3, 300), _logits, _cross_entropy, 2e-2),
]


def environment() -> list[tuple[str, str]]:
    """``(name, value)`` lines about this machine."""
    import triton

    from mmlight.data.image_decode import pillow_build

    lines = [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("triton", triton.__version__),
        ("CUDA (torch built with)", str(torch.version.cuda)),
        ("image decode and resize", pillow_build()),
    ]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        props = torch.cuda.get_device_properties(0)
        lines += [
            ("device", f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible)"),
            ("compute capability", f"{major}.{minor} (sm_{major}{minor})"),
            ("memory", f"{props.total_memory / 2**30:.0f} GiB"),
        ]
    else:
        lines.append(("device", "no CUDA GPU (torch.cuda.is_available() is False)"))
    return lines


def _multimax(device):
    from mmlight.reweighting import MultiMax

    module = MultiMax(order=2).to(device)
    with torch.no_grad():
        module.ranges.copy_(torch.tensor(RANGES))
        module.ts.copy_(torch.tensor(TS))
    return module


def _forward_backward(check: Check, module, inputs, backend):
    """Output and the gradients of its inner product with a fixed upstream gradient."""
    out = check.run(module, inputs, backend)
    upstream = (
        torch.ones_like(out)
        if out.dim() == 0
        else torch.cos(torch.arange(out.numel(), device=out.device)).reshape(out.shape)
    )
    leaves = [t for t in inputs if t.requires_grad] + [module.ranges, module.ts]
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype))
    return [out.detach(), *grads]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute error over the largest magnitude of ``expected`` (NaN-aware)."""
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def placement(on_gpu: bool) -> tuple[str, torch.dtype]:
    """Where and in which precision the checks run: bf16 on the GPU, fp32 under the interpreter."""
    return ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)


def run_check(check: Check, on_gpu: bool, timed: bool = True) -> dict:
    """Errors of the kernel against the reference, and milliseconds per backend (GPU only; ``timed=False``:
    the check alone, as ``benchmarks/gpu_run.py`` runs it without the ``compile`` backend's compilations)."""
    device, dtype = placement(on_gpu)
    shape = check.gpu_shape if on_gpu else check.cpu_shape
    gen = torch.Generator(device).manual_seed(0)
    inputs = check.make(shape, dtype, device, gen)
    module = _multimax(device)
    row = {
        "check": check.name,
        "shape": "x".join(map(str, shape)),
        "dtype": str(dtype).replace("torch.", ""),
        "tolerance": check.tolerance if on_gpu else FP32_TOLERANCE,
    }
    try:
        # the reference on fp32 copies of the same (bf16) values: what the kernels aim to compute
        exact = [t.detach().float().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
        want = _forward_backward(check, module, exact, "reference")
        got = _forward_backward(check, module, inputs, "triton")
        row["error"] = max(relative_error(g, w) for g, w in zip(got, want))
        row["ok"] = row["error"] <= row["tolerance"]
    except Exception as error:  # a kernel that cannot run is the finding this tool exists for
        row["error"], row["ok"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}", False
    if on_gpu and timed:
        row["ms"] = {backend: _time(check, module, inputs, backend) for backend in BACKENDS}
        # a backend that cannot run (``compile``: the fallback of ``auto``) fails the check as a kernel does
        row["ok"] = row["ok"] and not failed_backends(row)
    return row


def failed_backends(row: dict) -> list[str]:
    """``backend: error`` of each backend besides the kernel's own (``triton``, whose error is the row's)
    that raised when timed: its time is the error's name."""
    return [f"{b}: {t}" for b, t in row.get("ms", {}).items() if b != "triton" and isinstance(t, str)]


def _time(check: Check, module, inputs, backend) -> float | str:
    """Median milliseconds of one forward + backward, or the error's name."""
    from triton.testing import do_bench

    try:
        _forward_backward(check, module, inputs, backend)  # compile and warm up outside the timing
        return do_bench(lambda: _forward_backward(check, module, inputs, backend), warmup=5, rep=30)
    except Exception as error:
        return type(error).__name__


def render(rows: list[dict], on_gpu: bool) -> str:
    head = (
        "| check | shape | dtype | max error (tolerance) | "
        + (" | ".join(f"{b} ms" for b in BACKENDS) + " | " if on_gpu else "")
        + "verdict |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        error = r["error"] if isinstance(r["error"], str) else f"{r['error']:.2g} ({r['tolerance']:.0e})"
        times = (
            " | ".join(f"{t:.3g}" if isinstance(t, float) else t for t in r["ms"].values()) + " | " if on_gpu else ""
        )
        lines.append(f"| {r['check']} | {r['shape']} | {r['dtype']} | {error} | {times}{'ok' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines)


def slower_than_compile(rows: list[dict]) -> list[str]:
    """The checks (timed, on a GPU) whose fused kernel took longer than the ``compile`` backend (forward
    + backward), each with both times; a check whose backend failed (its time an error's name) is left out."""
    slower = []
    for r in rows:
        triton_ms, compile_ms = r["ms"]["triton"], r["ms"]["compile"]
        if isinstance(triton_ms, float) and isinstance(compile_ms, float) and triton_ms > compile_ms:
            slower.append(f"{r['check']} ({triton_ms:.3g} ms against {compile_ms:.3g} ms)")
    return slower


def verdict(rows: list[dict], on_gpu: bool) -> str:
    failed = [" ".join([r["check"], *(f"({b})" for b in failed_backends(r))]) for r in rows if not r["ok"]]
    if on_gpu and not failed:
        slower = slower_than_compile(rows)
        if not slower:
            return (
                "VERDICT: every kernel matches the reference and none is slower than 'compile' here; backend 'auto' "
                "will use the Triton kernels here."
            )
        return (
            "VERDICT: every kernel matches the reference; backend 'auto' will use the Triton kernels here, but "
            f"'compile' is faster for {'; '.join(slower)}. Where a model runs those kernels, "
            "--model.init_args.model.backend compile is the faster choice on this device."
        )
    if on_gpu:
        return (
            f"VERDICT: FAIL for {', '.join(failed)}. Backend 'auto' falls back to 'compile' for a kernel "
            "that fails to compile or launch (with a warning); a wrong result is a bug: please report "
            "this output."
        )
    if failed:
        return f"VERDICT: no GPU, and the interpreter check FAILED for {', '.join(failed)}: the installation is broken."
    return (
        "VERDICT: no GPU here. The kernels are correct under Triton's CPU interpreter (tiny fp32 shapes); "
        "backend 'auto' uses the reference code on this machine. Run `mmlight doctor` again on the GPU "
        "machine; `python benchmarks/compile_report.py --matrix shipped` compiles the kernels for sm_80/sm_90 "
        "without one."
    )


def main(argv: list[str] | None = None) -> None:
    """Print the environment, the table and the verdict; exit with status 1 if a kernel fails."""
    parser = argparse.ArgumentParser(prog="mmlight doctor", description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter must be on before any Triton kernel is defined, and the ``mmlight`` command
        # has imported Triton and Lightning by now: check in a fresh process.
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        raise SystemExit(
            subprocess.run([sys.executable, "-m", "mmlight.commands.doctor", *(argv or [])], env=env).returncode
        )
    for name, value in environment():
        print(f"{name:>24}: {value}")
    if not on_gpu:
        print("\nNo CUDA GPU: checking the kernels under Triton's CPU interpreter at tiny shapes, no timings.")
    print()
    rows = [run_check(check, on_gpu) for check in CHECKS]
    print(render(rows, on_gpu))
    print()
    print(verdict(rows, on_gpu))
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
