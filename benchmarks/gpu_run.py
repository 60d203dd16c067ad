"""One prepared GPU run of the MultiMax kernels: check, sweep, time and profile in one call.

Made for a short lease of one H100/H200 (at most 8 minutes with the default ``--budget``). In order,
each section skipped (and recorded as skipped) when the time left is below its estimate:

1. ``env``: versions, ``nvidia-smi`` clocks, power and temperature (read, never changed), and the
   two ceilings measured on this device: device-to-device copy bandwidth and a bf16 matrix product.
2. ``sweep``: every candidate tile config of the attention kernels (forward, dK/dV, dQ) and every
   kernel switch, checked against the fp32 reference (output and all gradients, as
   ``mmlight doctor`` checks: largest error over the reference's largest magnitude) in a pool of
   processes; failures are dropped, the rest timed at the DeiT-small shape and at causal 1,024 and
   4,096. The best of each kernel is "tuned"; its rows for :data:`mmlight.kernels.tiles.MEASURED`
   go to ``tile_rows.py``.
3. ``attention``: SDPA (flash, cuDNN, memory-efficient) against the fused kernel as shipped and
   tuned, with the sigma-parameter gradients on and off, and the kernel's plain softmax (order 0).
4. ``step``: the DeiT-small training step (bf16 autocast, batch 256, fused AdamW) for softmax (SDPA
   flash and cuDNN), MultiMax as shipped, MultiMax tuned, MultiMax attention with plain
   cross-entropy, softmax attention with the MultiMax output, eager.
5. ``profile``: ``torch.profiler`` tables of the top kernels of the softmax and tuned steps.
6. ``rowwise`` and ``cross_entropy``: the row-wise kernel (with a rows-per-program sweep) against
   ``torch.softmax``, and the fused cross-entropy against ``F.cross_entropy``.
7. ``compiled``: timm's ``deit_small_patch16_224`` compiled (the peer), then the step variants with
   ``torch.compile`` of the model's forward.
8. ``fit``: ``mmlight fit`` of ``configs/deit_small_multimax.yaml``, then (if the budget allows)
   ``deit_small_softmax.yaml``, on one device with ``compile: true``, 300 steps at the step's batch,
   no validation and no checkpoint, reading synthetic ImageNet-format shards (``fit_shards.py``)
   through the real loader with the config's workers. The images/s the Throughput callback logs to
   TensorBoard, averaged past the warm-up, are set beside the step's of the same variant: the
   difference is the data pipeline and Lightning's overhead. Each fit's output ends in ``fit.log``.
   It needs what ``mmlight fit`` imports (webdataset, jsonargparse, tensorboard); a missing package
   is recorded as the section's error before any shard is written.

Every record is one JSON line, flushed as soon as it exists, in
``<out>/gpu_run-<device>-torch<v>_triton<v>-<YYYYMMDD>-<HHMM>.jsonl``, so a run cut off still
returns what it measured; ``benchmarks/report.py`` renders the file. ``--smoke`` runs the same code at tiny shapes on
the CPU (Triton's interpreter; fp32), recording what needs CUDA as skipped with the reason; its fits
train the micro ViT at 16 px for 20 steps, uncompiled, with one loader worker.

    python benchmarks/gpu_run.py --out "$OUT"        # on the GPU
    python benchmarks/gpu_run.py --smoke --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# --smoke runs on the CPU: the interpreter must be on before Triton kernels are defined
if "--smoke" in sys.argv[1:] and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_multimax import PEAK_GBPS, bent_multimax, device_name, time_ms  # noqa: E402 (beside this script)
from record_name import device_part, record_path  # noqa: E402

from mmlight.commands.doctor import relative_error  # noqa: E402
from mmlight.kernels import attention as attention_kernel  # noqa: E402
from mmlight.kernels import cross_entropy as cross_entropy_kernel  # noqa: E402
from mmlight.kernels import rowwise as rowwise_kernel  # noqa: E402
from mmlight.kernels.tiles import DTYPE_NAMES, BlockConfig, override_tiles, seq_bucket  # noqa: E402

#: Largest error of a bf16 kernel against the fp32 reference, relative to the reference's largest
#: magnitude (``mmlight doctor``'s tolerances); fp32 under the interpreter: 1e-4.
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}
ORDER = 2
#: The repository's root: the fit section runs its configs from there.
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- what is measured


@dataclass(frozen=True)
class AttentionShape:
    """One attention problem of the sweep and the timings.

    Args:
        name: label of the records.
        shape: ``(B, H, N, D)`` timed.
        check_batch: B of the correctness check (same H, N and D, so the same specialisation).
        causal: causal mask.
    """

    name: str
    shape: tuple[int, int, int, int]
    check_batch: int
    causal: bool


def attention_shapes(smoke: bool) -> list[AttentionShape]:
    """DeiT-small and causal 1,024 / 4,096 on a GPU; two tiny problems under ``--smoke``."""
    if smoke:
        return [AttentionShape("deit", (1, 2, 19, 16), 1, False), AttentionShape("causal", (1, 2, 21, 16), 1, True)]
    return [
        AttentionShape("deit", (256, 6, 197, 64), 2, False),
        AttentionShape("causal_1k", (32, 12, 1024, 64), 2, True),
        AttentionShape("causal_4k", (8, 12, 4096, 64), 2, True),
    ]


def candidates(smoke: bool) -> dict[str, list[BlockConfig]]:
    """The small tile space of each attention kernel (``--smoke``: two per kernel)."""
    if smoke:
        return {
            "forward": [BlockConfig(32, 16, 4, 1)],
            "dkdv": [BlockConfig(16, 32, 4, 1)],
            "dq": [BlockConfig(16, 16, 4, 1)],
        }
    product = itertools.product
    return {
        # queries x keys per tile; the loop walks keys
        "forward": [BlockConfig(m, n, w, s) for m, n, w, s in product((64, 128), (32, 64, 128), (4, 8), (2, 3))],
        # queries per step x resident keys
        "dkdv": [BlockConfig(m, n, w, s) for m, n, w, s in product((16, 32, 64), (64, 128), (4, 8), (1, 2))],
        # resident queries x keys per step
        "dq": [BlockConfig(m, n, w, s) for m, n, w, s in product((64, 128), (32, 64), (4, 8), (2,))],
    }


#: Kernel switches the sweep compares: ``(module, attribute, values)``; only those the code has.
SWITCHES = [
    (attention_kernel, "PARAM_SUMS_PER_PROGRAM", (False, True)),
    (attention_kernel, "MASK_FREE_INTERIOR", (False, True)),
    (attention_kernel, "OUTPUT_IN_CALLER_LAYOUT", (False, True)),
    (attention_kernel, "SINGLE_PASS_BACKWARD", (False, True)),
]


#: The cross-entropy's and the row-wise kernel's switches, compared in their own sections.
CE_SWITCHES = [(cross_entropy_kernel, "GRADIENT_IN_BACKWARD", (False, True))]
ROWWISE_SWITCHES = [(rowwise_kernel, "PERSISTENT_ROWS", (False, True))]


def present_switches(switches=SWITCHES) -> list[tuple[object, str, tuple]]:
    return [s for s in switches if hasattr(s[0], s[1])]


@contextlib.contextmanager
def switched(settings: dict[str, object]) -> Iterator[None]:
    """Set kernel switches (by attribute name) for the block."""
    modules = {name: module for module, name, _ in present_switches(SWITCHES + CE_SWITCHES + ROWWISE_SWITCHES)}
    old = {name: getattr(modules[name], name) for name in settings}
    for name, value in settings.items():
        setattr(modules[name], name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(modules[name], name, value)


# ----------------------------------------------------------------------------- the run's plumbing


class Run:
    """The output file, the time budget and the versions every record carries."""

    def __init__(self, out_dir: Path, budget_s: float, smoke: bool):
        import triton

        self.start = time.monotonic()
        self.budget_s = budget_s
        self.smoke = smoke
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.versions = {"device": device_name(), "torch": torch.__version__, "triton": triton.__version__}
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self.path = out_dir / record_file_name(self.versions, smoke)
        self.sink = self.path.open("a")
        self.tuned: dict[str, dict[str, BlockConfig]] = {}  # shape name -> kernel -> best config
        self.tuned_switches: dict[str, object] = {}
        self.steps: dict[tuple[str, bool], dict] = {}  # (backend, compiled) -> the step record, for the fit

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def emit(self, **record) -> dict:
        record = {**self.versions, "elapsed_s": round(time.monotonic() - self.start, 1), **record}
        self.sink.write(json.dumps(record, default=str) + "\n")
        self.sink.flush()
        if record.get("kind") == "step":
            self.steps[record["backend"], bool(record["compiled"])] = record
        brief = {k: v for k, v in record.items() if k not in self.versions and k != "table" and v is not None}
        print(json.dumps(brief, default=str)[:300], flush=True)
        return record

    def section(self, name: str, estimate_s: float, body: Callable[[], None]) -> None:
        """Run ``body`` if the budget allows, else record the skip; an error is recorded, not raised."""
        if self.left() < estimate_s:
            self.emit(
                kind="skipped", section=name, reason=f"time budget: {self.left():.0f} s left, ~{estimate_s} s needed"
            )
            return
        began = time.monotonic()
        try:
            body()
        except Exception as error:  # a failing section must not cost the others
            self.emit(kind="error", section=name, error=f"{type(error).__name__}: {first_line(error)}")
        self.emit(kind="section", section=name, seconds=round(time.monotonic() - began, 1))

    def needs_cuda(self, section: str, what: str) -> bool:
        """False (and a skipped record) on the CPU."""
        if self.cuda:
            return True
        self.emit(kind="skipped", section=section, what=what, reason="needs a CUDA GPU (--smoke on the CPU)")
        return False


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else ""


def record_file_name(versions: dict, smoke: bool) -> str:
    """``gpu_run-<device>-torch<major.minor>_triton<major.minor>-<YYYYMMDD>-<HHMM or smoke>.jsonl``, the
    results' naming pattern (``record_name.py``)."""
    part = [("torch", versions["torch"]), ("triton", versions["triton"])]
    return record_path("gpu_run", device_part(versions["device"]), part, "jsonl", tag="smoke" if smoke else None).name


