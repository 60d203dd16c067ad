"""The benchmark script runs end to end (tiny shapes, CPU interpreter) and writes the records
BENCHMARKS.md is built from. Timings here mean nothing; the fields and the side-by-side layout do."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"device", "torch", "triton", "op", "backend", "shape", "dtype", "fwd_ms", "bwd_ms", "gbps", "peak_mem_mb"}


@pytest.mark.slow
def test_smoke_run_writes_side_by_side_records(tmp_path):
    out = tmp_path / "smoke.jsonl"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_multimax.py"),
            "--smoke",
            "--backends",
            "reference",
            "triton",
            "--out",
            str(out),
        ],
        check=True,
        env=env,
        cwd=ROOT,
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(REQUIRED <= r.keys() for r in records)  # a schema: the timings themselves are measured, not known
    by_op = {}
    for r in records:
        by_op.setdefault(r["op"], []).append(r["backend"])
    assert by_op == {
        "rowwise": ["torch.softmax", "softmax/triton", "multimax/reference", "multimax/triton"],
        "cross_entropy": ["torch.cross_entropy", "multimax/reference", "multimax/triton"],
        "attention": ["sdpa", "multimax/reference", "multimax/triton"],
        "attention_causal": ["sdpa", "multimax/reference", "multimax/triton"],
        "vit_micro_train_step": ["softmax/sdpa", "multimax/reference", "multimax/triton"],
    }
    baselines = [r for r in records if r["backend"] in ("torch.softmax", "torch.cross_entropy", "sdpa", "softmax/sdpa")]
    assert all(r.get("fwd_ratio", r.get("step_ratio")) == 1.0 for r in baselines)
    rowwise = records[0]  # (2, 2, 19, 19) fp32: forward moves scores + weights, backward 3 tensors
    assert (rowwise["bytes_fwd"], rowwise["bytes_bwd"]) == (2 * 1444 * 4, 3 * 1444 * 4)
    assert rowwise["gbps"]["fwd"] == round(rowwise["bytes_fwd"] / rowwise["fwd_ms"] / 1e6, 1)

    report = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), str(out)], check=True, capture_output=True, text=True
    ).stdout
    headers = report.count("\n| op |") + report.count("\n| step |")  # the operators' table, the steps'
    op_rows = {(r["op"], str(r["shape"]), r["dtype"]) for r in records if "step_ms" not in r}
    steps = [r for r in records if "step_ms" in r]
    assert report.count("\n| ") - headers == len(op_rows) + len(steps)  # a row per operator shape, per step
    assert "multimax/triton" in report and "torch" in report


def test_refuses_to_run_without_a_gpu_unless_smoke(monkeypatch, capsys):
    """``main`` in this process (the script's own start, ``__main__``, runs in the smoke test above)."""
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is present: the full benchmark would run")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports its neighbours by name
    from benchmarks import bench_multimax

    with pytest.raises(SystemExit) as stop:
        bench_multimax.main([])
    assert stop.value.code != 0 and "need a CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_loader_benchmark_smoke_run_writes_side_by_side_records(tmp_path):
    """bench_loader.py on 12 generated photographs: the stage split for the three pipelines and both
    copy counts, the on-device step's CPU cost, every loader's rate with ratios to the baselines of the same run."""
    out = tmp_path / "loader.jsonl"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_loader.py"),
            "--images",
            "12",
            "--samples",
            "8",
            "--stage-samples",
            "4",
            "--batch-size",
            "4",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    images = records[0]
    assert images["op"] == "images" and images["images"] == 12 and images["mean_kib"] > 0
    stages = [r for r in records if r["op"] == "stage_ms_per_sample"]
    assert [(r["backend"], r["copies"]) for r in stages] == [
        (name, copies) for copies in (1, 3) for name in ("ImageFolder", "shards", "shards, uint8")
    ]
    for r in stages:
        assert r["total"] == pytest.approx(
            sum(r[k] for k in ("read", "decode", "augment", "collate", "transfer")), abs=0.01
        )
    device = [r for r in records if r["op"] == "device_step_ms_per_sample"]
    assert [(r["copies"], r["on"]) for r in device] == [(1, "cpu"), (3, "cpu")] and all(r["ms"] > 0 for r in device)
    loaders = {(r["backend"], r["copies"]): r for r in records if r["op"] == "image_loader_deit_train"}
    assert set(loaders) == {
        ("ImageFolder", 1),
        ("ImageFolder", 3),
        ("shards, per-copy decode", 1),
        ("shards, per-copy decode", 3),
        ("shards", 1),
        ("shards", 3),
        ("shards, no draft", 3),
        ("shards, uint8", 1),
        ("shards, uint8", 3),
    }
    assert loaders[("ImageFolder", 3)]["ratio_to_imagefolder"] == 1.0
    shards = loaders[("shards", 3)]
    per_copy = loaders[("shards, per-copy decode", 3)]["samples_per_s"]  # rates are rounded to 0.1 in the records
    assert shards["ratio_to_per_copy_shards"] == pytest.approx(shards["samples_per_s"] / per_copy, abs=0.005)
    # a schema (versions, device, measured rates: no value known in advance; the ratio above is checked)
    assert all({"torch", "timm", "pillow", "device", "samples_per_s_per_worker"} <= r.keys() for r in loaders.values())


def test_pillow_build_pixels_difference_against_a_hand_count():
    """The grey-level comparison of two dumps, on arrays whose differences are known."""
    from benchmarks.pillow_build_pixels import difference

    a = np.array([[0, 10, 200, 255], [5, 5, 5, 5]], np.uint8)
    b = np.array([[0, 11, 198, 16], [5, 5, 5, 5]], np.uint8)  # differences 0, 1, 2, 239 (no uint8 wrap-around)
    got = difference(a, b)
    assert got["max_levels"] == 239
    assert got["share_differing"] == 3 / 8 and got["share_differing_by_more_than_1"] == 2 / 8
    assert got["mean_abs_levels"] == pytest.approx((1 + 2 + 239) / 8)
    assert got["mean_a"] == pytest.approx(a.sum() / 8) and got["mean_b"] == pytest.approx(b.sum() / 8)
    with pytest.raises(ValueError, match="different shapes"):
        difference(a, b[:1])


def test_pillow_build_pixels_same_build_twice_is_identical(tmp_path):
    """Two dumps of the same images in one environment agree exactly (the seeds fix every draw), and
    dumps of different image sets are refused with a message, not a traceback."""
    from benchmarks import pillow_build_pixels as pixels

    for name, images in (("a", 3), ("b", 3), ("c", 2)):
        pixels.dump(tmp_path / "src", tmp_path / f"{name}.npz", images)
    pixels.main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--out", str(tmp_path / "same.json")])
    record = json.loads((tmp_path / "same.json").read_text())
    assert record["images"] == 3 and record["a"] == record["b"] and record["decoded_identical"] == 1.0
    for stage in ("crop", "augmented"):
        assert record[stage]["max_levels"] == 0 and record[stage]["share_differing"] == 0.0
    with pytest.raises(SystemExit, match="different images"):
        pixels.main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "c.npz")])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("a user's folder")
    with pytest.raises(SystemExit, match="no train/<wnid>/\\*.JPEG under"):
        pixels.main(["dump", "--src", str(tmp_path / "other"), "--out", str(tmp_path / "d.npz")])
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]  # nothing written into it
    with pytest.raises(SystemExit, match="--images must be >= 1, got 0"):
        pixels.main(["dump", "--src", str(tmp_path / "src"), "--out", str(tmp_path / "e.npz"), "--images", "0"])


