"""``mmlight doctor``: on a machine without a GPU, the interpreter checks (tests/conftest.py sets
``TRITON_INTERPRET=1``, so they run in-process); on every machine, the GPU branch's logic (placement,
tolerances, timings, the table, the verdicts, the exit status, the re-run under the interpreter) from
a run recorded on an H100 and from stand-in kernels, so that it is tested where no GPU is."""

import pytest
import torch

from mmlight import doctor

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU branch of the doctor")


def table_rows(output: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in output.splitlines()
        if line.startswith("| ") and not line.startswith("| check")
    ]


@cpu_only
def test_cpu_report_checks_every_kernel(capsys):
    doctor.main([])
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "triton: " in out and "torch: " in out
    rows = table_rows(out)
    assert [r[0] for r in rows] == [c.name for c in doctor.CHECKS]
    for name, _shape, dtype, error, verdict in rows:
        assert dtype == "float32" and verdict == "ok", name
        assert float(error.split()[0]) <= doctor.FP32_TOLERANCE
    assert "VERDICT: no GPU here" in out


@cpu_only
def test_a_wrong_kernel_fails_the_check(monkeypatch, capsys):
    """A kernel whose output is off by 1% is reported as FAIL, with exit status 1."""
    import mmlight.kernels.attention as kernel

    right = kernel.multimax_attention
    monkeypatch.setattr(kernel, "multimax_attention", lambda *a, **k: right(*a, **k) * 1.01)
    monkeypatch.setattr(doctor, "CHECKS", [c for c in doctor.CHECKS if c.name.startswith("attention")])
    with pytest.raises(SystemExit) as exit_info:
        doctor.main([])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert table_rows(out)[0][-1] == "FAIL" and "FAILED for attention (DeiT-small)" in out


# ---------------------------------------------------------------------------- the GPU branch, on any machine

# `run_check(check, on_gpu=True)` for every check on an NVIDIA H100 80GB HBM3 (sm_90), torch 2.11.0+cu130,
# Triton 3.6.0, 2026-11-24; and the table and verdict `mmlight doctor` printed for them.
H100_ROWS = [
    {
        "check": "row-wise MultiMax (DeiT-small scores)",
        "shape": "64x6x197x197",
        "dtype": "bfloat16",
        "tolerance": 0.02,
        "error": 0.0032141023154980907,
        "ok": True,
        "ms": {"triton": 0.9240599945187569, "reference": 3.9251153809683665, "compile": 0.8204340003430843},
    },
    {
        "check": "attention (DeiT-small)",
        "shape": "64x6x197x64",
        "dtype": "bfloat16",
        "tolerance": 0.03,
        "error": 0.00676278117100297,
        "ok": True,
        "ms": {"triton": 0.9733160038789114, "reference": 4.067062854766846, "compile": 1.3333585370670666},
    },
    {
        "check": "causal attention N=1024",
        "shape": "8x8x1024x64",
        "dtype": "bfloat16",
        "tolerance": 0.03,
        "error": 0.005148385292951984,
        "ok": True,
        "ms": {"triton": 0.9929942118710485, "reference": 15.150367736816406, "compile": 1.9489320069551468},
    },
    {
        "check": "cross-entropy (LM vocabulary)",
        "shape": "64x267744",
        "dtype": "bfloat16",
        "tolerance": 0.02,
        "error": 0.0027594844445356973,
        "ok": True,
        "ms": {"triton": 1.0653247992197672, "reference": 3.381875991821289, "compile": 0.9709327936172485},
    },
]
H100_TABLE = """\
| check | shape | dtype | max error (tolerance) | triton ms | reference ms | compile ms | verdict |
|---|---|---|---|---|---|---|---|
| row-wise MultiMax (DeiT-small scores) | 64x6x197x197 | bfloat16 | 0.0032 (2e-02) | 0.924 | 3.93 | 0.82 | ok |
| attention (DeiT-small) | 64x6x197x64 | bfloat16 | 0.0068 (3e-02) | 0.973 | 4.07 | 1.33 | ok |
| causal attention N=1024 | 8x8x1024x64 | bfloat16 | 0.0051 (3e-02) | 0.993 | 15.2 | 1.95 | ok |
| cross-entropy (LM vocabulary) | 64x267744 | bfloat16 | 0.0028 (2e-02) | 1.07 | 3.38 | 0.971 | ok |"""
H100_VERDICT = "VERDICT: every kernel matches the reference; backend 'auto' will use the Triton kernels here."


@pytest.fixture
def recorded_gpu(monkeypatch):
    """A process that sees a GPU and whose checks return the H100's rows (``rows`` may be edited)."""
    rows = {r["check"]: dict(r) for r in H100_ROWS}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(doctor, "environment", lambda: [("device", "NVIDIA H100 80GB HBM3 (1 visible)")])
    monkeypatch.setattr(doctor, "run_check", lambda check, on_gpu: on_gpu and rows[check.name])
    monkeypatch.setattr(doctor.subprocess, "run", lambda *a, **k: pytest.fail("no re-run with a GPU"))
    return rows


def test_gpu_report_of_the_recorded_h100_run(recorded_gpu, capsys):
    doctor.main([])  # every kernel ok: no SystemExit
    out = capsys.readouterr().out
    assert H100_TABLE in out and out.rstrip().endswith(H100_VERDICT)
    assert "interpreter" not in out and "device: NVIDIA H100 80GB HBM3 (1 visible)" in out


