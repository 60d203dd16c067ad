"""``mmlight doctor``: on a machine without a GPU, the interpreter checks (tests/conftest.py sets
``TRITON_INTERPRET=1``, so they run in-process); on every machine, the GPU branch's logic (placement,
tolerances, timings, the table, the verdicts, the exit status, the re-run under the interpreter) from
a run recorded on an H100 and from stand-in kernels, so that it is tested where no GPU is."""

import pytest
import torch

from mmlight.commands import doctor

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
H100_VERDICT = (
    "VERDICT: every kernel matches the reference; backend 'auto' will use the Triton kernels here, but 'compile' "
    "is faster for row-wise MultiMax (DeiT-small scores) (0.924 ms against 0.82 ms); cross-entropy (LM "
    "vocabulary) (1.07 ms against 0.971 ms). Where a model runs those kernels, --model.init_args.model.backend "
    "compile is the faster choice on this device."
)


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


def test_gpu_verdict_when_every_kernel_beats_compile(recorded_gpu, capsys):
    """The H100's rows with the two kernels that lost to ``compile`` made faster than it, or as fast."""
    recorded_gpu["row-wise MultiMax (DeiT-small scores)"]["ms"] = {"triton": 0.5, "reference": 3.9, "compile": 0.82}
    recorded_gpu["cross-entropy (LM vocabulary)"]["ms"] = {"triton": 0.971, "reference": 3.4, "compile": 0.971}  # a tie
    doctor.main([])
    verdict = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert verdict == (
        "VERDICT: every kernel matches the reference and none is slower than 'compile' here; "
        "backend 'auto' will use the Triton kernels here."
    )


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