@pytest.mark.slow
def test_reweighting_step_time_records_each_round_and_the_median_ratio(tmp_path):
    """Two functions, two rounds of 3 steps on the recall LM: every round has both medians, and each
    ratio is the median over rounds of the function's median over softmax's in the same round."""
    import statistics

    out = tmp_path / "steps.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "reweighting_step_time.py"),
            str(ROOT / "configs" / "quickstart" / "lm_softmax.yaml"),
            "--functions",
            "softmax",
            "sigmoid",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    record = json.loads(out.read_text())
    assert record["steps"] == 3 and len(record["rounds"]) == 2
    assert all(set(r) == {"softmax", "sigmoid"} and min(r.values()) > 0 for r in record["rounds"])
    assert record["median_ratio_to_softmax"]["softmax"] == 1.0
    want = statistics.median(r["sigmoid"] / r["softmax"] for r in record["rounds"])
    assert record["median_ratio_to_softmax"]["sigmoid"] == pytest.approx(want, rel=1e-12)


def test_fit_shards_cycle_the_generated_images_in_imagenet_layout(tmp_path, monkeypatch):
    """``fit_shards.py`` writes ``mmlight prepare imagenet``'s layout (a ``train`` split of ``jpg``/``cls``
    samples, 1,000 classes) whose samples cycle the generated pool; read back with ``tarfile``. Its
    ``main`` runs in this process (benchmarks/gpu_run.py's smoke test, tests/benchmarks/test_gpu_run.py,
    runs the script as a process of its own)."""
    import tarfile

    from PIL import Image

    from mmlight.data.shards import read_info

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script imports bench_loader by name
    from benchmarks import fit_shards

    out = tmp_path / "shards"
    fit_shards.main(["--out", str(out), "--samples", "5", "--distinct", "2", "--workers", "1"])
    info = read_info(out)
    assert len(info["classes"]) == 1000 and info["splits"]["train"]["num_samples"] == 5
    (shard,) = info["splits"]["train"]["shards"]
    with tarfile.open(out / shard["name"]) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    keys = [f"synthetic_{i:08d}" for i in range(5)]
    assert sorted(members) == sorted(f"{k}.{ext}" for k in keys for ext in ("cls", "jpg"))
    images = [members[f"{k}.jpg"] for k in keys]
    pool = [(out / "pool" / f"{i:05d}.jpg").read_bytes() for i in range(2)]
    assert images == [pool[0], pool[1], pool[0], pool[1], pool[0]] and pool[0] != pool[1]
    assert all(0 <= int(members[f"{k}.cls"]) < 1000 for k in keys)
    with Image.open(out / "pool" / "00000.jpg") as image:  # a photograph-sized JPEG, as ImageNet's
        assert image.format == "JPEG" and image.mode == "RGB" and max(image.size) >= 120


