"""Compile the Triton kernels for real GPUs on a machine without one, and check their resources.

Triton compiles for any CUDA target offline: ``triton.compile(ASTSource(fn, signature, constexprs,
attrs), target=GPUTarget("cuda", capability, 32))`` yields PTX and a cubin through the ``ptxas``
that the Triton wheel ships. What is compiled here is exactly what a launch compiles: the host
code of :mod:`mmlight.kernels` runs on small CPU tensors of the real shapes while
:class:`~triton.runtime.jit.JITFunction` launches are recorded instead of run, and each recorded
launch is specialised by Triton's own binder (argument types, 16-byte alignment of pointers, integer
divisibility by 16 and ``== 1``) for the chosen target.

For every compiled kernel it reports, and checks:

* that it compiles;
* registers per thread and spills, from the log of Triton's own ``ptxas -v`` call: no spill
  stores or loads are allowed;
* shared memory per block (Triton's metadata): at most :data:`SHARED_MEMORY_LIMITS` (A100: 163 KB,
  H100: 227 KB);
* that ``registers x threads`` fits the 64K-register file, or the launch would fail.

``benchmarks/compile_report.py`` runs it (``--matrix shipped``: what the shipped configs launch,
the CI test; ``--matrix full``: the committed report). It must run with ``TRITON_INTERPRET`` unset:
the interpreter replaces the compiled kernels.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import multiprocessing
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from mmlight.kernels.runtime import triton_interpreting

#: Shared memory a block may use (bytes, the opt-in maximum): A100 (sm_80) 163 KB, H100 (sm_90) 227 KB.
SHARED_MEMORY_LIMITS = {80: 163 * 1024, 90: 227 * 1024}
#: 32-bit registers per SM (and per block) on both.
REGISTER_FILE = 65536
CAPABILITIES = tuple(SHARED_MEMORY_LIMITS)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    """One way the host code calls a kernel family; it records one to four kernel launches.

    Args:
        family: ``rowwise``, ``attention`` or ``cross_entropy``.
        dtype: ``fp32``, ``bf16`` or ``fp16``.
        order: MultiMax order (0 = plain softmax).
        n: row length (row-wise), key length (attention) or vocabulary size (cross-entropy).
        head_dim: attention head dim.
        q_len: attention query length (None = ``n``); 1 is a decoding step.
        causal: attention with a causal mask.
        masked: a mask (row-wise: a general bool mask; attention: key padding).
        grad: run the backward pass too (cross-entropy: compute the logits' gradient).
        origin: where the shape comes from (a config, or "matrix").
    """

    family: str
    dtype: str
    order: int = 2
    n: int = 197
    head_dim: int = 64
    q_len: int | None = None
    causal: bool = False
    masked: bool = False
    grad: bool = True
    origin: str = "matrix"

    def label(self) -> str:
        if self.family == "attention":
            parts = [
                f"D={self.head_dim}",
                f"Tq={self.q_len or self.n}",
                f"Tk={self.n}",
                "causal" if self.causal else "",
                "padded" if self.masked else "",
            ]
        elif self.family == "rowwise":
            parts = [f"N={self.n}", "masked" if self.masked else ""]
        else:
            parts = [f"V={self.n}"]
        parts += [f"order {self.order}", self.dtype, "" if self.grad else "no grad"]
        return " ".join(p for p in parts if p)


@dataclass
class Launch:
    """A recorded kernel launch: the JIT function and the arguments it was called with."""

    kernel: object
    args: tuple
    kwargs: dict


@dataclass
class Compiled:
    """What compiling one launch for one target gave; ``problems`` is empty when it passes."""

    kernel: str
    case: str
    origin: str
    capability: int
    family: str = ""
    dtype: str = ""
    num_warps: int = 0
    num_stages: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    shared: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Inside the block, ``kernel[grid](...)`` appends a :class:`Launch` instead of running."""
    from triton.runtime.jit import JITFunction

    if triton_interpreting():
        raise RuntimeError(
            "compile checks need the compiled kernels: unset TRITON_INTERPRET before mmlight.kernels is imported"
        )
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def _sigma_params(order: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if order == 0:
        return None, None
    return torch.zeros(2 * order, requires_grad=True), torch.zeros(2 * order, requires_grad=True)


def run_host_code(case: Case) -> None:
    """Call the kernels' host code for ``case`` on CPU tensors (launches must be recorded)."""
    from mmlight.kernels import attention, cross_entropy, rowwise

    dtype = DTYPES[case.dtype]
    ranges, ts = _sigma_params(case.order)
    with torch.set_grad_enabled(case.grad):
        if case.family == "rowwise":
            x = torch.zeros(4, case.n, dtype=dtype, requires_grad=case.grad)
            mask = torch.ones(4, case.n, dtype=torch.bool) if case.masked else None
            out = rowwise.multimax_softmax(x, mask, ranges, ts)
        elif case.family == "attention":
            B, H, Tq = 2, 2, case.q_len or case.n
            q = torch.zeros(B, H, Tq, case.head_dim, dtype=dtype, requires_grad=case.grad)
            k, v = (torch.zeros(B, H, case.n, case.head_dim, dtype=dtype, requires_grad=case.grad) for _ in "kv")
            pad = torch.ones(B, case.n, dtype=torch.bool) if case.masked else None
            # the unchecked entry: the public one refuses CPU tensors without the interpreter
            out = attention._attention(q, k, v, ranges, ts, case.head_dim**-0.5, case.causal, pad)
        elif case.family == "cross_entropy":
            logits = torch.zeros(2, case.n, dtype=dtype, requires_grad=case.grad)
            out = cross_entropy.multimax_cross_entropy(logits, torch.zeros(2, dtype=torch.int64), ranges, ts)
        else:
            raise ValueError(f"unknown kernel family {case.family!r}")
        if case.grad:
            out.backward(torch.ones_like(out))


def launches_of(case: Case, capability: int) -> list[Launch]:
    """The kernel launches the host code makes for ``case`` on a GPU of ``capability``."""
    from mmlight.kernels.tiles import OFFLINE_CAPABILITY

    token = OFFLINE_CAPABILITY.set(capability)  # the tile sizes depend on the target
    try:
        with recorded_launches() as launches:
            run_host_code(case)
    finally:
        OFFLINE_CAPABILITY.reset(token)
    return launches


@contextlib.contextmanager
def ptxas_log() -> Iterator[io.StringIO]:
    """Inside the block, every ``triton.compile`` really compiles (no cache hit) and the log of
    its own ``ptxas -v`` call lands in the yielded buffer (Triton prints it to stdout)."""
    from triton import knobs

    log = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        yield log


def parse_ptxas_log(log: str) -> dict[str, int]:
    """The resource lines of a ``ptxas -v`` log (one kernel)."""
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or frame is None:
        raise ValueError(f"no resource usage in the ptxas log:\n{log}")
    return {
        "registers": int(regs.group(1)),
        "stack_frame": int(frame.group(1)),
        "spill_stores": int(frame.group(2)),
        "spill_loads": int(frame.group(3)),
    }


def specialise(launch: Launch, capability: int):
    """``(source, options)`` that Triton would compile for this launch on ``capability``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options


def compile_launch(launch: Launch, case: Case, capability: int, extra_options: dict | None = None) -> Compiled:
    """Compile one launch for ``capability`` and check its resources.

    Args:
        launch: a recorded launch.
        case: the case it came from (for the report).
        capability: 80 or 90.
        extra_options: Triton compile options to override (tests use ``maxnreg`` to force spills).
    """
    import triton
    from triton.backends.compiler import GPUTarget

    result = Compiled(launch.kernel.__name__, case.label(), case.origin, capability, case.family, case.dtype)
    start = time.perf_counter()
    try:
        source, options = specialise(launch, capability)
        options = {**options.__dict__, **(extra_options or {})}
        with ptxas_log() as log:
            kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
        usage = parse_ptxas_log(log.getvalue())
    except Exception as error:  # a compile failure is a finding, reported with the rest
        result.problems.append(f"does not compile: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
        return result
    result.seconds = round(time.perf_counter() - start, 2)
    result.num_warps, result.num_stages = kernel.metadata.num_warps, kernel.metadata.num_stages
    result.shared = kernel.metadata.shared
    for name, value in usage.items():
        setattr(result, name, value)
    result.problems = resource_problems(result)
    return result


def resource_problems(result: Compiled) -> list[str]:
    """What is wrong with a compiled kernel's resources (empty when nothing is)."""
    problems = []
    if result.spill_stores or result.spill_loads:
        problems.append(f"spills {result.spill_stores} B stores / {result.spill_loads} B loads")
    limit = SHARED_MEMORY_LIMITS[result.capability]
    if result.shared > limit:
        problems.append(f"shared memory {result.shared} B > {limit} B")
    if result.registers * 32 * result.num_warps > REGISTER_FILE:
        problems.append(f"{result.registers} registers x {32 * result.num_warps} threads > {REGISTER_FILE}")
    return problems


def shipped_cases() -> list[Case]:
    """What the shipped MultiMax configs launch (all bf16-mixed, order 2, every mask a key padding,
    so the row-wise kernel is not launched by them).

    * ``deit_small_multimax``: 6 heads of 64 over 197 tokens; output MultiMax over 1,000 classes;
    * ``lm_wikitext103_multimax``: 8 heads of 64, causal over 512 tokens (padding at the end of a
      split); output MultiMax over 267,744 words;
    * ``nmt_iwslt14_multimax``: 4 heads of 128: encoder (padding), decoder (causal and padding),
      cross-attention (padding, Tq != Tk), a beam-search step (Tq = 1, no grad); 10,000 words.
    """
    deit, lm, nmt = "deit_small_multimax", "lm_wikitext103_multimax", "nmt_iwslt14_multimax"
    return [
        Case("attention", "bf16", n=197, head_dim=64, origin=deit),
        Case("cross_entropy", "bf16", n=1000, origin=deit),
        Case("cross_entropy", "bf16", n=1000, grad=False, origin=deit),
        Case("attention", "bf16", n=512, head_dim=64, causal=True, origin=lm),
        Case("attention", "bf16", n=512, head_dim=64, causal=True, masked=True, origin=lm),
        Case("cross_entropy", "bf16", n=267744, origin=lm),
        Case("cross_entropy", "bf16", n=267744, grad=False, origin=lm),
        Case("attention", "bf16", n=37, head_dim=128, masked=True, origin=nmt),
        Case("attention", "bf16", n=37, head_dim=128, causal=True, masked=True, origin=nmt),
        Case("attention", "bf16", n=37, q_len=29, head_dim=128, masked=True, origin=nmt),
        Case("attention", "bf16", n=37, q_len=1, head_dim=128, causal=True, masked=True, grad=False, origin=nmt),
        Case("cross_entropy", "bf16", n=10000, origin=nmt),
    ]


def full_matrix() -> list[Case]:
    """Every kernel family across dtypes, masks and shapes (the full matrix).

    Row-wise: short (197) and long (267,744) rows, orders 0, 1, 2, masked or not. Attention: head
    dims 16-128, causal or not, key padding or not, order 2 (the models send plain softmax to SDPA,
    and order 2 holds the most registers). Cross-entropy: 1,000 and 267,744 classes (the two block
    sizes), orders 1 and 2, with and without the gradient.
    """
    cases = []
    for dtype in DTYPES:
        for n, order, masked in itertools.product((197, 267744), (0, 1, 2), (False, True)):
            cases.append(Case("rowwise", dtype, order=order, n=n, masked=masked))
        for head_dim, causal, masked in itertools.product((16, 32, 64, 128), (False, True), (False, True)):
            cases.append(Case("attention", dtype, n=197, head_dim=head_dim, causal=causal, masked=masked))
        for n, order, grad in itertools.product((1000, 267744), (1, 2), (True, False)):
            cases.append(Case("cross_entropy", dtype, order=order, n=n, grad=grad))
    return cases


# Work items of check_cases, inherited by forked compile processes (JIT functions do not pickle).
_PENDING: list[tuple[Launch, Case, int]] = []


def _compile_pending(index: int) -> Compiled:
    launch, case, capability = _PENDING[index]
    return compile_launch(launch, case, capability)


def check_cases(
    cases: list[Case],
    capabilities: tuple[int, ...] = CAPABILITIES,
    jobs: int = 1,
    log: Callable[[str], None] | None = None,
) -> list[Compiled]:
    """Compile every distinct kernel specialisation the cases launch, for every capability.

    Launches that specialise identically (e.g. the delta kernel of every order) are compiled once,
    for the first case that launches them.
    """
    seen = set()
    _PENDING.clear()
    for case in cases:
        for capability in capabilities:
            for launch in launches_of(case, capability):
                source, options = specialise(launch, capability)
                key = (capability, source.hash(), repr(options))
                if key not in seen:
                    seen.add(key)
                    _PENDING.append((launch, case, capability))
    with (
        ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
        if jobs > 1
        else contextlib.nullcontext()
    ) as pool:
        indices = range(len(_PENDING))
        results = []
        for result in pool.map(_compile_pending, indices) if pool else map(_compile_pending, indices):
            results.append(result)
            if log:
                log(format_row(result))
    return results


TABLE_HEADER = (
    "| kernel | case | origin | sm | warps | stages | registers | spills (B) | shared (KB) | verdict |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(r: Compiled) -> str:
    spills = f"{r.spill_stores}/{r.spill_loads}"
    verdict = "ok" if not r.problems else "; ".join(r.problems)
    return (
        f"| {r.kernel} | {r.case} | {r.origin} | {r.capability} | {r.num_warps} | {r.num_stages} | "
        f"{r.registers} | {spills} | {r.shared / 1024:.1f} | {verdict} |"
    )


def summary_table(results: list[Compiled]) -> str:
    """Per kernel, one row with a ``/``-separated value per target (sm, ascending): how many
    specialisations, the largest register and shared-memory use, and how many spill or fail."""
    groups: dict[str, dict[int, list[Compiled]]] = {}
    for r in results:
        groups.setdefault(r.kernel, {}).setdefault(r.capability, []).append(r)
    capabilities = sorted({r.capability for r in results})
    columns = {
        "specialisations": len,
        "max registers": lambda rs: str(max(r.registers for r in rs)),
        "max shared (KB)": lambda rs: f"{max(r.shared for r in rs) / 1024:.1f}",
        "spilling": lambda rs: str(sum(bool(r.spill_stores or r.spill_loads) for r in rs)),
        "failing": lambda rs: str(sum(bool(r.problems) for r in rs)),
    }
    targets = " / ".join(map(str, capabilities))
    lines = [
        "| kernel | " + " | ".join(f"{name}, sm {targets}" for name in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for kernel, by_capability in sorted(groups.items()):
        cells = [
            " / ".join(str(value(by_capability[c])) if c in by_capability else "–" for c in capabilities)
            for value in columns.values()
        ]
        lines.append(f"| {kernel} | {' | '.join(cells)} |")
    return "\n".join(lines)
