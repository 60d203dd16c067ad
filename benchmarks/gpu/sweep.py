"""Section ``sweep``: every candidate tile config of the attention kernels (forward, dK/dV, dQ) checked
against fp32 in the check pool (each verdict recorded as it finishes; a candidate that fails to compile
or passes its limit is recorded and dropped), the survivors timed at each shape, the fastest of each
kernel kept ("tuned", the shipped config competing too), then each switch timed with the tuned tiles.
Each timing runs under a limit and with its errors caught, so one bad combination costs one record.
Writes ``tile_rows.py``: the tuned configs as rows of :data:`mmlight.kernels.tiles.MEASURED`. Last,
the tuned kernel's attention timing and the tuned eager step, for the report's targets.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict

from benchmarks.gpu.common import (
    AttentionShape,
    attention_shapes,
    dtype_name,
    placement,
    present_switches,
    switched,
    time_fused,
)
from benchmarks.gpu.pool import run_pool
from benchmarks.gpu.record import Run

#: Seconds one candidate's check may take in the pool (its compilations included).
CHECK_LIMIT_S = 90
#: Seconds one timing may take.
TIMING_LIMIT_S = 30


def candidates(smoke: bool) -> dict[str, list]:
    """The small tile space of each attention kernel (``--smoke``: one per kernel)."""
    from mmlight.kernels.tiles import BlockConfig

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


def check_candidates(run: Run, jobs: int) -> dict[tuple[str, str], list]:
    """``(specialisation, kernel) -> configs that passed``, every verdict recorded as it comes."""
    tasks, keys = [], []
    for shape in {s.specialisation: s for s in attention_shapes(run.smoke)}.values():
        for kernel, configs in candidates(run.smoke).items():
            for cfg in configs:
                tasks.append(("benchmarks.gpu.common:check_attention", (shape, kernel, cfg, {})))
                keys.append((shape.name, kernel, cfg))
    passed: dict[tuple[str, str], list] = {}

    def record(index: int, verdict: dict) -> None:
        shape_name, kernel, cfg = keys[index]
        run.emit(kind="check", section="sweep", shape_name=shape_name, kernel=kernel, config=asdict(cfg), **verdict)
        if verdict.get("ok"):
            passed.setdefault((shape_name, kernel), []).append(cfg)

    unchecked = run_pool(run, tasks, jobs, CHECK_LIMIT_S, record)
    if unchecked:
        run.emit(kind="skipped", section="sweep", what=f"{len(unchecked)} of {len(tasks)} checks", reason="time budget")
    return passed


def row_key(shape: AttentionShape) -> tuple:
    """The :data:`~mmlight.kernels.tiles.MEASURED` key of ``shape`` on this device (sm_90 on the CPU)."""
    import torch

    from mmlight.kernels.tiles import DTYPE_NAMES, seq_bucket

    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    _, _, n, d = shape.shape
    return (10 * major + minor, d, DTYPE_NAMES[placement()[1]], shape.causal, seq_bucket(n))


def shipped_configs(shape: AttentionShape) -> dict:
    """The configs the kernels launch at ``shape`` without an override (table or offline choice)."""
    from mmlight.kernels import attention as attention_kernel

    capability = row_key(shape)[0]
    _, _, n, d = shape.shape
    dtype = placement()[1]
    dkdv, dq = attention_kernel.backward_configs(d, dtype, capability, shape.causal, n)
    return {"forward": attention_kernel.forward_config(d, dtype, capability, shape.causal, n), "dkdv": dkdv, "dq": dq}


def tune_shape(run: Run, shape: AttentionShape, passed: dict) -> None:
    """Time the shipped kernel and each passing candidate at ``shape``; keep the fastest per kernel; then
    each switch with the tuned tiles."""
    from mmlight.kernels.tiles import override_tiles

    where = {"shape_name": shape.name, "shape": list(shape.shape)}
    shipped = run.attempt(f"shipped at {shape.name}", TIMING_LIMIT_S, lambda: time_fused(run.smoke, shape))
    run.emit(kind="sweep", **where, kernel=None, config=None, **shipped)
    offline = shipped_configs(shape)
    best = {k: (shipped.get("fwd_ms" if k == "forward" else "bwd_ms", float("inf")), offline[k]) for k in offline}
    for kernel in ("forward", "dkdv", "dq"):
        phase = "fwd" if kernel == "forward" else "bwd"
        for cfg in passed.get((shape.specialisation, kernel), []):
            with override_tiles(**{kernel: cfg}):
                timing = run.attempt(
                    f"{kernel} {cfg}", TIMING_LIMIT_S, lambda: time_fused(run.smoke, shape, phases=(phase,))
                )
            run.emit(kind="sweep", **where, kernel=kernel, config=asdict(cfg), **timing)
            if timing.get(f"{phase}_ms") and timing[f"{phase}_ms"] < best[kernel][0]:
                best[kernel] = (timing[f"{phase}_ms"], cfg)
    tuned = run.state.setdefault("tuned", {})[shape.name] = {kernel: cfg for kernel, (_, cfg) in best.items()}
    for _, name, values in present_switches():
        totals = {}
        for value in values:
            with override_tiles(**tuned), switched({name: value}):  # a failing combination is one record
                timing = run.attempt(f"{name}={value} tuned", TIMING_LIMIT_S, lambda: time_fused(run.smoke, shape))
            run.emit(kind="switch", **where, switch=name, value=value, **timing)
            if timing.get("fwd_ms") and timing.get("bwd_ms"):
                totals[value] = timing["fwd_ms"] + timing["bwd_ms"]
        if shape.name == attention_shapes(run.smoke)[0].name and totals:
            # switches are global: the training step's shape (the first) decides
            run.state.setdefault("tuned_switches", {})[name] = min(totals, key=totals.get)
    configs = {k: asdict(c) for k, c in tuned.items()}
    run.emit(kind="tuned", **where, causal=shape.causal, configs=configs, switches=run.state.get("tuned_switches", {}))


def write_tile_rows(run: Run) -> None:
    """``tile_rows.py``: the tuned configs as rows of ``mmlight.kernels.tiles.MEASURED``."""
    from benchmarks.gpu.rowwise import rowwise_shape
    from mmlight.kernels.tiles import DTYPE_NAMES, seq_bucket

    tuned = run.state.get("tuned", {})
    v = run.versions
    lines = [f"# {v['device']}, torch {v['torch']}, triton {v['triton']}: {run.path.name}"]
    for shape in attention_shapes(run.smoke):
        if shape.name in tuned:
            body = ", ".join(
                f'"{k}": BlockConfig({c.block_m}, {c.block_n}, {c.num_warps}, {c.num_stages})'
                for k, c in tuned[shape.name].items()
            )
            lines.append(f"{row_key(shape)!r}: {{{body}}},  # {shape.name} {list(shape.shape)}")
    if "rowwise" in tuned:
        c = tuned["rowwise"]["rowwise"]
        capability = row_key(attention_shapes(run.smoke)[0])[0]
        key = (capability, 0, DTYPE_NAMES[placement()[1]], False, seq_bucket(rowwise_shape(run.smoke)[-1]))
        lines.append(f'{key!r}: {{"rowwise": BlockConfig({c.block_m}, 0, {c.num_warps}, 1)}},  # rowwise')
    (run.out_dir / "tile_rows.py").write_text("\n".join(lines) + "\n")
    run.emit(kind="tile_rows", rows=lines[1:])


def tuned_timings(run: Run) -> None:
    """The tuned kernel at each tuned shape (ratio to SDPA flash from the attention section's record),
    and the tuned eager step (ratio to eager softmax)."""
    from benchmarks.gpu import step
    from benchmarks.gpu.common import ratios
    from mmlight.kernels.tiles import override_tiles

    tuned, switches = run.state.get("tuned", {}), run.state.get("tuned_switches", {})
    for shape in attention_shapes(run.smoke):
        if shape.name not in tuned:
            continue
        with override_tiles(**tuned[shape.name]), switched(switches):
            timing = run.attempt(f"tuned at {shape.name}", TIMING_LIMIT_S, lambda: time_fused(run.smoke, shape))
        flash = run.state.get("flash", {}).get(shape.name, {})
        op = "attention_causal" if shape.causal else "attention"
        run.emit(
            kind="timing",
            op=op,
            shape=list(shape.shape),
            dtype=dtype_name(placement()[1]),
            backend="multimax/triton tuned",
            **timing,
            **ratios(timing, flash),
        )
    softmax = run.state.get("steps", {}).get((step.SOFTMAX.name, False))
    step.run_variant(run, step.TUNED, softmax)


def section(run: Run, jobs: int) -> None:
    passed = check_candidates(run, jobs)
    for shape in attention_shapes(run.smoke):
        tune_shape(run, shape, passed)
    write_tile_rows(run)
    tuned_timings(run)