def test_quickstart_spread_reads_the_fits_final_validation_metrics(tmp_path, monkeypatch):
    """The val/* values of the run's final_metrics.json (FinalMetrics' format), nothing else; a missing
    file, a fit without val/top1 and a config that is not an image classifier stop with the path named.
    The environments cap exactly the three libraries' instructions and drop an inherited cap."""
    from benchmarks import quickstart_spread

    version = tmp_path / "run" / "digits_multimax" / "version_0"
    version.mkdir(parents=True)
    (version / "final_metrics.json").write_text(
        json.dumps(
            {
                "stage": "fit",
                "global_step": 1760,
                "metrics": {
                    "val/top1": {"value": 0.9582, "step": 1760, "epoch": 39},
                    "val/loss": {"value": 0.228, "step": 1760, "epoch": 39},
                    "train/loss": {"value": 0.5, "step": 1760, "epoch": 39},
                },
            }
        )
    )
    assert quickstart_spread.final_val_metrics(tmp_path / "run") == {"val/loss": 0.228, "val/top1": 0.9582}
    (tmp_path / "unvalidated").mkdir()
    (tmp_path / "unvalidated" / "final_metrics.json").write_text(json.dumps({"stage": "fit", "metrics": {}}))
    with pytest.raises(SystemExit, match=r"unvalidated/final_metrics.json: no val/top1 \(did the fit validate\?\)"):
        quickstart_spread.final_val_metrics(tmp_path / "unvalidated")
    with pytest.raises(SystemExit, match="expected one final_metrics.json from the fit, found 0"):
        quickstart_spread.final_val_metrics(tmp_path / "empty")
    with pytest.raises(SystemExit, match="lm_softmax.yaml: not an image-classification config"):
        quickstart_spread.check_configs(
            [ROOT / "configs/quickstart/digits_softmax.yaml", ROOT / "configs/quickstart/lm_softmax.yaml"]
        )
    quickstart_spread.check_configs([ROOT / "configs/quickstart/digits_multimax.yaml"])

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    native, avx2 = quickstart_spread.environment(1, "native"), quickstart_spread.environment(2, "avx2")
    assert "ATEN_CPU_CAPABILITY" not in native and "TRITON_INTERPRET" not in native
    assert native["OMP_NUM_THREADS"] == "1" and avx2["OMP_NUM_THREADS"] == "2"
    assert {k: avx2[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")} == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