def timer(run: Run, fn: Callable[[], object], reps: int = 50) -> float:
    """Median milliseconds (``do_bench`` on a GPU); under ``--smoke`` one host-timed call."""
    if run.smoke:
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3
    return time_ms(fn, reps)


# ----------------------------------------------------------------------------- 1. environment


def nvidia_smi() -> dict | None:
    """Clocks, power, temperature and driver as ``nvidia-smi`` reads them (None without it)."""
    fields = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.draw,power.limit,temperature.gpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(zip(fields.split(","), (v.strip() for v in out.splitlines()[0].split(",")))) if out else None


def section_env(run: Run) -> None:
    import platform

    run.emit(
        kind="env",
        python=platform.python_version(),
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if run.cuda else None,
        capability=list(torch.cuda.get_device_capability()) if run.cuda else None,
        sms=torch.cuda.get_device_properties(0).multi_processor_count if run.cuda else None,
        nvidia_smi=nvidia_smi(),
        peak_gbps_datasheet=next((v for k, v in PEAK_GBPS.items() if k in run.versions["device"]), None),
    )
    if not run.needs_cuda("env", "measured ceilings"):
        return
    n = 1 << 30  # 1 GiB of bf16: far above L2
    src = torch.randn(n // 2, device=run.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = timer(run, lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, device=run.device, dtype=torch.bfloat16) for _ in "ab")
    mm_ms = timer(run, lambda: a @ b)
    run.emit(
        kind="ceiling",
        copy_gbps=round(2 * n / copy_ms / 1e6, 1),  # bytes read + written
        bf16_mm_tflops=round(2 * 8192**3 / mm_ms / 1e9, 1),
    )


# ----------------------------------------------------------------------------- 2. sweep


def attention_inputs(shape, dtype, device, seed=0, param_grads=True):
    """``(q, k, v, ranges, ts)``: random q, k, v and bent MultiMax parameters, all leaves."""
    gen = torch.Generator(device).manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen, device=device).to(dtype).requires_grad_() for _ in "qkv")
    module = bent_multimax("triton", device, ORDER)
    module.ranges.requires_grad_(param_grads)
    module.ts.requires_grad_(param_grads)
    return q, k, v, module.ranges, module.ts


def fused(inputs, causal):
    q, k, v, ranges, ts = inputs
    return attention_kernel.multimax_attention(q, k, v, ranges, ts, causal=causal)


def reference_attention(q, k, v, ranges, ts, causal):
    """Explicit fp32 attention with MultiMax on the scores (the eager definition)."""
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
    out = fn(inputs)
    upstream = torch.cos(torch.arange(out.numel(), device=out.device, dtype=torch.float32)).reshape(out.shape)
    leaves = [t for t in inputs if t.requires_grad]
    return [out.detach(), *torch.autograd.grad(out, leaves, upstream.to(out.dtype))]


