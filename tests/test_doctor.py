"""``mmlight doctor`` on a machine without a GPU: the interpreter checks (tests/conftest.py sets
``TRITON_INTERPRET=1``, so they run in-process)."""

import pytest
import torch

from mmlight import doctor

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU branch of the doctor")


def table_rows(output: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines()
            if line.startswith("| ") and not line.startswith("| check")]


def test_cpu_report_checks_every_kernel(capsys):
    doctor.main([])
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "triton: " in out and "torch: " in out
    rows = table_rows(out)
    assert [r[0] for r in rows] == [c.name for c in doctor.CHECKS]
    for name, shape, dtype, error, verdict in rows:
        assert dtype == "float32" and verdict == "ok", name
        assert float(error.split()[0]) <= doctor.FP32_TOLERANCE
    assert "VERDICT: no GPU here" in out


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