def test_a_kernel_that_passes_beside_a_compile_backend_that_failed_fails(gpu_on_the_cpu, monkeypatch, capsys):
    """The kernel matches the reference, but ``compile`` (the fallback of ``backend: auto``) raises when timed:
    a FAIL row naming the backend's error, the failing verdict and exit status 1, not "none is slower"."""
    import triton.testing

    def do_bench(fn, warmup, rep):
        fn()
        return 0.5

    def run(module, inputs, backend):
        if backend == "compile":
            raise RuntimeError("BackendCompilerFailed: inductor raised")
        return stand_in()(module, inputs, backend)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    row = doctor.run_check(doctor.Check("stand-in", (2, 3, 9), (1, 2, 5), doctor._scores, run, 2e-2), on_gpu=True)
    assert isinstance(row["error"], float) and row["error"] < 2e-2  # the kernel itself is right
    assert row["ms"] == {"triton": 0.5, "reference": 0.5, "compile": "RuntimeError"} and row["ok"] is False
    assert doctor.failed_backends(row) == ["compile: RuntimeError"]
    assert doctor.verdict([row], on_gpu=True).startswith("VERDICT: FAIL for stand-in (compile: RuntimeError). ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(doctor, "environment", lambda: [])
    monkeypatch.setattr(doctor, "run_check", lambda check, on_gpu: dict(row, check=check.name))
    with pytest.raises(SystemExit) as exit_info:
        doctor.main([])
    assert exit_info.value.code == 1
    rows = table_rows(capsys.readouterr().out)
    assert [r[-2:] for r in rows] == [["RuntimeError", "FAIL"]] * len(doctor.CHECKS)


def test_recorded_rows_with_a_failed_reference_or_compile_backend_fail_and_name_it():
    """Judged from the timings alone (the H100's first row): either fallback backend failing fails the row;
    the kernel's own failure is named by its error, not twice."""
    row = dict(H100_ROWS[0], ms={"triton": 0.9, "reference": "OutOfMemoryError", "compile": "BackendCompilerFailed"})
    assert doctor.failed_backends(row) == ["reference: OutOfMemoryError", "compile: BackendCompilerFailed"]
    assert doctor.failed_backends(dict(row, ms={"triton": "CompilationError", "reference": 1.0, "compile": 1.0})) == []
    assert doctor.failed_backends(H100_ROWS[0]) == [] and doctor.failed_backends({"ok": True}) == []
    failed = doctor.verdict([dict(row, ok=False)], on_gpu=True)
    assert failed.startswith(
        "VERDICT: FAIL for row-wise MultiMax (DeiT-small scores) (reference: OutOfMemoryError) "
        "(compile: BackendCompilerFailed). Backend 'auto' falls back"
    )


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
    assert cmd == [sys.executable, "-m", "mmlight.commands.doctor"] and env["TRITON_INTERPRET"] == "1"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # set, but off: still a fresh process with it on
    monkeypatch.setattr(sys, "argv", ["mmlight doctor"])  # the console script: main() reads sys.argv
    with pytest.raises(SystemExit):
        doctor.main()
    assert len(runs) == 2 and runs[1] == ([sys.executable, "-m", "mmlight.commands.doctor"], runs[1][1])
    assert runs[1][1]["TRITON_INTERPRET"] == "1"
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


# ---------------------------------------------------------------------------- the pieces, against references


def test_gpu_checks_are_the_shapes_and_tolerances_of_the_recorded_h100_run():
    """The GPU shapes are DeiT-small's (6 heads over 197 tokens, heads of 64), causal N=1024 and the
    267,744-word LM vocabulary, as in the module docstring and the recorded H100 table."""
    assert [(c.name, "x".join(map(str, c.gpu_shape)), c.tolerance) for c in doctor.CHECKS] == [
        (r["check"], r["shape"], r["tolerance"]) for r in H100_ROWS
    ]


# The table `mmlight doctor` printed without a GPU (2-core x86_64 VM, torch 2.14.1, Triton 3.8.0, 2026-11-25):
# check, shape and dtype columns, and the tolerance 1e-04 of every row (the errors, 3.4e-07 to 1e-06, depend
# on the platform).
CPU_ROWS = [
    ("row-wise MultiMax (DeiT-small scores)", "2x2x13x13", "float32"),
    ("attention (DeiT-small)", "1x2x19x16", "float32"),
    ("causal attention N=1024", "1x2x37x16", "float32"),
    ("cross-entropy (LM vocabulary)", "3x300", "float32"),
]


def test_interpreter_checks_are_the_tiny_shapes_of_the_recorded_cpu_run(gpu_on_the_cpu):
    """Each check's CPU branch at its recorded shape (sequence lengths that fill no tile of 16 exactly)."""
    rows = [
        doctor.run_check(doctor.Check(c.name, c.gpu_shape, c.cpu_shape, c.make, stand_in(), c.tolerance), False)
        for c in doctor.CHECKS
    ]
    assert [(r["check"], r["shape"], r["dtype"]) for r in rows] == CPU_ROWS
    assert all(r["tolerance"] == 1e-4 for r in rows)  # the table's "(1e-04)": the kernels agree to ~1e-6 in fp32


def test_environment_of_a_gpu_machine(monkeypatch):
    """The device lines from torch.cuda (stood in for: an H100 with 80 GiB)."""
    import sys

    import PIL
    import triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    props = type("Props", (), {"total_memory": 85_520_809_984})()  # an H100 80GB HBM3: 79.6 GiB
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: index == 0 and props)
    lines = doctor.environment()
    assert lines[:3] == [
        ("python", ".".join(map(str, sys.version_info[:3]))),
        ("torch", torch.__version__),
        ("triton", triton.__version__),
    ]
    assert lines[3] == ("CUDA (torch built with)", str(torch.version.cuda))
    assert lines[4][0] == "image decode and resize" and lines[4][1].endswith(f" {PIL.__version__}")
    assert lines[5:] == [
        ("device", "NVIDIA H100 80GB HBM3 (2 visible)"),
        ("compute capability", "9.0 (sm_90)"),
        ("memory", "80 GiB"),
    ]


def test_environment_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = doctor.environment()
    assert [name for name, _ in lines] == [
        "python",
        "torch",
        "triton",
        "CUDA (torch built with)",
        "image decode and resize",
        "device",
    ]
    assert lines[-1] == ("device", "no CUDA GPU (torch.cuda.is_available() is False)")


@pytest.mark.parametrize(
    "actual, expected, error",
    [
        ([1.0, 2.5, -3.0], [1.0, 2.0, -4.0], 0.25),  # largest difference 1 over largest magnitude 4
        ([0.5, -0.5], [0.5, -0.5], 0.0),
        ([0.5, 0.0], [0.0, 0.0], 5e29),  # an all-zero reference: over 1e-30, not a division by zero
        ([float("nan"), 1.0], [1.0, 1.0], float("inf")),
        ([float("-inf"), 1.0], [1.0, 1.0], float("inf")),
    ],
)
def test_relative_error(actual, expected, error):
    assert doctor.relative_error(torch.tensor(actual), torch.tensor(expected)) == pytest.approx(error, rel=1e-12)


def test_relative_error_is_taken_in_float64():
    """bf16 values whose difference is below bf16's resolution at their size are still told apart."""
    actual = torch.tensor([256.0], dtype=torch.bfloat16)
    expected = torch.tensor([257.0])  # not a bf16 value: the reference is fp32
    assert doctor.relative_error(actual, expected) == pytest.approx(1 / 257, rel=1e-12)