_REFERENCES: dict[tuple, list[torch.Tensor]] = {}  # per process: the fp32 reference of each check shape


def check_config(shape: AttentionShape, kernel: str | None, cfg: BlockConfig | None, switches: dict) -> dict:
    """Error of the fused kernel with one kernel's config (or switch setting) against fp32.

    Runs in a worker process on a GPU (the first launch compiles into the shared Triton cache).
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    B, H, N, D = shape.shape
    check_shape = (shape.check_batch, H, N, D)
    inputs = attention_inputs(check_shape, dtype, device, seed=1)
    key = (check_shape, shape.causal)
    if key not in _REFERENCES:
        exact = [t.detach().float().requires_grad_() for t in inputs]
        _REFERENCES[key] = outputs_and_grads(lambda t: reference_attention(*t, shape.causal), exact)
    try:
        with override_tiles(**({kernel: cfg} if cfg else {})), switched(switches):
            got = outputs_and_grads(lambda t: fused(t, shape.causal), inputs)
        error = max(relative_error(g, w) for g, w in zip(got, _REFERENCES[key]))
        return {"error": error, "ok": error <= TOLERANCE[str(dtype).replace("torch.", "")]}
    except Exception as failure:  # out of resources, a compile error: the config is dropped
        return {"error": f"{type(failure).__name__}: {first_line(failure)}", "ok": False}


def _check_task(task) -> dict:
    return check_config(*task)


def time_fused(run: Run, shape: AttentionShape, param_grads: bool = True, phases=("fwd", "bwd")) -> dict:
    """Forward and/or backward milliseconds of the fused kernel at ``shape`` under the current configs."""
    inputs = attention_inputs(shape.shape, run.dtype, run.device, param_grads=param_grads)
    out = fused(inputs, shape.causal)
    upstream = torch.randn_like(out)
    leaves = [t for t in inputs if t.requires_grad]
    timing = {}
    if "fwd" in phases:
        timing["fwd_ms"] = timer(run, lambda: fused(inputs, shape.causal))
    if "bwd" in phases:
        timing["bwd_ms"] = timer(run, lambda: torch.autograd.grad(out, leaves, upstream, retain_graph=True))
    return timing


def sweep_tasks(run: Run) -> list[tuple]:
    """``(shape, kernel, config, switches)`` to check: every candidate of every kernel, every switch."""
    tasks = []
    for shape in attention_shapes(run.smoke):
        if shape.name == "causal_4k":  # same specialisation as causal_1k: checked there
            continue
        tasks.append((shape, None, None, {}))  # as shipped
        for kernel, configs in candidates(run.smoke).items():
            tasks += [(shape, kernel, cfg, {}) for cfg in configs]
        for _, name, values in present_switches():
            tasks += [(shape, None, None, {name: value}) for value in values]
    return tasks


def check_all(run: Run, tasks: list[tuple], jobs: int) -> list[dict]:
    """Check every task, in a pool of ``jobs`` processes on a GPU (they compile in parallel into
    the shared Triton cache, so the timings below load compiled kernels)."""
    if jobs <= 1:
        return [check_config(*task) for task in tasks]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_check_task, tasks))


def section_sweep(run: Run, jobs: int) -> None:
    tasks = sweep_tasks(run)
    checks = check_all(run, tasks, jobs)
    passed: dict[tuple[str, str | None], list] = {}
    for (shape, kernel, cfg, switches), result in zip(tasks, checks):
        run.emit(
            kind="check",
            shape_name=shape.name,
            kernel=kernel,
            config=asdict(cfg) if cfg else None,
            switches=switches,
            **result,
        )
        if result["ok"]:
            passed.setdefault((shape.name, kernel), []).append((cfg, switches))
    for shape in attention_shapes(run.smoke):
        checked = "causal_1k" if shape.name == "causal_4k" else shape.name
        if run.left() < 60:
            run.emit(kind="skipped", section="sweep", what=f"timings at {shape.name}", reason="time budget")
            continue
        shipped = time_fused(run, shape)
        run.emit(kind="sweep", shape_name=shape.name, shape=list(shape.shape), kernel=None, config=None, **shipped)
        # the shipped configs compete too: a kernel keeps its offline choice unless a candidate beats it
        offline = shipped_configs(run, shape)
        best = {kernel: (shipped["fwd_ms" if kernel == "forward" else "bwd_ms"], offline[kernel]) for kernel in offline}
        for kernel in ("forward", "dkdv", "dq"):
            phase = "fwd" if kernel == "forward" else "bwd"
            for cfg, _ in passed.get((checked, kernel), []):
                with override_tiles(**{kernel: cfg}):
                    timing = time_fused(run, shape, phases=(phase,))
                run.emit(
                    kind="sweep",
                    shape_name=shape.name,
                    shape=list(shape.shape),
                    kernel=kernel,
                    config=asdict(cfg),
                    **timing,
                )
                if kernel not in best or timing[f"{phase}_ms"] < best[kernel][0]:
                    best[kernel] = (timing[f"{phase}_ms"], cfg)
        run.tuned[shape.name] = {kernel: cfg for kernel, (_, cfg) in best.items()}
        for _, name, values in present_switches():
            totals = {}
            for value in values:
                if not any(s == {name: value} for _, s in passed.get((checked, None), [])):
                    continue
                with override_tiles(**run.tuned[shape.name]), switched({name: value}):
                    timing = time_fused(run, shape)
                totals[value] = timing["fwd_ms"] + timing["bwd_ms"]
                run.emit(
                    kind="switch", shape_name=shape.name, shape=list(shape.shape), switch=name, value=value, **timing
                )
            if shape is attention_shapes(run.smoke)[0] and totals:
                # switches are global: the training step's shape (the first) decides
                run.tuned_switches[name] = min(totals, key=totals.get)
        run.emit(
            kind="tuned",
            shape_name=shape.name,
            shape=list(shape.shape),
            causal=shape.causal,
            configs={k: asdict(c) for k, c in run.tuned[shape.name].items()},
            switches=run.tuned_switches,
        )
    write_tile_rows(run)


def shipped_configs(run: Run, shape: AttentionShape) -> dict[str, BlockConfig]:
    """The configs the kernels launch at ``shape`` without an override (table or offline choice)."""
    capability = tile_row_key(run, shape)[0]
    _, _, n, d = shape.shape
    dkdv, dq = attention_kernel.backward_configs(d, run.dtype, capability, shape.causal, n)
    return {
        "forward": attention_kernel.forward_config(d, run.dtype, capability, shape.causal, n),
        "dkdv": dkdv,
        "dq": dq,
    }


def tile_row_key(run: Run, shape: AttentionShape) -> tuple:
    capability = torch.cuda.get_device_capability() if run.cuda else (9, 0)
    _, _, n, d = shape.shape
    return (10 * capability[0] + capability[1], d, DTYPE_NAMES[run.dtype], shape.causal, seq_bucket(n))


def write_tile_rows(run: Run) -> None:
    """``tile_rows.py``: the tuned configs as rows of ``mmlight.kernels.tiles.MEASURED``."""
    lines = [
        f"# {run.versions['device']}, torch {run.versions['torch']}, triton {run.versions['triton']}: {run.path.name}"
    ]
    for shape in attention_shapes(run.smoke):
        configs = run.tuned.get(shape.name)
        if not configs:
            continue
        body = ", ".join(
            f'"{k}": BlockConfig({c.block_m}, {c.block_n}, {c.num_warps}, {c.num_stages})' for k, c in configs.items()
        )
        lines.append(f"{tile_row_key(run, shape)!r}: {{{body}}},  # {shape.name} {list(shape.shape)}")
    if "rowwise" in run.tuned:
        c = run.tuned["rowwise"]["rowwise"]
        key = (
            tile_row_key(run, attention_shapes(run.smoke)[0])[0],
            0,
            DTYPE_NAMES[run.dtype],
            False,
            seq_bucket(rowwise_shape(run.smoke)[-1]),
        )
        lines.append(f'{key!r}: {{"rowwise": BlockConfig({c.block_m}, 0, {c.num_warps}, 1)}},  # rowwise')
    (run.out_dir / "tile_rows.py").write_text("\n".join(lines) + "\n")
    run.emit(kind="tile_rows", rows=lines[1:])


# ----------------------------------------------------------------------------- 3. attention


def section_attention(run: Run) -> None:
    """SDPA backends against the fused kernel, shipped and tuned, parameter gradients on and off."""
    for shape in attention_shapes(run.smoke)[: 1 if run.smoke else None]:
        base = {
            "op": "attention_causal" if shape.causal else "attention",
            "shape": list(shape.shape),
            "dtype": str(run.dtype).replace("torch.", ""),
        }
        records = [
            dict(backend=f"sdpa/{name}", **time_sdpa(run, shape, backend)) for name, backend in sdpa_backends(run)
        ]
        records.append(dict(backend="multimax/triton shipped", **time_fused(run, shape)))
        records.append(dict(backend="multimax/triton shipped, no param grads", **time_fused(run, shape, False)))
        tuned = run.tuned.get(shape.name, {})
        with override_tiles(**tuned), switched(run.tuned_switches):
            records.append(dict(backend="multimax/triton tuned", **time_fused(run, shape)))
            records.append(dict(backend="multimax/triton tuned, no param grads", **time_fused(run, shape, False)))
            records.append(dict(backend="softmax/triton tuned (order 0)", **time_softmax_kernel(run, shape)))
        flash = next((r for r in records if r["backend"] == "sdpa/flash" and r.get("fwd_ms")), records[0])
        for r in records:
            for phase in ("fwd", "bwd"):
                if r.get(f"{phase}_ms") and flash.get(f"{phase}_ms"):
                    r[f"{phase}_ratio"] = round(r[f"{phase}_ms"] / flash[f"{phase}_ms"], 3)
            run.emit(kind="timing", **base, **r)


def sdpa_backends(run: Run) -> list[tuple[str, object]]:
    if not run.cuda:
        return [("math", None)]
    from torch.nn.attention import SDPBackend

    return [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]


def time_sdpa(run: Run, shape: AttentionShape, backend) -> dict:
    q, k, v = (torch.randn(shape.shape, device=run.device, dtype=run.dtype, requires_grad=True) for _ in "qkv")

    def forward():
        with contextlib.nullcontext() if backend is None else torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

    try:
        out = forward()
        upstream = torch.randn_like(out)
        return {
            "fwd_ms": timer(run, forward),
            "bwd_ms": timer(run, lambda: torch.autograd.grad(out, (q, k, v), upstream, retain_graph=True)),
        }
    except RuntimeError as error:  # a backend this build or shape does not have
        return {"fwd_ms": None, "bwd_ms": None, "error": f"{type(error).__name__}: {first_line(error)}"}


def time_softmax_kernel(run: Run, shape: AttentionShape) -> dict:
    """The fused kernel without sigma (order 0): what sigma costs, by difference."""
    q, k, v = (torch.randn(shape.shape, device=run.device, dtype=run.dtype, requires_grad=True) for _ in "qkv")
    out = attention_kernel.multimax_attention(q, k, v, causal=shape.causal)
    upstream = torch.randn_like(out)
    return {
        "fwd_ms": timer(run, lambda: attention_kernel.multimax_attention(q, k, v, causal=shape.causal)),
        "bwd_ms": timer(run, lambda: torch.autograd.grad(out, (q, k, v), upstream, retain_graph=True)),
    }


# ----------------------------------------------------------------------------- 4, 5, 7. training step


@dataclass(frozen=True)
class StepVariant:
    """One DeiT-small training step to time.

    Args:
        name: label of the record.
        attention: ``softmax`` or ``multimax``.
        output: MultiMax on the logits (fused cross-entropy).
        tuned: the sweep's tuned configs and switches.
        sdpa: SDPA backend of the softmax attention (``flash``, ``cudnn``).
    """

    name: str
    attention: str
    output: bool
    tuned: bool = False
    sdpa: str = "flash"


STEP_VARIANTS = [
    StepVariant("softmax (SDPA flash)", "softmax", False),
    StepVariant("softmax (SDPA cuDNN)", "softmax", False, sdpa="cudnn"),
    StepVariant("multimax shipped", "multimax", True),
    StepVariant("multimax tuned", "multimax", True, tuned=True),
    StepVariant("multimax attention, plain CE (tuned)", "multimax", False, tuned=True),
    StepVariant("softmax attention (SDPA flash), multimax output", "softmax", True),
]


def step_setup(run: Run) -> dict:
    """Batch, image size and model variant: DeiT-small at batch 256 on a GPU, the micro ViT under --smoke."""
    if run.smoke:
        return {"batch": 1, "img_size": 16, "variant": "vit_micro"}
    return {"batch": 256, "img_size": 224, "variant": "deit_small"}


def build_step(run: Run, model: torch.nn.Module, loss_fn: Callable) -> Callable[[], None]:
    """One AdamW step under bf16 autocast (fused AdamW on a GPU)."""
    setup = step_setup(run)
    gen = torch.Generator(run.device).manual_seed(0)
    images = torch.randn(setup["batch"], 3, setup["img_size"], setup["img_size"], device=run.device, generator=gen)
    labels = torch.randint(0, 1000, (setup["batch"],), device=run.device, generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=run.cuda)

    def step():
        with torch.autocast(run.device.type, dtype=torch.bfloat16):
            loss = loss_fn(model, images, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def mmlight_model(run: Run, variant: StepVariant) -> torch.nn.Module:
    from mmlight.models import ReweightedViT, ViTConfig
    from mmlight.reweighting import ReweightingSpec

    setup = step_setup(run)
    attention = ReweightingSpec("multimax", {"order": ORDER}) if variant.attention == "multimax" else ReweightingSpec()
    config = ViTConfig(
        variant=setup["variant"],
        img_size=setup["img_size"],
        attention=attention,
        output_multimax=variant.output,
        backend="triton",
    )
    return ReweightedViT(config).to(run.device)


def mmlight_loss(model, images, labels):
    return model.loss(images, labels, label_smoothing=0.1)


def timm_model(run: Run) -> torch.nn.Module:
    """timm's DeiT-small, random init (no download), same drop-path rate as mmlight's."""
    import timm

    setup = step_setup(run)
    name = "deit_small_patch16_224" if not run.smoke else "deit_tiny_patch16_224"
    return timm.create_model(name, pretrained=False, img_size=setup["img_size"], drop_path_rate=0.1).to(run.device)


def timm_loss(model, images, labels):
    return F.cross_entropy(model(images), labels, label_smoothing=0.1)


@contextlib.contextmanager
def variant_context(run: Run, variant: StepVariant) -> Iterator[None]:
    """The variant's tiles, switches and SDPA backend."""
    with contextlib.ExitStack() as stack:
        if variant.tuned:
            stack.enter_context(override_tiles(**run.tuned.get(attention_shapes(run.smoke)[0].name, {})))
            stack.enter_context(switched(run.tuned_switches))
        if run.cuda and variant.attention == "softmax":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[variant.sdpa]
            stack.enter_context(sdpa_kernel(backend))
        yield


