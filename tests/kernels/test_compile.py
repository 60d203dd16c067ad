"""Every kernel specialisation the shipped configs launch compiles for sm_80 (A100) and sm_90
(H100), without spills and within shared memory, on a machine without a GPU.

The compilation runs in a subprocess with ``TRITON_INTERPRET=0`` (this process has the interpreter
on, which replaces the compiled kernels). The full matrix is ``benchmarks/compile_report.py``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compile_check import SHARED_MEMORY_LIMITS, parse_ptxas_log, shipped_cases

ROOT = Path(__file__).resolve().parents[2]

ATTENTION_KERNELS = {"_forward_kernel", "_delta_kernel", "_backward_dkdv_kernel", "_backward_dq_kernel"}
#: Pass 1 (the loss and row statistics) and pass 2 (the gradient, in the backward as shipped).
CROSS_ENTROPY_KERNELS = {"_cross_entropy_kernel", "_cross_entropy_backward_kernel"}


def compiled_env() -> dict:
    return {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}


@pytest.mark.slow
def test_shipped_configs_compile_for_a100_and_h100(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "compile_report.py"),
            "--matrix",
            "shipped",
            "--jobs",
            "2",
            "--out",
            str(tmp_path),
        ],
        env=compiled_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    written = list(tmp_path.glob("compile_report-cpu-*-shipped.json"))  # named as benchmarks/record_name.py says
    assert len(written) == 1, run.stderr[-3000:]
    out = written[0]
    results = json.loads(out.read_text())
    for r in results:
        assert not r["problems"], f"{r['kernel']} {r['case']} sm_{r['capability']}: {r['problems']}"
        assert r["spill_stores"] == r["spill_loads"] == 0 and 0 < r["registers"] <= 255
        assert r["shared"] <= SHARED_MEMORY_LIMITS[r["capability"]]
        assert r["registers"] * 32 * r["num_warps"] <= 65536
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.with_name(out.name.removesuffix(".json") + ".md").read_text().count("| ok |") == len(results)
    for capability in (80, 90):
        compiled = [r for r in results if r["capability"] == capability]
        # the cross-entropy's two kernels: pass 1 in the forward, pass 2 in the backward (GRADIENT_IN_BACKWARD)
        assert {r["kernel"] for r in compiled} == ATTENTION_KERNELS | CROSS_ENTROPY_KERNELS
        # a specialisation two configs share (e.g. the 10,000- and 267,744-word cross-entropy) is
        # compiled once, for the first; every config has attention kernels of its own head dim or mask
        for origin in {c.origin for c in shipped_cases()}:
            assert ATTENTION_KERNELS <= {r["kernel"] for r in compiled if r["origin"] == origin}, origin


# Below the forward kernel's ~125 registers, so it must spill. Not 64: the ptxas of Triton 3.9 refuses
# to allocate the sm_90 wgmma pipeline in 64 registers at all ("Register allocation failed"), where
# the ptxas of the Triton used before (torch 2.14's) spilled.
FORCED_REGISTERS = 96
FORCED_SPILL = (
    f"MAX_REGISTERS = {FORCED_REGISTERS}"
    + """
import json
from benchmarks import compile_check as C
case = C.Case("attention", "bf16", n=197, head_dim=64)
launch = next(l for l in C.launches_of(case, 90) if l.kernel.__name__ == "_forward_kernel")
print(json.dumps(C.compile_launch(launch, case, 90, extra_options={"maxnreg": MAX_REGISTERS}).__dict__))
"""
)


@pytest.mark.slow
def test_a_spilling_kernel_is_reported():
    """The check sees spills: the forward kernel capped below its register need must spill."""
    run = subprocess.run(
        [sys.executable, "-c", FORCED_SPILL],
        env=compiled_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not any("does not compile" in p for p in result["problems"]), result["problems"]
    assert result["registers"] <= FORCED_REGISTERS and result["spill_stores"] > 0
    assert any("spills" in p for p in result["problems"])


def test_ptxas_log_parsing():
    log = """ptxas info    : Compiling entry function '_fwd' for 'sm_90a'
ptxas info    : Function properties for _fwd
    48 bytes stack frame, 44 bytes spill stores, 40 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cmem[0]
"""
    assert parse_ptxas_log(log) == {"registers": 255, "stack_frame": 48, "spill_stores": 44, "spill_loads": 40}
    with pytest.raises(ValueError, match="no resource usage"):
        parse_ptxas_log("ptxas fatal : Unresolved extern function")