# an output of every rank: the whole tensor (B, nh, T), one row (T,), or a scalar (cross-entropy)
REDUCE = {"none": lambda out: out, "row": lambda out: out[1, 2], "sum": lambda out: out.sum()}


@pytest.mark.parametrize("reduce", REDUCE)
def test_forward_backward_is_the_output_and_the_gradients_of_a_fixed_projection(reduce):
    """Against autograd on ``sum(out * cos(0, 1, 2, ...))`` (a scalar output: its plain gradient), for the
    input that requires grad and the 8 MultiMax parameters, in that order."""
    gen = torch.Generator().manual_seed(3)
    scores = doctor._scores((2, 3, 5), torch.float64, "cpu", gen)
    module = doctor._multimax("cpu").double()

    def run(module, inputs, backend):
        return REDUCE[reduce](module.compute(inputs[0], None, backend))

    check = doctor.Check("stand-in", (2, 3, 5), (2, 3, 5), doctor._scores, run, 1e-2)
    got = doctor._forward_backward(check, module, scores, "reference")
    out = run(module, scores, "reference")
    weight = torch.cos(torch.arange(out.numel(), dtype=torch.float64)).reshape(out.shape)
    want = [
        out,
        *torch.autograd.grad((out * weight).sum() if out.dim() else out, [scores[0], module.ranges, module.ts]),
    ]
    assert len(got) == 4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)  # the doctor's cosines are fp32
    assert all(g.abs().max() > 0 for g in got[1:])  # the parameters bend sigma: every gradient counts


def test_forward_backward_stays_on_the_outputs_device():
    """On the meta device: an upstream gradient made elsewhere would not match the output."""
    module = doctor._multimax("meta")
    check = doctor.Check("stand-in", (2, 3, 5), (2, 3, 5), doctor._scores, doctor._rowwise, 1e-2)
    got = doctor._forward_backward(check, module, doctor._scores((2, 3, 5), torch.float32, "meta", None), "reference")
    assert [g.device.type for g in got] == ["meta"] * 4


def test_multimax_parameters_bend_sigma():
    """The doctor's MultiMax is far from softmax (the 0.02-std init nearly is softmax), so that a kernel
    that ignored its parameters would fail the check."""
    module = doctor._multimax("cpu")
    x = 3 * torch.randn(4, 13, generator=torch.Generator().manual_seed(0))
    assert (module.compute(x, None, "reference") - torch.softmax(x, -1)).abs().max() > 0.05


# What the recorded H100 run used besides the shapes (the doctor's settings since it was written): MultiMax
# parameters that bend sigma visibly and inputs drawn from a generator seeded 0. Its errors are reproducible
# only with these.
H100_RANGES, H100_TS, H100_SEED = (-0.5, 0.5, -1.0, 1.0), (0.3, 0.2, 0.1, 0.05), 0


def test_multimax_of_the_recorded_run_on_the_device_asked_for():
    module = doctor._multimax("cpu")
    assert module.ranges.tolist() == list(H100_RANGES)
    assert module.ts.tolist() == pytest.approx(H100_TS, rel=1e-7)  # fp32 parameters
    meta = doctor._multimax("meta")
    assert meta.ranges.device.type == meta.ts.device.type == "meta"


def test_inputs_are_made_on_the_device_asked_for_from_the_generator_given():
    """On the meta device (a tensor made elsewhere would not be there), and the same generator seed gives the
    same inputs whatever torch's global generator does."""
    for make, shape in [(doctor._scores, (2, 3)), (doctor._qkv, (1, 2, 3, 4)), (doctor._logits, (3, 5))]:
        assert all(t.device.type == "meta" for t in make(shape, torch.bfloat16, "meta", torch.Generator()))
        torch.manual_seed(1)
        first = make(shape, torch.float32, "cpu", torch.Generator().manual_seed(7))
        torch.manual_seed(2)
        again = make(shape, torch.float32, "cpu", torch.Generator().manual_seed(7))
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_run_check_draws_the_inputs_of_the_recorded_run(gpu_on_the_cpu):
    """The check's inputs come from a generator seeded as in the recorded run, on the check's device, in its
    dtype, at its shape for that branch."""
    made = []

    def make(shape, dtype, device, gen):
        made.append((shape, dtype, device, gen.initial_seed(), gen.device.type))
        return doctor._scores(shape, dtype, device, gen)

    check = doctor.Check("stand-in", (2, 3, 9), (1, 2, 5), make, stand_in(), 2e-2)
    doctor.run_check(check, on_gpu=True)
    doctor.run_check(check, on_gpu=False)
    assert made == [
        ((2, 3, 9), torch.bfloat16, "cpu", H100_SEED, "cpu"),
        ((1, 2, 5), torch.float32, "cpu", H100_SEED, "cpu"),
    ]