def time_step(run: Run, step: Callable[[], None], reps: int = 10) -> dict:
    """Median step milliseconds after warm-up; the first call's seconds (compilation) apart."""
    began = time.perf_counter()
    step()
    if run.cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - began
    if not run.cuda:  # --smoke: the one step is the measurement
        return {"step_ms": first_s * 1e3, "first_step_s": round(first_s, 2)}
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return {
        "step_ms": statistics.median(samples),
        "first_step_s": round(first_s, 2),
        "peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
    }


def step_record(run: Run, backend: str, compiled: bool, timing: dict, baseline: dict | None) -> dict:
    setup = step_setup(run)
    record = {
        "kind": "step",
        "op": f"{setup['variant']}_train_step",
        "backend": backend,
        "compiled": compiled,
        "shape": [setup["batch"], 3, setup["img_size"], setup["img_size"]],
        "dtype": "bfloat16",
        **timing,
    }
    if baseline and baseline.get("step_ms") and timing.get("step_ms"):
        record["step_ratio"] = round(timing["step_ms"] / baseline["step_ms"], 3)
    return record


def measure_variant(run: Run, variant: StepVariant, compiled: bool) -> dict:
    torch.manual_seed(0)
    with variant_context(run, variant):
        model = mmlight_model(run, variant)
        if compiled:
            torch._dynamo.reset()
            model.compile()
        try:
            return time_step(run, build_step(run, model, mmlight_loss))
        except Exception as error:
            return {"step_ms": None, "error": f"{type(error).__name__}: {first_line(error)}"}
        finally:
            del model
            if run.cuda:
                torch.cuda.empty_cache()


