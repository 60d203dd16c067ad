"""Sections ``step`` and ``profile``: the DeiT-small training step (bf16 autocast, batch 256, fused AdamW).

``step`` times, most telling first: softmax (SDPA flash) and MultiMax as shipped, eager; timm's
``deit_small_patch16_224`` compiled (the peer); softmax and MultiMax compiled; then the eager variants
that split MultiMax's cost (cuDNN softmax, MultiMax attention with plain cross-entropy, softmax
attention with the MultiMax output). Each variant runs under a limit of its own (a compilation that
passes it is recorded and the next variant runs). Eager ratios are to eager softmax, compiled ones to
timm's compiled model. ``profile`` writes ``torch.profiler`` tables of a softmax and a MultiMax step
(tuned, where the sweep has run) to ``profiles.txt``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from benchmarks.gpu.common import ORDER, attention_shapes, switched
from benchmarks.gpu.record import Run

#: Seconds an eager variant may take (its first step compiles the Triton kernels not yet cached).
EAGER_LIMIT_S = 60
#: Seconds a compiled variant may take (torch.compile of forward and backward, then the steps).
COMPILED_LIMIT_S = 150


@dataclass(frozen=True)
class StepVariant:
    """One DeiT-small training step to time.

    Args:
        name: label of the record.
        attention: ``softmax``, ``multimax`` or ``timm`` (timm's DeiT-small, softmax through SDPA).
        output: MultiMax on the logits (the fused cross-entropy).
        compiled: ``torch.compile`` of the model.
        tuned: the sweep's tuned tiles and switches.
        sdpa: SDPA backend of softmax attention (``flash``, ``cudnn``).
    """

    name: str
    attention: str
    output: bool
    compiled: bool = False
    tuned: bool = False
    sdpa: str = "flash"


SOFTMAX = StepVariant("softmax (SDPA flash)", "softmax", False)
MULTIMAX = StepVariant("multimax shipped", "multimax", True)
PEER = StepVariant("timm deit_small_patch16_224 (SDPA flash)", "timm", False, compiled=True)
#: In order of worth: the budget may cut the tail.
VARIANTS = [
    SOFTMAX,
    MULTIMAX,
    PEER,
    StepVariant(SOFTMAX.name, "softmax", False, compiled=True),
    StepVariant(MULTIMAX.name, "multimax", True, compiled=True),
    StepVariant("softmax (SDPA cuDNN)", "softmax", False, sdpa="cudnn"),
    StepVariant("multimax attention, plain CE", "multimax", False),
    StepVariant("softmax attention (SDPA flash), multimax output", "softmax", True),
]
TUNED = StepVariant("multimax tuned", "multimax", True, tuned=True)


def setup(smoke: bool) -> dict:
    """Batch, image size and model: DeiT-small at batch 256 on a GPU, the micro ViT under ``--smoke``."""
    if smoke:
        return {"batch": 1, "img_size": 16, "variant": "vit_micro", "timm": "deit_tiny_patch16_224"}
    return {"batch": 256, "img_size": 224, "variant": "deit_small", "timm": "deit_small_patch16_224"}


def build_model(run: Run, variant: StepVariant):
    """The variant's network on the device, and its loss ``loss(model, images, labels)``."""
    import torch
    import torch.nn.functional as F

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = setup(run.smoke)
    if variant.attention == "timm":
        import timm

        model = timm.create_model(s["timm"], pretrained=False, img_size=s["img_size"], drop_path_rate=0.1)
        return model.to(device), lambda m, x, y: F.cross_entropy(m(x), y, label_smoothing=0.1)
    from mmlight.models import ReweightedViT, ViTConfig
    from mmlight.reweighting import ReweightingSpec

    attention = ReweightingSpec("multimax", {"order": ORDER}) if variant.attention == "multimax" else ReweightingSpec()
    config = ViTConfig(
        variant=s["variant"],
        img_size=s["img_size"],
        attention=attention,
        output_multimax=variant.output,
        backend="triton",
    )
    return ReweightedViT(config).to(device), lambda m, x, y: m.loss(x, y, label_smoothing=0.1)


def build_step(run: Run, model, loss_fn: Callable) -> Callable[[], None]:
    """One AdamW step under bf16 autocast (fused AdamW on a GPU)."""
    import torch

    device = next(model.parameters()).device
    s = setup(run.smoke)
    gen = torch.Generator(device).manual_seed(0)
    images = torch.randn(s["batch"], 3, s["img_size"], s["img_size"], device=device, generator=gen)
    labels = torch.randint(0, 1000, (s["batch"],), device=device, generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model, images, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


@contextlib.contextmanager
def variant_context(run: Run, variant: StepVariant) -> Iterator[None]:
    """The variant's tiles, switches and SDPA backend."""
    import torch

    with contextlib.ExitStack() as stack:
        if variant.tuned:
            from mmlight.kernels.tiles import override_tiles

            stack.enter_context(
                override_tiles(**run.state.get("tuned", {}).get(attention_shapes(run.smoke)[0].name, {}))
            )
            stack.enter_context(switched(run.state.get("tuned_switches", {})))
        if torch.cuda.is_available() and variant.attention != "multimax":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[variant.sdpa]
            stack.enter_context(sdpa_kernel(backend))
        yield


def time_step(step: Callable[[], None], cuda: bool, reps: int = 10) -> dict:
    """Median step milliseconds after warm-up; the first call's seconds (compilation) apart."""
    import torch

    began = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - began
    if not cuda:  # --smoke: the one step is the measurement
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


def compiled_loss(model, loss_fn: Callable, variant: StepVariant) -> Callable:
    """The loss with the network compiled as its task compiles it: timm's ``__call__`` (its loss calls
    ``m(x)``); mmlight's ``loss`` method through the tasks' :class:`~mmlight.tasks.compiling.CompiledCalls`
    (``fullgraph=True``). ``Module.compile`` would wrap only ``__call__``, which ``loss`` never goes through."""
    if variant.attention == "timm":
        model.compile()
        return loss_fn
    from mmlight.tasks.compiling import CompiledCalls

    calls = CompiledCalls(True, model)
    return lambda m, x, y: calls(m.loss, x, y, label_smoothing=0.1)


def measure(run: Run, variant: StepVariant) -> dict:
    """The variant's step timing (a fresh model, compiled if asked)."""
    import torch

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    if variant.compiled:
        torch._dynamo.reset()  # each compiled variant compiles from scratch, and a cut-off leaves nothing behind
    with variant_context(run, variant):
        model, loss_fn = build_model(run, variant)
        if variant.compiled and cuda:
            loss_fn = compiled_loss(model, loss_fn, variant)
        try:
            return time_step(build_step(run, model, loss_fn), cuda)
        finally:
            del model
            if cuda:
                torch.cuda.empty_cache()


def step_record(run: Run, variant: StepVariant, timing: dict, baseline: dict | None) -> dict:
    s = setup(run.smoke)
    record = {
        "kind": "step",
        "op": f"{s['variant']}_train_step",
        "backend": variant.name,
        "compiled": variant.compiled,
        "shape": [s["batch"], 3, s["img_size"], s["img_size"]],
        "dtype": "bfloat16",
        **timing,
    }
    if baseline and baseline.get("step_ms") and timing.get("step_ms"):
        record["step_ratio"] = round(timing["step_ms"] / baseline["step_ms"], 3)
    return record


def run_variant(run: Run, variant: StepVariant, baseline: dict | None) -> dict:
    """Time one variant under its limit and record it; the timing."""
    import torch

    if variant.sdpa == "cudnn" and not torch.cuda.is_available():
        run.emit(kind="skipped", section="step", what=variant.name, reason="cuDNN attention needs a CUDA GPU")
        return {}
    if variant.compiled and not torch.cuda.is_available() and variant.attention != "timm":
        run.emit(kind="skipped", section="step", what=f"{variant.name}, compiled", reason="needs a CUDA GPU")
        return {}
    limit = COMPILED_LIMIT_S if variant.compiled else EAGER_LIMIT_S
    timing = run.attempt(f"step {variant.name}", limit, lambda: measure(run, variant))
    if variant.compiled and not torch.cuda.is_available():
        timing["note"] = "run eagerly: --smoke compiles nothing"
    record = run.emit(**step_record(run, variant, timing, baseline))
    run.state.setdefault("steps", {})[variant.name, variant.compiled] = record
    return timing


def section(run: Run) -> None:
    baselines: dict[bool, dict] = {}
    for variant in VARIANTS:
        # eager against eager softmax; compiled against timm's compiled model (the first of each kind)
        timing = run_variant(run, variant, baselines.get(variant.compiled))
        baselines.setdefault(variant.compiled, timing)


def section_profile(run: Run) -> None:
    """Top kernels of three softmax steps and three MultiMax steps (tuned where the sweep has run)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    tables = []
    for variant in (SOFTMAX, TUNED if run.state.get("tuned") else MULTIMAX):
        torch.manual_seed(0)
        with variant_context(run, variant):
            model, loss_fn = build_model(run, variant)
            step = build_step(run, model, loss_fn)
            if cuda:
                step()  # warm-up: compilation and allocator out of the profile
            with profile(activities=activities) as prof:
                for _ in range(1 if run.smoke else 3):
                    step()
                if cuda:
                    torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        tables.append(f"## {variant.name}\n\n{table}\n")
        run.emit(kind="profile", backend=variant.name, sort=sort, table=table)
        del model
    (run.out_dir / "profiles.txt").write_text("\n".join(tables))
