"""MultiMax backends side by side: row-wise op, cross-entropy, attention, a DeiT-small training step.

Runs on a GPU and appends one JSON record per (op, backend, shape) to
``benchmarks/results/multimax-<device>-<versions>-<date>-<time>.jsonl``; ``benchmarks/report.py``
turns records into the table in BENCHMARKS.md. Every record holds ``device, torch, triton, op, backend,
shape, dtype, fwd_ms, bwd_ms, gbps, peak_mem_mb`` plus ``frac_peak_bw`` (bandwidth as a fraction of the
device's HBM peak) and, where a baseline ran in the same invocation, ``fwd_ratio``/``bwd_ratio``/``step_ratio`` (time
over the baseline's).

Bandwidth counts the minimum traffic of the op, not what a backend actually moves: forward reads
and writes the scores once (2 tensors), backward reads the scores and the upstream gradient and
writes the input gradient (3 tensors). A slower backend therefore shows a lower figure.

Usage::

    python benchmarks/bench_multimax.py                 # everything, at the issue's shapes
    python benchmarks/bench_multimax.py --only rowwise attention
    python benchmarks/bench_multimax.py --smoke         # tiny shapes; also runs on the CPU
                                                        # (TRITON_INTERPRET=1), to check the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from record_name import device_name, device_part, record_path  # beside this script, which Python puts on sys.path

from mmlight.models import ReweightedViT, ViTConfig
from mmlight.nn import attention
from mmlight.reweighting import MultiMax, ReweightingSpec, Softmax

#: HBM peak in GB/s by device-name fragment (vendor datasheets); override with --peak-gbps.
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0,
    "A100-PCIE": 1555.0,
    "L40S": 864.0,
    "A10G": 600.0,
}
BACKENDS = ["reference", "compile", "triton"]  # --backends narrows it


# ----------------------------------------------------------------------------- measurement


def peak_gbps(override: float | None) -> float | None:
    if override:
        return override
    name = device_name()
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def time_ms(fn: Callable[[], object], reps: int) -> float:
    """Median time of ``fn`` in milliseconds (Triton's do_bench on a GPU: warm-up, L2 flush)."""
    if torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=max(reps, 25), return_mode="median"))
    fn()  # warm-up (compilation)
    samples = []
    for _ in range(max(reps, 1)):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def peak_memory_mb(fn: Callable[[], object]) -> float | None:
    """Peak CUDA memory allocated during ``fn`` beyond what was allocated before it."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def fwd_bwd(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor], reps: int) -> dict:
    """Forward time, backward time and fw+bw peak memory.

    Backward is timed as (forward + backward) - forward rather than by re-running one retained
    graph, because a fused cross-entropy computes its gradient in the forward and scales it in
    place in the backward, which cannot run twice.
    """
    grad = torch.randn_like(forward())

    def both():
        for leaf in leaves:
            leaf.grad = None
        forward().backward(grad if grad.dim() else None)

    fwd = time_ms(forward, reps)
    return {"fwd_ms": fwd, "bwd_ms": max(time_ms(both, reps) - fwd, 0.0), "peak_mem_mb": peak_memory_mb(both)}


def guarded(measure: Callable[[], dict], also: type[Exception] | None = None) -> dict:
    """Run a measurement; an out-of-memory error (or one of type ``also``) becomes a record with
    ``error`` instead of a crash."""
    try:
        return measure()
    except torch.OutOfMemoryError as err:
        torch.cuda.empty_cache()
        return {"fwd_ms": None, "bwd_ms": None, "peak_mem_mb": None, "error": f"out of memory: {str(err)[:120]}"}
    except also or () as err:  # noqa: B030 (also: a tuple of exception classes, none by default)
        return {
            "fwd_ms": None,
            "bwd_ms": None,
            "peak_mem_mb": None,
            "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err).strip() else ''}",
        }


def bent_multimax(backend: str, device: torch.device, order: int = 2) -> MultiMax:
    """A MultiMax whose sigma actually bends (trained-like values, not the near-identity init)."""
    module = MultiMax(order=order, backend=backend).to(device)
    with torch.no_grad():
        module.ranges.copy_(torch.tensor([-0.5, 0.6, -1.0, 1.2][: 2 * order]))
        module.ts.copy_(torch.tensor([0.3, 0.25, 0.1, 0.05][: 2 * order]))
    return module


# ----------------------------------------------------------------------------- benchmarks


def bench_rowwise(shape, dtype, device, reps) -> list[dict]:
    """softmax (torch) as the bandwidth baseline, then MultiMax on every backend."""
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    candidates = {
        "torch.softmax": lambda: torch.softmax(x, dim=-1),
        "softmax/triton": (lambda s: lambda: s(x))(Softmax(backend="triton")),
    }
    for backend in BACKENDS:
        candidates[f"multimax/{backend}"] = (lambda m: lambda: m(x))(bent_multimax(backend, device))
    nbytes = x.numel() * x.element_size()
    return [
        dict(
            op="rowwise",
            backend=name,
            bytes_fwd=2 * nbytes,
            bytes_bwd=3 * nbytes,
            **guarded(lambda: fwd_bwd(fn, [x], reps)),
        )
        for name, fn in candidates.items()
    ]


def bench_cross_entropy(shape, dtype, device, reps) -> list[dict]:
    """Plain cross-entropy (torch) as the baseline, then MultiMax cross-entropy on every backend."""
    tokens, vocab = shape
    logits = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,), device=device)
    candidates = {"torch.cross_entropy": lambda: F.cross_entropy(logits, target, label_smoothing=0.1)}
    for backend in BACKENDS:
        candidates[f"multimax/{backend}"] = (lambda m: lambda: m.cross_entropy(logits, target, label_smoothing=0.1))(
            bent_multimax(backend, device)
        )
    nbytes = logits.numel() * logits.element_size()
    # Minimum traffic: read the logits (fw), read them again and write the gradient (bw).
    return [
        dict(
            op="cross_entropy",
            backend=name,
            bytes_fwd=nbytes,
            bytes_bwd=2 * nbytes,
            **guarded(lambda: fwd_bwd(fn, [logits], reps)),
        )
        for name, fn in candidates.items()
    ]


def bench_attention(shape, causal, dtype, device, reps) -> list[dict]:
    """PyTorch SDPA (flash backend on a GPU) as the baseline, then MultiMax attention: compiled
    FlexAttention with MultiMax as its ``score_mod`` (on a GPU; the peer to beat), and per backend."""
    batch, heads, n, head_dim = shape
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def sdpa():
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    candidates = {"sdpa": sdpa}
    if device.type == "cuda":  # compiled FlexAttention needs a GPU for training
        candidates["multimax/flex"] = flex_candidate(q, k, v, causal, bent_multimax("reference", device))
    for backend in BACKENDS:
        candidates[f"multimax/{backend}"] = (lambda m: lambda: attention(q, k, v, m, is_causal=causal))(
            bent_multimax(backend, device)
        )
    flops = 4 * batch * heads * n * n * head_dim * (0.5 if causal else 1.0)  # two matmuls, fw
    # FlexAttention is a peer we do not maintain: any failure of it is recorded, not raised
    return [
        dict(
            op="attention_causal" if causal else "attention",
            backend=name,
            flops_fwd=flops,
            **guarded(lambda: fwd_bwd(fn, [q, k, v], reps), Exception if name == "multimax/flex" else None),
        )
        for name, fn in candidates.items()
    ]


def flex_candidate(q, k, v, causal: bool, module: MultiMax) -> Callable[[], torch.Tensor]:
    """Compiled FlexAttention with MultiMax as its ``score_mod`` (learnable captured parameters)."""
    from flex_multimax import causal_block_mask, flex_multimax_attention  # beside this script
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention)
    n = q.shape[2]
    block_mask = causal_block_mask(n, n, q.device, compile_mask=True) if causal else None
    return lambda: flex_multimax_attention(q, k, v, module.ranges, module.ts, block_mask=block_mask, flex=flex)


def bench_deit_step(batch, dtype, device, reps, variant="deit_small", img_size=224) -> list[dict]:
    """One AdamW training step of DeiT-small under autocast: softmax/SDPA, then MultiMax (attention
    and output) on every backend."""
    images = torch.randn(batch, 3, img_size, img_size, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    configs = {"softmax/sdpa": ViTConfig(variant=variant, img_size=img_size)}
    for backend in BACKENDS:
        configs[f"multimax/{backend}"] = ViTConfig(
            variant=variant,
            img_size=img_size,
            backend=backend,
            attention=ReweightingSpec("multimax", {"order": 2}),
            output_multimax=True,
        )
    records = []
    for name, config in configs.items():

        def measure(config=config):
            model = ReweightedViT(config).to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

            def step():
                with torch.autocast(device.type, dtype=dtype):
                    loss = model.loss(images, labels, label_smoothing=0.1)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            return {"step_ms": time_ms(step, reps), "peak_mem_mb": peak_memory_mb(step)}

        records.append(dict(op=f"{variant}_train_step", backend=name, **guarded(measure)))
    return records


# ----------------------------------------------------------------------------- records


def add_ratios(records: list[dict], baseline: str) -> None:
    """Time of each record over the baseline's (same op and shape), when both exist."""
    base = next((r for r in records if r["backend"] == baseline), None)
    if base is None:
        return
    for r in records:
        for key in ("fwd_ms", "bwd_ms", "step_ms"):
            if r.get(key) and base.get(key):
                r[key.replace("_ms", "_ratio")] = round(r[key] / base[key], 3)