def section_step(run: Run) -> None:
    baseline = None
    for variant in STEP_VARIANTS:
        if variant.sdpa == "cudnn" and not run.cuda:
            run.emit(kind="skipped", section="step", what=variant.name, reason="cuDNN attention needs a CUDA GPU")
            continue
        timing = measure_variant(run, variant, compiled=False)
        baseline = baseline or timing
        run.emit(**step_record(run, variant.name, False, timing, baseline))


def section_profile(run: Run) -> None:
    """Top kernels of three softmax steps and three tuned MultiMax steps (``profiles.txt``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    sort = "cuda_time_total" if run.cuda else "cpu_time_total"
    tables = []
    for variant in (STEP_VARIANTS[0], STEP_VARIANTS[3]):
        torch.manual_seed(0)
        with variant_context(run, variant):
            model = mmlight_model(run, variant)
            step = build_step(run, model, mmlight_loss)
            if run.cuda:
                step()  # warm-up: compilation and allocator out of the profile
            with profile(activities=activities) as prof:
                for _ in range(1 if run.smoke else 3):
                    step()
                if run.cuda:
                    torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        tables.append(f"## {variant.name}\n\n{table}\n")
        run.emit(kind="profile", backend=variant.name, sort=sort, table=table)
        del model
    (run.out_dir / "profiles.txt").write_text("\n".join(tables))


def section_compiled(run: Run) -> None:
    """timm's compiled DeiT-small (the peer), then the variants compiled."""
    if not run.needs_cuda("compiled", "torch.compile of the training step"):
        return
    torch.manual_seed(0)
    torch._dynamo.reset()
    peer = timm_model(run)
    peer.compile()
    with variant_context(run, STEP_VARIANTS[0]):
        try:
            peer_timing = time_step(run, build_step(run, peer, timm_loss))
        except Exception as error:
            peer_timing = {"step_ms": None, "error": f"{type(error).__name__}: {first_line(error)}"}
    del peer
    run.emit(**step_record(run, "timm deit_small_patch16_224 (SDPA flash)", True, peer_timing, peer_timing))
    # most telling first: the budget may cut the rest
    for variant in (STEP_VARIANTS[0], STEP_VARIANTS[3], STEP_VARIANTS[4], STEP_VARIANTS[5], STEP_VARIANTS[2]):
        if run.left() < 50:
            run.emit(kind="skipped", section="compiled", what=variant.name, reason="time budget")
            continue
        timing = measure_variant(run, variant, compiled=True)
        run.emit(**step_record(run, variant.name, True, timing, peer_timing))


# ----------------------------------------------------------------------------- 6. row-wise, cross-entropy


def rowwise_shape(smoke: bool) -> tuple[int, ...]:
    return (2, 2, 19, 19) if smoke else (256, 6, 197, 197)