def test_run_check_backends_device_and_timing(gpu_on_the_cpu, monkeypatch):
    """The reference on the ``reference`` backend, then the kernel on ``triton``; then each backend warmed up
    once and timed by do_bench with the recorded run's settings (5 ms warm-up, 30 ms of repetitions).
    The generator and the MultiMax are made on the check's device."""
    import triton.testing

    calls, benches, generators, modules = [], [], [], []

    def run(module, inputs, backend):
        calls.append(backend)
        return module.compute(inputs[0], None, "reference")

    def do_bench(fn, warmup, rep):
        benches.append((warmup, rep))
        fn()
        return 0.25

    generator, multimax = torch.Generator, doctor._multimax
    monkeypatch.setattr(torch, "Generator", lambda device: generators.append(device) or generator(device))
    monkeypatch.setattr(doctor, "_multimax", lambda device: modules.append(device) or multimax(device))
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    row = doctor.run_check(doctor.Check("stand-in", (2, 3, 9), (1, 2, 5), doctor._scores, run, 2e-2), on_gpu=True)
    assert row["ok"] and row["ms"] == {"triton": 0.25, "reference": 0.25, "compile": 0.25}
    assert calls == ["reference", "triton", "triton", "triton", "reference", "reference", "compile", "compile"]
    assert benches == [(5, 30)] * 3
    assert generators == modules == ["cpu"]


def test_check_with_integer_inputs(gpu_on_the_cpu):
    """Cross-entropy's integer targets stay integers in the fp32 reference (only floating inputs are copied)."""

    def run(module, inputs, backend):
        return doctor._cross_entropy(module, inputs, "reference")

    row = doctor.run_check(doctor.Check("stand-in", (4, 50), (4, 50), doctor._logits, run, 2e-2), on_gpu=True)
    assert row["ok"] is True and 0 < row["error"] < 2e-2  # bf16 logits against their fp32 copies


def test_inputs_of_the_checks():
    gen = torch.Generator().manual_seed(0)
    [scores] = doctor._scores((4, 5000), torch.bfloat16, "cpu", gen)
    assert scores.dtype == torch.bfloat16 and scores.requires_grad and scores.shape == (4, 5000)
    assert 2.8 < scores.float().std() < 3.2  # 3 x standard normal: scores spread like trained attention logits
    q, k, v = doctor._qkv((1, 2, 7, 4), torch.bfloat16, "cpu", gen)
    assert all(t.shape == (1, 2, 7, 4) and t.dtype == torch.bfloat16 and t.requires_grad for t in (q, k, v))
    assert not torch.equal(q, k) and not torch.equal(k, v)
    logits, targets = doctor._logits((500, 3), torch.bfloat16, "cpu", gen)
    assert logits.shape == (500, 3) and logits.dtype == torch.bfloat16 and logits.requires_grad
    assert 2.7 < logits.float().std() < 3.3
    assert targets.shape == (500,) and targets.dtype == torch.int64 and set(targets.tolist()) == {0, 1, 2}


def test_check_at_exactly_its_tolerance_passes(gpu_on_the_cpu):
    """``error <= tolerance``: the same check again with its tolerance set to the error it measured."""
    check = doctor.Check("stand-in", (2, 3, 9), (1, 2, 5), doctor._scores, stand_in(0.05), 2e-2)
    error = doctor.run_check(check, on_gpu=True)["error"]
    check.tolerance = error
    row = doctor.run_check(check, on_gpu=True)
    assert row["error"] == error and row["ok"] is True


def test_a_long_error_message_is_cut_at_120_characters(gpu_on_the_cpu):
    def run(module, inputs, backend):
        raise RuntimeError("  " + "x" * 130 + "\nsecond line")

    row = doctor.run_check(doctor.Check("stand-in", (2, 3, 9), (1, 2, 5), doctor._scores, run, 2e-2), on_gpu=False)
    assert row["error"] == "RuntimeError: " + "x" * 120 and row["ok"] is False


