"""benchmarks/gpu_run.py, the prepared device run: its ``--smoke`` run on the CPU (interpreter, tiny
shapes) writes every section's records, tile rows that the kernels' config functions honour, and a
file that benchmarks/report.py renders. Timings here mean nothing; the records and their wiring do."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmlight.kernels import attention, tiles
from mmlight.kernels.tiles import BlockConfig

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"env", "sweep", "attention", "step", "profile", "rowwise", "cross_entropy", "compiled", "fit"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The records of one ``--smoke`` run and its output folder."""
    out = tmp_path_factory.mktemp("gpu_run")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), "--smoke", "--out", str(out)],
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
    )
    (path,) = out.glob("gpu_run-cpu-torch*_triton*-*-smoke.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()], out, path


@pytest.mark.slow
def test_smoke_run_covers_every_section(smoke_run):
    records, out, _ = smoke_run
    assert {r["section"] for r in records if r["kind"] == "section"} == SECTIONS
    assert not [r for r in records if r["kind"] == "error"]
    # what needs CUDA is recorded as skipped, with the reason
    skipped = {(r["section"], r.get("what")) for r in records if r["kind"] == "skipped"}
    assert ("compiled", "torch.compile of the training step") in skipped
    assert ("step", "softmax (SDPA cuDNN)") in skipped
    # every candidate was checked against fp32 and passed at these shapes
    checks = [r for r in records if r["kind"] == "check"]
    assert len(checks) == 2 * (1 + 3 + 2 * _switches())
    assert all(r["ok"] and r["error"] < 1e-4 for r in checks)
    backends = {r["backend"] for r in records if r["kind"] == "timing" and r["op"] == "attention"}
    assert {
        "multimax/triton shipped",
        "multimax/triton tuned, no param grads",
        "softmax/triton tuned (order 0)",
    } <= backends
    steps = [r["backend"] for r in records if r["kind"] == "step"]
    assert steps == [
        "softmax (SDPA flash)",
        "multimax shipped",
        "multimax tuned",
        "multimax attention, plain CE (tuned)",
        "softmax attention (SDPA flash), multimax output",
    ]
    assert all(r["step_ms"] > 0 for r in records if r["kind"] == "step")
    profiles = (out / "profiles.txt").read_text()
    assert "## softmax (SDPA flash)" in profiles and "## multimax tuned" in profiles and "Self CPU" in profiles


@pytest.mark.slow
def test_smoke_fits_log_their_images_per_second(smoke_run):
    """Each DeiT-small config ran as ``mmlight fit`` on the generated shards, logged samples/s past its
    warm-up, and is set beside the eager step of its variant (images/s from that record's batch and ms)."""
    records, out, _ = smoke_run
    fits = {r["backend"]: r for r in records if r["kind"] == "fit"}
    assert set(fits) == {"deit_small_multimax", "deit_small_softmax"}
    steps = {r["backend"]: r for r in records if r["kind"] == "step"}
    for fit in fits.values():
        assert fit["smoke"] and not fit["compiled"] and "error" not in fit
        assert fit["images_per_s"] > 0 and fit["windows"] >= 1 and fit["end_of_fit_images_per_s"] > 0
        # TensorBoard steps are 0-based: the fit ran its 20 steps
        assert fit["last_logged_step"] == fit["max_steps"] - 1 > fit["steady_from_step"]
        step = steps[fit["step_backend"]]
        assert not step["compiled"]
        step_rate = step["shape"][0] * 1000 / step["step_ms"]
        assert fit["step_images_per_s"] == pytest.approx(step_rate)
        assert fit["fit_to_step"] == pytest.approx(fit["images_per_s"] / step_rate, abs=5e-4 + 1e-12)  # 3 decimals
    assert "mmlight.cli" in (out / "fit.log").read_text()


def _in_benchmarks(code: str, stdin: str = "") -> str:
    """The output of ``code`` run by Python from ``benchmarks/``, so that it imports the scripts as they
    import each other (beside one another), in a process of its own."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        cwd=ROOT / "benchmarks",
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _switches() -> int:
    """How many attention kernel switches this code base has (each is checked on and off)."""
    return int(_in_benchmarks("from gpu_run import present_switches; print(len(present_switches()))"))


@pytest.mark.slow
def test_tile_rows_are_what_the_config_functions_read(smoke_run, monkeypatch):
    """Pasted into tiles.MEASURED, the rows the run wrote are the tiles the kernels then launch."""
    records, out, _ = smoke_run
    rows = eval("{" + (out / "tile_rows.py").read_text() + "}", {"BlockConfig": BlockConfig})
    tuned = {r["shape_name"]: r["configs"] for r in records if r["kind"] == "tuned"}
    monkeypatch.setattr(tiles, "MEASURED", rows)
    # the smoke shapes: (1, 2, 19, 16) non-causal and (1, 2, 21, 16) causal, fp32, keyed for sm_90
    for name, causal, n in (("deit", False, 19), ("causal", True, 21)):
        want = {k: BlockConfig(**c) for k, c in tuned[name].items()}
        assert attention.forward_config(16, torch.float32, 90, causal, n) == want["forward"]
        assert attention.backward_configs(16, torch.float32, 90, causal, n) == (want["dkdv"], want["dq"])
    # another capability has no row: the offline choice
    assert attention.forward_config(16, torch.float32, 80, False, 19) == attention.forward_config(16, torch.float32, 80)


@pytest.mark.slow
def test_report_renders_the_run(smoke_run):
    records, _, path = smoke_run
    report = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), str(path)], check=True, capture_output=True, text=True
    ).stdout
    step_rows = [line for line in report.splitlines() if line.startswith("| multimax tuned |")]
    step = next(r for r in records if r["kind"] == "step" and r["backend"] == "multimax tuned")
    assert len(step_rows) == 1 and f"{step['step_ratio']:.3g}" in step_rows[0]
    assert "#### Targets" in report and "#### Tile sweep" in report and "compiled: torch.compile" in report
    fit = next(r for r in records if r["kind"] == "fit" and r["backend"] == "deit_small_multimax")
    fit_rows = [line for line in report.splitlines() if line.startswith("| `deit_small_multimax.yaml` (smoke) |")]
    assert len(fit_rows) == 1 and fit_rows[0].endswith(
        f"| multimax shipped | {fit['step_images_per_s']:.4g} | {fit['fit_to_step']:.3g} |"
    )


def test_report_targets_from_synthetic_records():
    """The targets table reads each ratio from the right record, and judges it against its bound."""
    versions = {"device": "X", "torch": "t", "triton": "r"}
    records = [
        {**versions, "kind": "ceiling", "copy_gbps": 1000.0},
        {
            **versions,
            "kind": "timing",
            "op": "attention",
            "backend": "sdpa/flash",
            "shape": [256, 6, 197, 64],
            "fwd_ratio": 1.0,
            "bwd_ratio": 1.0,
        },
        {
            **versions,
            "kind": "timing",
            "op": "attention",
            "backend": "multimax/triton tuned",
            "shape": [256, 6, 197, 64],
            "fwd_ratio": 1.1,
            "bwd_ratio": 1.9,
        },
        {
            **versions,
            "kind": "timing",
            "op": "attention_causal",
            "backend": "multimax/triton tuned",
            "shape": [8, 12, 4096, 64],
            "fwd_ratio": 1.25,
            "bwd_ratio": 2.5,
        },
        {**versions, "kind": "step", "backend": "softmax (SDPA flash)", "compiled": False, "step_ms": 60.0},
        {**versions, "kind": "step", "backend": "multimax tuned", "compiled": False, "step_ms": 62.4},
        {**versions, "kind": "timing", "op": "cross_entropy", "backend": "multimax/triton", "fwd_bwd_ratio": 0.6},
        {
            **versions,
            "kind": "timing",
            "op": "cross_entropy",
            "backend": "multimax/triton, X=True",
            "fwd_bwd_ratio": 0.4,
        },
        {
            **versions,
            "kind": "timing",
            "op": "cross_entropy",
            "backend": "multimax/triton, Y=True",
            "ok": False,
            "fwd_bwd_ratio": 0.1,
        },
        # 100 MB forward in 0.125 ms: 800 GB/s, 0.8 of the copy bandwidth
        {
            **versions,
            "kind": "timing",
            "op": "rowwise",
            "backend": "b",
            "ok": True,
            "fwd_ms": 0.125,
            "bytes_fwd": 100e6,
        },
        {**versions, "kind": "timing", "op": "rowwise", "backend": "c", "ok": False, "fwd_ms": 0.01, "bytes_fwd": 1e9},
    ]
    code = "import json, sys; from report import targets_table; print(json.dumps(targets_table(json.load(sys.stdin))))"
    lines = json.loads(_in_benchmarks(code, json.dumps(records)))
    table = {line.split(" | ")[0][2:]: line.split(" | ")[2:] for line in lines[2:]}
    assert table["attention (256, 6, 197, 64) forward / SDPA flash"] == ["1.1", "yes |"]
    assert table["attention (256, 6, 197, 64) backward / SDPA flash"] == ["1.9", "no |"]
    assert table["causal attention N = 1,024 forward / SDPA flash"] == ["–", "– |"]
    assert table["causal attention N = 4,096 forward / SDPA flash"] == ["1.25", "yes |"]
    assert table["causal attention N = 4,096 backward / SDPA flash"] == ["2.5", "no |"]
    assert table["DeiT-small step, MultiMax tuned / softmax (SDPA flash), eager"] == ["1.04", "yes |"]
    assert table["MultiMax cross-entropy fw + bw / F.cross_entropy (best setting)"] == ["0.4", "yes |"]
    assert table["row-wise forward, best config, of the measured copy bandwidth"] == ["0.8", "yes |"]


def test_budget_guard_skips_and_records(tmp_path):
    """A section whose estimate exceeds the time left is not run, and a record says so."""
    code = f"""
import json
from pathlib import Path
from gpu_run import Run

run = Run(Path({str(tmp_path)!r}), budget_s=10.0, smoke=True)
ran = []
run.section("cheap", 1, lambda: ran.append("cheap"))
run.section("dear", 60, lambda: ran.append("dear"))
run.section("broken", 1, lambda: 1 / 0)
run.sink.close()
print(json.dumps([ran, str(run.path)]))
"""
    ran, path = json.loads(_in_benchmarks(code).splitlines()[-1])
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert ran == ["cheap"]
    assert [(r["kind"], r["section"]) for r in records] == [
        ("section", "cheap"),
        ("skipped", "dear"),
        ("error", "broken"),
        ("section", "broken"),
    ]
    assert "time budget" in records[1]["reason"] and "ZeroDivisionError" in records[2]["error"]


def test_fit_throughput_read_from_tensorboard(tmp_path):
    """The fit's figures are the mean of the windows logged after the warm-up step, read from the
    event file a SummaryWriter wrote (values chosen so that the mean is known by hand)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for step, rate, mfu in ((9, 1000.0, 0.5), (19, 20.0, 0.25), (29, 30.0, 0.5), (39, 52.0, 0.75)):
            writer.add_scalar("train/device/samples_per_sec", rate, step)
            writer.add_scalar("train/device/mfu", mfu, step)
        writer.add_scalar("lr-AdamW", 1e-4, 40)
    code = f"""
import json
from pathlib import Path
from gpu_run import logged_throughput

print(json.dumps(logged_throughput(Path({str(tmp_path)!r}), 15)))
"""
    read = json.loads(_in_benchmarks(code).splitlines()[-1])
    # steps 19, 29, 39 are past step 15: (20 + 30 + 52) / 3 and (0.25 + 0.5 + 0.75) / 3
    assert read == {
        "images_per_s": pytest.approx(34.0),
        "mfu": pytest.approx(0.5),
        "windows": 3,
        "last_logged_step": 40,
    }


def test_fit_error_is_the_exception_line():
    """A failed fit is recorded by the line that names its exception, also under a chained traceback
    and with output after it; a command-line error by its last line."""
    code = """
import json, sys
from gpu_run import last_error
print(json.dumps([last_error(text) for text in json.load(sys.stdin)]))
"""
    outputs = [
        "Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'x'\n\nDuring handling of the above "
        'exception, another exception occurred:\n\nTraceback (most recent call last):\n  File "b.py", line 2\n'
        "    f()\ntorch._dynamo.exc.Unsupported: graph break in layer 3\n  from user code\nEpoch 0: 5/30\n",
        "usage: mmlight fit [-h]\nmmlight fit: error: Key 'data.init_args.rot' is not expected\n",
        "",
    ]
    assert json.loads(_in_benchmarks(code, json.dumps(outputs))) == [
        "torch._dynamo.exc.Unsupported: graph break in layer 3",
        "mmlight fit: error: Key 'data.init_args.rot' is not expected",
        "",
    ]