def rowwise_candidates(smoke: bool) -> list[BlockConfig]:
    pairs = [(4, 4)] if smoke else [(4, 4), (8, 4), (8, 8), (16, 4), (16, 8), (32, 8)]
    return [BlockConfig(rows, 0, warps, 1) for rows, warps in pairs]


def section_rowwise(run: Run) -> None:
    """torch.softmax and the row-wise kernel (shipped, then each rows-per-program candidate)."""
    shape = rowwise_shape(run.smoke)
    gen = torch.Generator(run.device).manual_seed(0)
    x = (3 * torch.randn(shape, device=run.device, generator=gen)).to(run.dtype).requires_grad_()
    module = bent_multimax("triton", run.device, ORDER)
    nbytes = x.numel() * x.element_size()
    base = {
        "kind": "timing",
        "op": "rowwise",
        "shape": list(shape),
        "dtype": str(run.dtype).replace("torch.", ""),
        "bytes_fwd": 2 * nbytes,
        "bytes_bwd": 3 * nbytes,
    }
    exact = x.detach().float().requires_grad_()
    want = outputs_and_grads(lambda t: module.compute(t[0], None, "reference"), [exact, module.ranges, module.ts])
    softmax = time_pair(run, lambda: torch.softmax(x, dim=-1), [x])
    run.emit(**base, backend="torch.softmax", **softmax)
    best = None
    settings_list = [{}, *({name: v} for _, name, values in present_switches(ROWWISE_SWITCHES) for v in values[1:])]
    for settings, cfg in itertools.product(settings_list, [None, *rowwise_candidates(run.smoke)]):
        with override_tiles(**({"rowwise": cfg} if cfg else {})), switched(settings):
            got = outputs_and_grads(lambda t: module.compute(t[0], None, "triton"), [x, module.ranges, module.ts])
            error = max(relative_error(g, w) for g, w in zip(got, want))
            ok = error <= TOLERANCE[base["dtype"]]
            timing = (
                time_pair(run, lambda: module.compute(x, None, "triton"), [x, module.ranges, module.ts]) if ok else {}
            )
        label = (
            "multimax/triton shipped" if cfg is None else f"multimax/triton rows={cfg.block_m} warps={cfg.num_warps}"
        ) + "".join(f", {name}={value}" for name, value in settings.items())
        ratios = {
            f"{p}_ratio": round(timing[f"{p}_ms"] / softmax[f"{p}_ms"], 3)
            for p in ("fwd", "bwd")
            if timing.get(f"{p}_ms") and softmax.get(f"{p}_ms")
        }
        run.emit(**base, backend=label, error_vs_fp32=error, ok=ok, switches=settings, **timing, **ratios)
        if ok and (best is None or timing["fwd_ms"] + timing["bwd_ms"] < best[0]):
            # the shipped choice competes too, as the config the kernel launches without an override
            best = (timing["fwd_ms"] + timing["bwd_ms"], cfg or shipped_rowwise(run, shape[-1]), settings)
    if best:
        run.tuned["rowwise"] = {"rowwise": best[1]}
        run.emit(
            kind="tuned",
            shape_name="rowwise",
            shape=list(shape),
            configs={"rowwise": asdict(best[1])},
            switches=best[2],
        )
        write_tile_rows(run)


def shipped_rowwise(run: Run, n: int) -> BlockConfig:
    """The rows per program and warps the row-wise kernel launches for rows of ``n`` without an override."""
    capability = tile_row_key(run, attention_shapes(run.smoke)[0])[0]
    cfg = rowwise_kernel._launch_config(n, run.dtype, capability)
    return BlockConfig(cfg["ROWS"], 0, cfg["num_warps"], 1)


def time_pair(run: Run, forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> dict:
    """Forward and backward milliseconds (backward by a retained graph)."""
    out = forward()
    upstream = torch.randn_like(out)
    wanted = [t for t in leaves if t.requires_grad]
    return {
        "fwd_ms": timer(run, forward),
        "bwd_ms": timer(run, lambda: torch.autograd.grad(out, wanted, upstream, retain_graph=True)),
    }


def section_cross_entropy(run: Run) -> None:
    """F.cross_entropy against the fused MultiMax cross-entropy, forward + backward together (the
    fused one may do gradient work in either pass)."""
    tokens, vocab = (8, 300) if run.smoke else (8192, 267744)
    gen = torch.Generator(run.device).manual_seed(0)
    logits = (3 * torch.randn(tokens, vocab, device=run.device, generator=gen)).to(run.dtype).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=run.device, generator=gen)
    module = bent_multimax("triton", run.device, ORDER)
    base = {
        "kind": "timing",
        "op": "cross_entropy",
        "shape": [tokens, vocab],
        "dtype": str(run.dtype).replace("torch.", ""),
        "bytes_fwd": logits.numel() * logits.element_size(),
        "bytes_bwd": 2 * logits.numel() * logits.element_size(),
    }
    plain = {
        "fwd_ms": timer(run, lambda: F.cross_entropy(logits, target, label_smoothing=0.1)),
        "fwd_bwd_ms": timer(run, lambda: both(F.cross_entropy(logits, target, label_smoothing=0.1), logits)),
    }
    run.emit(**base, backend="torch.cross_entropy", **plain)
    fused_ce = lambda: module.cross_entropy(logits, target, label_smoothing=0.1)  # noqa: E731
    # the check: 64 rows against the reference backend on fp32 copies of the same values
    rows = (logits[:64].detach().float().requires_grad_(), target[:64])
    reference = bent_multimax("reference", run.device, ORDER)
    want = outputs_and_grads(
        lambda t: reference.cross_entropy(t[0], rows[1], label_smoothing=0.1), [rows[0], reference.ranges, reference.ts]
    )
    totals = {}
    for settings in [{}, *({name: value} for _, name, values in present_switches(CE_SWITCHES) for value in values[1:])]:
        with switched(settings):
            few = logits[:64].detach().requires_grad_()
            got = outputs_and_grads(
                lambda t: module.cross_entropy(t[0], rows[1], label_smoothing=0.1), [few, module.ranges, module.ts]
            )
            error = max(relative_error(g, w) for g, w in zip(got, want))
            timing = {
                "fwd_ms": timer(run, lambda: module.cross_entropy(logits.detach(), target, label_smoothing=0.1)),
                "fwd_bwd_ms": timer(run, lambda: both(fused_ce(), logits, module.ranges, module.ts)),
            }
            timing["fwd_bwd_ratio"] = round(timing["fwd_bwd_ms"] / plain["fwd_bwd_ms"], 3)
            if run.cuda:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                both(fused_ce(), logits, module.ranges, module.ts)
                timing["peak_mem_mb"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
        ok = error <= TOLERANCE[base["dtype"]]
        label = "multimax/triton" + "".join(f", {name}={value}" for name, value in settings.items())
        run.emit(**base, backend=label, error_vs_fp32=error, ok=ok, switches=settings, **timing)
        if ok:
            totals[tuple(settings.items())] = timing["fwd_bwd_ms"]
    if totals:  # the fastest setting that passed goes into the tuned steps
        run.tuned_switches.update(dict(min(totals, key=totals.get)))


def both(loss: torch.Tensor, *leaves: torch.Tensor) -> None:
    torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])