def finish(records: list[dict], shape, dtype, peak: float | None, versions: dict) -> list[dict]:
    out = []
    for r in records:
        r = {**versions, "shape": list(shape), "dtype": str(dtype).replace("torch.", ""), **r}
        gbps = None
        if r.get("bytes_fwd"):  # GB/s = bytes / ms / 1e6; None where a time is missing or 0 (noise)
            gbps = {p: r[f"bytes_{p}"] / r[f"{p}_ms"] / 1e6 if r.get(f"{p}_ms") else None for p in ("fwd", "bwd")}
        r["gbps"] = {k: v and round(v, 1) for k, v in gbps.items()} if gbps else None
        r["frac_peak_bw"] = {k: v and round(v / peak, 3) for k, v in gbps.items()} if gbps and peak else None
        if r.get("flops_fwd") and r.get("fwd_ms"):
            r["tflops_fwd"] = round(r["flops_fwd"] / r["fwd_ms"] / 1e9, 1)
        r.setdefault("bwd_ms", None)
        r.setdefault("fwd_ms", None)
        r.setdefault("gbps", None)
        out.append(r)
    return out


def plan(smoke: bool) -> dict[str, list[tuple]]:
    """The shapes: the issue's on a GPU, tiny ones for ``--smoke``."""
    if smoke:
        return {
            "rowwise": [((2, 2, 19, 19), torch.float32)],
            "cross_entropy": [((8, 300), torch.float32)],
            "attention": [((1, 2, 19, 32), False, torch.float32), ((1, 2, 24, 32), True, torch.float32)],
            "deit_step": [(2, torch.bfloat16, "vit_micro", 16)],
        }
    return {
        "rowwise": [
            ((256, 6, 197, 197), torch.bfloat16),
            ((256, 6, 197, 197), torch.float32),
            ((8192, 267744), torch.bfloat16),
        ],
        "cross_entropy": [((8192, 267744), torch.bfloat16)],
        "attention": [
            ((256, 6, 197, 64), False, torch.bfloat16),
            ((32, 12, 1024, 64), True, torch.bfloat16),
            ((8, 12, 4096, 64), True, torch.bfloat16),
            ((2, 12, 16384, 64), True, torch.bfloat16),
        ],
        "deit_step": [(256, torch.bfloat16, "deit_small", 224)],
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=["rowwise", "cross_entropy", "attention", "deit_step"])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU-capable) to check the script")
    parser.add_argument("--backends", nargs="*", choices=list(BACKENDS), help="MultiMax backends to run (all)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--peak-gbps", type=float, default=None, help="HBM peak when the device is not in the table")
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file (default under benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.backends:
        BACKENDS[:] = args.backends
    if not torch.cuda.is_available() and not args.smoke:
        parser.error("the benchmarks need a CUDA GPU; use --smoke (with TRITON_INTERPRET=1) to check the script")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    versions = {"device": device_name(), "torch": torch.__version__, "triton": triton.__version__}
    peak = peak_gbps(args.peak_gbps)
    out = args.out or record_path(
        "multimax_smoke" if args.smoke else "multimax",
        device_part(versions["device"]),
        [("torch", versions["torch"]), ("triton", versions["triton"])],
        "jsonl",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    reps = 1 if args.smoke else args.reps  # --smoke: one timed call after the warm-up (fields, not figures)
    todo = plan(args.smoke)
    with out.open("a") as sink:

        def emit(records, shape, dtype, baseline):
            add_ratios(records, baseline)
            for r in finish(records, shape, dtype, peak, versions):
                sink.write(json.dumps(r) + "\n")
                sink.flush()
                print(
                    json.dumps(
                        {
                            k: r.get(k)
                            for k in (
                                "op",
                                "backend",
                                "shape",
                                "fwd_ms",
                                "bwd_ms",
                                "step_ms",
                                "gbps",
                                "peak_mem_mb",
                                "error",
                            )
                            if r.get(k) is not None
                        }
                    )
                )

        for name in args.only or list(todo):
            for case in todo[name]:
                if name == "rowwise":
                    shape, dtype = case
                    emit(bench_rowwise(shape, dtype, device, reps), shape, dtype, "torch.softmax")
                elif name == "cross_entropy":
                    shape, dtype = case
                    emit(bench_cross_entropy(shape, dtype, device, reps), shape, dtype, "torch.cross_entropy")
                elif name == "attention":
                    shape, causal, dtype = case
                    emit(bench_attention(shape, causal, dtype, device, reps), shape, dtype, "sdpa")
                else:
                    batch, dtype, variant, img = case
                    emit(
                        bench_deit_step(batch, dtype, device, reps, variant, img),
                        (batch, 3, img, img),
                        dtype,
                        "softmax/sdpa",
                    )
    print(f"wrote {out}", file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