def test_gpu_report_of_a_kernel_that_failed_or_missed_its_tolerance(recorded_gpu, capsys):
    """A compile error and an error over its tolerance (0.031 > 3e-2) are FAIL rows, named in the verdict,
    with exit status 1; an error at its tolerance (0.02) passes."""
    recorded_gpu["row-wise MultiMax (DeiT-small scores)"].update(error=0.02, ok=True)
    recorded_gpu["attention (DeiT-small)"].update(error=0.031, ok=False)
    recorded_gpu["cross-entropy (LM vocabulary)"].update(
        error="CompilationError: out of resource: shared memory",
        ok=False,
        ms={"triton": "CompilationError", "reference": 3.381875991821289, "compile": 0.9709327936172485},
    )
    with pytest.raises(SystemExit) as exit_info:
        doctor.main([])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    rows = {r[0]: r[1:] for r in table_rows(out)}
    assert rows["row-wise MultiMax (DeiT-small scores)"][2:] == ["0.02 (2e-02)", "0.924", "3.93", "0.82", "ok"]
    assert rows["attention (DeiT-small)"][2:] == ["0.031 (3e-02)", "0.973", "4.07", "1.33", "FAIL"]
    assert rows["cross-entropy (LM vocabulary)"][2:] == [
        "CompilationError: out of resource: shared memory",
        "CompilationError",
        "3.38",
        "0.971",
        "FAIL",
    ]
    assert (
        "VERDICT: FAIL for attention (DeiT-small), cross-entropy (LM vocabulary). Backend 'auto' falls back "
        "to 'compile' for a kernel that fails to compile or launch"
    ) in out


def test_without_a_gpu_or_the_interpreter_the_doctor_reruns_itself_under_the_interpreter(monkeypatch):
    """The interpreter must be on before Triton defines a kernel: a fresh process with TRITON_INTERPRET=1,
    whose exit status is the doctor's; with it already on, no new process."""
    import sys

    runs = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        doctor.subprocess, "run", lambda cmd, env: runs.append((cmd, env)) or type("Done", (), {"returncode": 3})()
    )
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        doctor.main([])
    assert exit_info.value.code == 3
    [(cmd, env)] = runs
    assert cmd == [sys.executable, "-m", "mmlight.doctor"] and env["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # set, but off: still a fresh process with it on
    with pytest.raises(SystemExit):
        doctor.main([])
    assert len(runs) == 2 and runs[1][1]["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(doctor, "CHECKS", [])
    doctor.main([])  # runs in this process: nothing new started
    assert len(runs) == 2


def stand_in(off_by: float = 0.0, fails: bool = False):
    """A check's ``run``: MultiMax through the reference, the "triton" backend ``off_by`` too large (or
    raising as a kernel that does not launch)."""

    def run(module, inputs, backend):
        if backend == "triton" and fails:
            raise RuntimeError("out of resources: shared memory, required 233472 > 232448\nmore text")
        return module.compute(inputs[0], None, "reference") * (1 + off_by if backend == "triton" else 1)

    return run


@pytest.fixture
def gpu_on_the_cpu(monkeypatch):
    """The GPU branch of ``run_check`` run on the CPU: bf16 there, and do_bench stood in for (one call,
    0.5 ms), so that its placement, tolerance and timing logic runs where no GPU is."""
    import triton.testing

    monkeypatch.setattr(doctor, "placement", lambda on_gpu: ("cpu", torch.bfloat16 if on_gpu else torch.float32))
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep: (fn(), 0.5)[1])


@pytest.mark.parametrize("off_by, ok", [(0.0, True), (0.05, False)])
def test_gpu_check_judges_bf16_against_the_fp32_reference_with_the_checks_tolerance(gpu_on_the_cpu, off_by, ok):
    """bf16 inputs against the fp32 reference of the same values: the bf16 rounding alone (above the fp32
    tolerance, below the check's) passes; 5% too large fails; every backend is timed."""
    check = doctor.Check("stand-in", (2, 3, 9), (1, 2, 5), doctor._scores, stand_in(off_by), 2e-2)
    row = doctor.run_check(check, on_gpu=True)
    assert (row["shape"], row["dtype"], row["tolerance"], row["ok"]) == ("2x3x9", "bfloat16", 2e-2, ok)
    assert (doctor.FP32_TOLERANCE < row["error"] < 2e-2) if ok else row["error"] > 0.04
    assert row["ms"] == {"triton": 0.5, "reference": 0.5, "compile": 0.5}


def test_cpu_check_uses_fp32_the_small_shape_and_the_fp32_tolerance(gpu_on_the_cpu):
    check = doctor.Check("stand-in", (2, 3, 9), (1, 2, 5), doctor._scores, stand_in(1e-3), 2e-2)
    row = doctor.run_check(check, on_gpu=False)
    assert (row["shape"], row["dtype"], row["tolerance"], row["ok"]) == (
        "1x2x5",
        "float32",
        doctor.FP32_TOLERANCE,
        False,
    )
    assert row["error"] == pytest.approx(1e-3, rel=1e-2) and "ms" not in row  # output and gradients 0.1% off


def test_gpu_check_of_a_kernel_that_does_not_launch(gpu_on_the_cpu):
    """The first line of the error, named, is the finding; the kernel's timing is the error's name."""
    check = doctor.Check("stand-in", (2, 3, 9), (1, 2, 5), doctor._scores, stand_in(fails=True), 2e-2)
    row = doctor.run_check(check, on_gpu=True)
    assert row["error"] == "RuntimeError: out of resources: shared memory, required 233472 > 232448"
    assert row["ok"] is False and row["ms"] == {"triton": "RuntimeError", "reference": 0.5, "compile": 0.5}


def test_placement_is_bf16_on_the_gpu_and_fp32_under_the_interpreter():
    """What the module docstring promises (the tests above stand in for it to run the GPU branch here)."""
    assert doctor.placement(True) == ("cuda", torch.bfloat16)
    assert doctor.placement(False) == ("cpu", torch.float32)