# ----------------------------------------------------------------------------- 8. fit


@dataclass(frozen=True)
class FitRun:
    """One short ``mmlight fit`` of a DeiT-small config, timed by the Throughput callback's logs.

    Args:
        name: label of the record.
        config: the config file, relative to the repository's root.
        step: backend of the ``step`` record with the same attention and output layer, whose images/s
            the fit's is set beside.
    """

    name: str
    config: str
    step: str


#: Most telling first (the budget may cut the second): MultiMax, whose kernels run as custom
#: operators inside the compiled network, then softmax (SDPA picks its backend in the fit).
FIT_RUNS = [
    FitRun("deit_small_multimax", "configs/deit_small_multimax.yaml", "multimax shipped"),
    FitRun("deit_small_softmax", "configs/deit_small_softmax.yaml", "softmax (SDPA flash)"),
]
#: Seconds one fit needs at least on an H100/H200: start-up, compilation, the steps (the section's estimate).
FIT_ESTIMATE_S = 120
#: Seconds a process of the section may run under --smoke, which ignores the budget.
SMOKE_LIMIT_S = 600


def fit_time_limit(run: Run) -> float:
    """Seconds the section's next process may run: what the budget leaves, less 20 s for Lightning's
    shutdown after its ``max_time`` (:data:`SMOKE_LIMIT_S` under ``--smoke``)."""
    return SMOKE_LIMIT_S if run.smoke else max(run.left() - 20, 1)


def fit_setup(run: Run) -> dict:
    """Steps, batch (the step benchmark's), loader workers (None: the config's), ``compile``, the images
    generated, and the overrides that shrink the run under ``--smoke`` (the micro ViT at 16 px, one
    worker, uncompiled, on the CPU)."""
    if run.smoke:
        micro = ["--model.init_args.model.variant", "vit_micro", "--model.init_args.model.img_size", "16"]
        micro += ["--model.init_args.model.patch_size", "4", "--data.init_args.augment.image_size", "16"]
        return {"steps": 20, "batch": 4, "workers": 1, "compile": False, "distinct": 4, "overrides": micro}
    return {
        "steps": 300,
        "batch": step_setup(run)["batch"],
        "workers": None,
        "compile": True,
        "distinct": 256,
        "overrides": [],
    }


def duration(seconds: float) -> str:
    """Lightning's ``max_time`` format, ``DD:HH:MM:SS``."""
    s = max(int(seconds), 1)
    return f"{s // 86400:02d}:{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def fit_command(run: Run, fit: FitRun, setup: dict, shards: Path, logs: Path, seconds: float) -> list[str]:
    """``mmlight fit`` of ``fit.config`` on one device: the shards, ``setup``'s steps, batch and
    ``compile``, no validation, no checkpoint, TensorBoard logs every 10 steps under ``logs/fit/<name>``,
    stopped by Lightning after ``seconds``. The interpreter runs ``mmlight.cli`` (the device machine
    has no ``mmlight`` script)."""
    options = {
        "--trainer.devices": "1",
        "--trainer.num_nodes": "1",
        "--trainer.strategy": "auto",
        "--trainer.max_steps": str(setup["steps"]),
        "--trainer.max_time": duration(seconds),
        "--trainer.limit_val_batches": "0",
        "--trainer.num_sanity_val_steps": "0",
        "--trainer.log_every_n_steps": "10",
        "--trainer.default_root_dir": str(logs),
        "--trainer.logger.init_args.save_dir": str(logs),
        "--trainer.logger.init_args.name": "fit",
        "--trainer.logger.init_args.version": fit.name,
        "--last_checkpoint.save_last": "false",
        "--best_checkpoint.save_top_k": "0",
        "--model.init_args.compile": "true" if setup["compile"] else "false",
        "--data.init_args.root": str(shards),
        "--data.init_args.batch_size": str(setup["batch"]),
    }
    if setup["workers"] is not None:
        options["--data.init_args.num_workers"] = str(setup["workers"])
    if not run.cuda:
        options["--trainer.accelerator"] = "cpu"
    argv = [sys.executable, "-c", "from mmlight.cli import main; main()", "fit", "--config", fit.config]
    return argv + [a for pair in options.items() for a in pair] + setup["overrides"]


def run_logged(command: list[str], timeout: float, log: Path, cwd: Path = ROOT) -> tuple[int | None, str]:
    """Run ``command`` in a process group of its own; after ``timeout`` seconds kill the group (its loader
    workers and compile workers with it). Return the exit status (None: killed) and the output, whose
    last 200 lines are appended to ``log``."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        status = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        status = None
    with log.open("a") as sink:
        sink.write(f"$ {' '.join(command)}\n" + "\n".join(output.splitlines()[-200:]) + "\n\n")
    return status, output


def last_error(output: str) -> str:
    """The exception line of the output's last traceback (the first line after its indented frames),
    else the last line (a command-line error that stops with a message)."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    after = lines[starts[-1] + 1 :] if starts else []
    named = [line for line in after if line.strip() and not line[0].isspace()]
    rest = [line for line in lines if line.strip()]
    return (named[:1] or rest[-1:] or [""])[0].strip()[:200]