def test_cpu_table_and_verdicts():
    rows = [
        {"check": "a", "shape": "1x2", "dtype": "float32", "tolerance": 1e-4, "error": 3.2e-7, "ok": True},
        {"check": "b", "shape": "3", "dtype": "float32", "tolerance": 1e-4, "error": "KeyError: 'x'", "ok": False},
    ]
    assert doctor.render(rows, on_gpu=False) == (
        "| check | shape | dtype | max error (tolerance) | verdict |\n"
        "|---|---|---|---|---|\n"
        "| a | 1x2 | float32 | 3.2e-07 (1e-04) | ok |\n"
        "| b | 3 | float32 | KeyError: 'x' | FAIL |"
    )
    rows.append(dict(rows[1], check="c"))
    assert doctor.verdict(rows, on_gpu=False) == (
        "VERDICT: no GPU, and the interpreter check FAILED for b, c: the installation is broken."
    )
    assert doctor.verdict(rows, on_gpu=True) == (
        "VERDICT: FAIL for b, c. Backend 'auto' falls back to 'compile' for a kernel that fails to compile or "
        "launch (with a warning); a wrong result is a bug: please report this output."
    )
    assert doctor.verdict(rows[:1], on_gpu=False) == (
        "VERDICT: no GPU here. The kernels are correct under Triton's CPU interpreter (tiny fp32 shapes); "
        "backend 'auto' uses the reference code on this machine. Run `mmlight doctor` again on the GPU "
        "machine; `python benchmarks/compile_report.py --matrix shipped` compiles the kernels for sm_80/sm_90 "
        "without one."
    )


def test_cpu_report_says_what_it_checks(monkeypatch, capsys):
    """Without a GPU (and the interpreter on): the environment, the notice, the table and the verdict."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(doctor, "environment", lambda: [("device", "no CUDA GPU")])
    row = {"check": "a", "shape": "1x2", "dtype": "float32", "tolerance": 1e-4, "error": 3.2e-7, "ok": True}
    monkeypatch.setattr(doctor, "run_check", lambda check, on_gpu: not on_gpu and dict(row, check=check.name))
    doctor.main([])
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [
        "                  device: no CUDA GPU",
        "",
        "No CUDA GPU: checking the kernels under Triton's CPU interpreter at tiny shapes, no timings.",
    ]
    assert out[4] == "| check | shape | dtype | max error (tolerance) | verdict |"
    assert [line.split(" | ")[0] for line in out[6:10]] == [f"| {c.name}" for c in doctor.CHECKS]
    assert out[10:12] == ["", doctor.verdict([row], on_gpu=False)]


def test_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        doctor.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mmlight doctor [-h]\n")
    assert "``mmlight doctor``: the first command to run on a new GPU machine.\n" in out
    assert "It prints the device" not in out  # the first paragraph of the docstring only


def test_each_check_runs_its_computation_on_the_backend_asked_for(monkeypatch):
    """Each check's ``run`` on the reference backend against the computation written out (float64), and the
    backend it is given is the one the kernel runs on (recorded from the calls)."""
    import importlib

    from mmlight.nn.attention import attention

    module = doctor._multimax("cpu").double()
    gen = torch.Generator().manual_seed(5)
    [scores] = doctor._scores((2, 7), torch.float64, "cpu", gen)
    q, k, v = doctor._qkv((1, 2, 6, 4), torch.float64, "cpu", gen)
    logits, targets = doctor._logits((5, 11), torch.float64, "cpu", gen)
    assert [c.run for c in doctor.CHECKS[::3]] == [doctor._rowwise, doctor._cross_entropy]
    rowwise, cross_entropy = doctor._rowwise, doctor._cross_entropy
    noncausal, causal = doctor._attention(False), doctor._attention(True)  # made here, not at import

    def close(actual, expected):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-12)

    close(rowwise(module, [scores], "reference"), torch.softmax(module.modulate(scores), -1))
    lower = torch.ones(6, 6, dtype=torch.bool).tril()
    for run, mask in [(noncausal, None), (doctor.CHECKS[1].run, None), (causal, lower), (doctor.CHECKS[2].run, lower)]:
        close(run(module, [q, k, v], "reference"), attention(q, k, v, module, mask=mask, backend="reference"))
    close(
        cross_entropy(module, [logits, targets], "reference"),
        torch.nn.functional.cross_entropy(module.modulate(logits), targets),
    )

    calls = []
    compute = module.compute
    monkeypatch.setattr(
        module, "compute", lambda s, mask, backend: calls.append(backend) or compute(s, mask, "reference")
    )
    monkeypatch.setattr(
        importlib.import_module("mmlight.nn.attention"),  # the package's ``attention`` is the function
        "attention",
        lambda *args, is_causal, backend: calls.append((is_causal, backend)) or args[0],
    )
    rowwise(module, [scores], "triton")
    noncausal(module, [q, k, v], "compile")
    causal(module, [q, k, v], "triton")
    assert calls == ["triton", (False, "compile"), (True, "triton")]
    module.backend = "reference"
    cross_entropy(module, [logits, targets], "compile")
    assert module.backend == "compile"