def logged_throughput(events: Path, steady_from: int) -> dict:
    """Mean of the Throughput callback's TensorBoard scalars (each over a window of batches) logged after
    step ``steady_from``: ``images_per_s`` (``train/device/samples_per_sec``) and ``mfu``
    (``train/device/mfu``, None where no peak is known), the windows averaged and the last step logged
    (0-based: ``max_steps - 1`` when the fit ran to its end)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]

    def steady(tag: str) -> list:
        return [e for e in accumulator.Scalars(tag) if e.step > steady_from] if tag in tags else []

    rates = steady("train/device/samples_per_sec")
    mfu = [e.value for e in steady("train/device/mfu")]
    logged = [e.step for tag in tags for e in accumulator.Scalars(tag)]
    return {
        "images_per_s": statistics.mean(e.value for e in rates) if rates else None,
        "mfu": statistics.mean(mfu) if mfu else None,
        "windows": len(rates),
        "last_logged_step": max(logged, default=None),
    }


def write_fit_shards(run: Run, setup: dict, shards: Path, log: Path) -> float:
    """One epoch's synthetic ImageNet-format shards (``fit_shards.py``, in a fresh process on every
    core) for ``setup``'s steps; the seconds it took."""
    began = time.monotonic()
    samples = setup["batch"] * (setup["steps"] + 1)  # one epoch of at least the steps
    workers = 1 if run.smoke else (os.cpu_count() or 1)
    command = [sys.executable, str(ROOT / "benchmarks" / "fit_shards.py"), "--out", str(shards)]
    command += ["--samples", str(samples), "--distinct", str(setup["distinct"]), "--workers", str(workers)]
    status, output = run_logged(command, fit_time_limit(run), log)
    if status != 0:
        raise RuntimeError(f"fit_shards.py failed: {last_error(output)}")
    return time.monotonic() - began


def measure_fit(run: Run, fit: FitRun, setup: dict, shards: Path, logs: Path) -> dict:
    """Run one fit and read its logged images/s back; the record's fields."""
    import yaml

    from mmlight.callbacks import Throughput

    workers = setup["workers"]
    if workers is None:
        workers = yaml.safe_load((ROOT / fit.config).read_text())["data"]["init_args"]["num_workers"]
    window = inspect.signature(Throughput).parameters["window_size"].default
    # after compilation the steps first drain the batches the workers prefetched meanwhile (2 each,
    # DataLoader's prefetch_factor): the windows past those show the loader's steady rate
    steady_from = 2 * workers + window
    seconds = fit_time_limit(run)  # Lightning stops there
    began = time.monotonic()
    status, output = run_logged(
        fit_command(run, fit, setup, shards, logs, seconds), seconds + 15, run.out_dir / "fit.log"
    )
    wall_s = round(time.monotonic() - began, 1)
    fields = {
        "config": fit.config,
        "compiled": setup["compile"],
        "batch": setup["batch"],
        "max_steps": setup["steps"],
        "loader_workers": workers,
        "cpus": os.cpu_count(),
        "steady_from_step": steady_from,
        "wall_s": wall_s,
    }
    if status != 0:
        why = "killed at the time limit" if status is None else f"exit status {status}"
        return {**fields, "images_per_s": None, "error": f"{why}: {last_error(output)}"}
    fields.update(logged_throughput(logs / "fit" / fit.name, steady_from))
    if not fields["windows"]:
        fields["error"] = f"no samples/s logged past step {steady_from} (last logged: {fields['last_logged_step']})"
    mean = re.search(r"mean throughput: ([\d.]+) samples/s", output)
    fields["end_of_fit_images_per_s"] = float(mean.group(1)) if mean else None
    return fields


def section_fit(run: Run) -> None:
    """``mmlight fit`` of the DeiT-small configs on synthetic ImageNet-format shards with the real loader
    (compiled on a GPU), its logged images/s beside the training step's: the difference is the data
    pipeline and Lightning's overhead."""
    import tempfile

    from mmlight.lightning_cli import MmlightCLI  # noqa: F401 (a missing package is named here, before any work)

    setup = fit_setup(run)
    if run.cuda:
        torch.cuda.empty_cache()  # the fit's process needs the memory this one cached
    with tempfile.TemporaryDirectory(prefix="gpu_run-fit-") as tmp:
        shards = Path(tmp) / "shards"
        shards_s = round(write_fit_shards(run, setup, shards, run.out_dir / "fit.log"), 1)
        for i, fit in enumerate(FIT_RUNS):
            if i and run.left() < (0 if run.smoke else FIT_ESTIMATE_S):
                run.emit(kind="skipped", section="fit", what=fit.name, reason="time budget")
                continue
            fields = measure_fit(run, fit, setup, shards, Path(tmp) / "logs")
            step = run.steps.get((fit.step, setup["compile"]), {})
            step_rate = step["shape"][0] / step["step_ms"] * 1e3 if step.get("step_ms") else None
            rate = fields.get("images_per_s")
            run.emit(
                kind="fit",
                backend=fit.name,
                smoke=run.smoke,
                shards_s=shards_s,
                **fields,
                step_backend=fit.step,
                step_images_per_s=step_rate,
                fit_to_step=round(rate / step_rate, 3) if rate and step_rate else None,
            )


# ----------------------------------------------------------------------------- main


SECTIONS = ["env", "sweep", "attention", "rowwise", "cross_entropy", "step", "profile", "compiled", "fit"]
#: Seconds each section needs at least on an H100 (estimates; the guard skips a section below them).
ESTIMATES = {
    "env": 5,
    "sweep": 90,
    "attention": 20,
    "step": 25,
    "profile": 15,
    "rowwise": 15,
    "cross_entropy": 15,
    "compiled": 90,
    "fit": FIT_ESTIMATE_S,
}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", "benchmarks/results")),
        help="output folder (default $OUT, else benchmarks/results)",
    )
    parser.add_argument("--budget", type=float, default=450.0, help="seconds; sections that would overrun are skipped")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (interpreter), to check the script"
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes that check (and so compile) sweep candidates in parallel (14 on a GPU, 1 with --smoke)",
    )
    parser.add_argument("--only", nargs="*", choices=SECTIONS, help="sections to run (all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        parser.error("the run needs a CUDA GPU; use --smoke to check the script on the CPU")
    run = Run(args.out, args.budget, args.smoke)
    bodies = {
        "env": lambda: section_env(run),
        "sweep": lambda: section_sweep(run, args.jobs or (1 if args.smoke else min(14, os.cpu_count() or 1))),
        "attention": lambda: section_attention(run),
        "step": lambda: section_step(run),
        "profile": lambda: section_profile(run),
        "rowwise": lambda: section_rowwise(run),
        "cross_entropy": lambda: section_cross_entropy(run),
        "compiled": lambda: section_compiled(run),
        "fit": lambda: section_fit(run),
    }
    for name in args.only or SECTIONS:
        run.section(name, 0 if args.smoke else ESTIMATES[name], bodies[name])
    if run.cuda:
        run.emit(kind="env_end", nvidia_smi=nvidia_smi())
    run.sink.close()
    print(f"wrote {run.path}", file=sys.stderr)
    return run.path


if __name__ == "__main__":
    main()
