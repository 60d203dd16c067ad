"""benchmarks/gpu_run.py (the package benchmarks/gpu/), the prepared device run: its ``--smoke`` run on the
CPU (interpreter, tiny shapes) writes every section's records, tile rows that the kernels' config
functions honour, and a file that benchmarks/report.py renders. Timings here mean nothing; the records
and their wiring do. Its control flow under faults: test_gpu_faults.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu.fit import last_error, logged_throughput
from mmlight.kernels import attention, tiles
from mmlight.kernels.tiles import BlockConfig

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["preflight", "correctness", "step", "attention", "rowwise", "text_step", "sweep", "profile", "fit"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The records of one ``--smoke`` run and its output folder."""
    out = tmp_path_factory.mktemp("gpu_run")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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
    assert [r["section"] for r in records if r["kind"] == "section"] == SECTIONS
    assert not [r for r in records if r["kind"] in ("error", "cut")]
    end = records[-1]
    assert end["kind"] == "end" and end["done"] == SECTIONS and end["not_reached"] == end["cut_off"] == []
    # what needs CUDA is recorded as skipped, with the reason
    skipped = {(r["section"], r.get("what")) for r in records if r["kind"] == "skipped"}
    assert {("step", "softmax (SDPA flash), compiled"), ("step", "softmax (SDPA cuDNN)")} <= skipped
    assert {r["check"] for r in records if r["kind"] == "doctor" and r["ok"]} == {
        "row-wise MultiMax (DeiT-small scores)",
        "attention (DeiT-small)",
        "causal attention N=1024",
        "cross-entropy (LM vocabulary)",
    }
    # every candidate and switch setting was checked against fp32 and passed at these shapes
    checks = [r for r in records if r["kind"] == "check"]
    switches = _switches()
    assert len([r for r in checks if r["section"] == "sweep"]) == 2 * 3
    assert len([r for r in checks if r["section"] == "attention"]) == 2 * (2 + switches)
    assert all(r["ok"] and r["error"] < 1e-4 for r in checks)
    backends = {r["backend"] for r in records if r["kind"] == "timing" and r["op"] == "attention"}
    assert {
        "sdpa/math",
        "multimax/triton shipped",
        "multimax/triton all switches",
        "multimax/triton shipped, no param grads",
        "softmax/triton (order 0)",
        "multimax/flex (frozen sigma), fwd",
        "multimax/triton tuned",
    } <= backends
    rules = [r for r in records if r["kind"] == "switch_rule"]
    assert len(rules) == switches + 1 and all(r["correct"] for r in rules)
    steps = [r["backend"] for r in records if r["kind"] == "step"]
    assert steps == [
        "softmax (SDPA flash)",
        "multimax shipped",
        "timm deit_small_patch16_224 (SDPA flash)",
        "multimax attention, plain CE",
        "softmax attention (SDPA flash), multimax output",
        "multimax tuned",
    ]
    assert all(r["step_ms"] > 0 for r in records if r["kind"] == "step")
    profiles = (out / "profiles.txt").read_text()
    assert "## softmax (SDPA flash)" in profiles and "## multimax tuned" in profiles and "Self CPU" in profiles


@pytest.mark.slow
def test_smoke_text_steps_are_the_configs_networks(smoke_run):
    """Each text recipe's step ran eagerly on its config's network (narrowed: the parameter count of a
    ``TransformerConfig`` built here from the same YAML), its tokens/s from its shape and step time; the
    compiled step is recorded as skipped on the CPU, saying why."""
    from benchmarks.gpu.text_step import RECIPES, network_config
    from mmlight.models.transformer import TransformerLM, TransformerSeq2Seq

    records, _, _ = smoke_run
    steps = [r for r in records if r["kind"] == "text_step"]
    assert [(r["config"], r["compiled"]) for r in steps] == [(recipe.config, False) for recipe in RECIPES]
    for recipe, record in zip(RECIPES, steps):
        config = network_config(recipe, smoke=True)
        network = (TransformerSeq2Seq if config.n_encoder_layers else TransformerLM)(config)
        assert record["parameters"] == sum(p.numel() for p in network.parameters())
        batch, length = record["shape"]
        assert record["tokens_per_s"] == round(batch * length / record["step_ms"] * 1e3)
    skipped = {r["what"]: r["reason"] for r in records if r["kind"] == "skipped" and r["section"] == "text_step"}
    assert skipped == {f"{recipe.config}, compiled": "needs a CUDA GPU" for recipe in RECIPES}


@pytest.mark.slow
def test_smoke_fits_log_their_images_per_second(smoke_run):
    """The first DeiT-small config ran as ``mmlight fit`` on the generated shards, logged samples/s past its
    warm-up, and is set beside the eager step of its variant (images/s from that record's batch and ms); the
    smoke skips the second, saying so."""
    records, out, _ = smoke_run
    fits = {r["backend"]: r for r in records if r["kind"] == "fit"}
    assert set(fits) == {"deit_small_multimax"}
    skipped = [(r["what"], r["reason"]) for r in records if r["kind"] == "skipped" and r["section"] == "fit"]
    assert skipped == [("deit_small_softmax", "smoke: the first fit only")]
    steps = {r["backend"]: r for r in records if r["kind"] == "step"}
    for fit in fits.values():
        assert fit["smoke"] and not fit["compiled"] and "error" not in fit
        assert fit["images_per_s"] > 0 and fit["windows"] >= 1 and fit["end_of_fit_images_per_s"] > 0
        # TensorBoard steps are 0-based: the fit ran its 14 steps (logged at 6 and 13)
        assert fit["last_logged_step"] == fit["max_steps"] - 1 > fit["steady_from_step"]
        step = steps[fit["step_backend"]]
        assert not step["compiled"]
        step_rate = step["shape"][0] * 1000 / step["step_ms"]
        assert fit["step_images_per_s"] == pytest.approx(step_rate)
        assert fit["fit_to_step"] == pytest.approx(fit["images_per_s"] / step_rate, abs=5e-4 + 1e-12)  # 3 decimals
    assert "mmlight.cli" in (out / "fit.log").read_text()


def _in_benchmarks(code: str, stdin: str = "") -> str:
    """The output of ``code`` run by Python from ``benchmarks/``, so that it imports the scripts as they
    import each other (beside one another), in a process of its own (the interpreter on)."""
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
    code = "from benchmarks.gpu.common import present_switches; print(len(present_switches()))"
    return int(_in_benchmarks(code))


@pytest.mark.slow
def test_tile_rows_are_what_the_config_functions_read(smoke_run, monkeypatch):
    """Pasted into tiles.MEASURED, the rows the run wrote are the tiles the kernels then launch."""
    records, out, _ = smoke_run
    rows = eval("{" + (out / "tile_rows.py").read_text() + "}", {"BlockConfig": BlockConfig})
    tuned = {r["shape_name"]: r["configs"] for r in records if r["kind"] == "tuned"}
    monkeypatch.setattr(tiles, "MEASURED", rows)
    # the smoke shapes: (1, 1, 19, 16) non-causal and (1, 1, 21, 16) causal, fp32, keyed for sm_90
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
    assert "#### Targets" in report and "#### Tile sweep" in report
    assert "- step: softmax (SDPA flash), compiled needs a CUDA GPU" in report
    fit = next(r for r in records if r["kind"] == "fit" and r["backend"] == "deit_small_multimax")
    fit_rows = [line for line in report.splitlines() if line.startswith("| `deit_small_multimax.yaml` (smoke) |")]
    assert len(fit_rows) == 1 and fit_rows[0].endswith(
        f"| multimax shipped | {fit['step_images_per_s']:.4g} | {fit['fit_to_step']:.3g} |"
    )
    text = next(r for r in records if r["kind"] == "text_step" and r["config"] == "llm/llama_124m_softmax.yaml")
    (text_row,) = [line for line in report.splitlines() if line.startswith("| `llm/llama_124m_softmax.yaml` |")]
    assert text_row.startswith(f"| `llm/llama_124m_softmax.yaml` | 64 | 2 × 16 | no | {text['step_ms']:.3g} | – |")


def test_a_record_table_keeps_only_its_kind_and_ends_a_failed_row_with_its_error():
    from benchmarks.report import text_step_table

    row = {"kind": "text_step", "config": "c.yaml", "vocab": 32768, "shape": [16, 1024], "compiled": True}
    records = [{**row, "step_ms": 12.0, "compiled_over_eager": 0.5}, {**row, "error": "OutOfMemoryError: CUDA"}]
    lines = text_step_table([*records, {"kind": "step", "backend": "softmax"}])
    assert len(lines) == 4
    assert lines[2].startswith("| `c.yaml` | 32,768 | 16 × 1024 | yes | 12 | 0.5 |") and lines[2].endswith("|")
    assert lines[3].endswith("| OutOfMemoryError: CUDA")


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


def test_fit_throughput_read_from_tensorboard(tmp_path):
    """The fit's figures are the mean of the windows logged after the warm-up step, read from the
    event file a SummaryWriter wrote (values chosen so that the mean is known by hand)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for step, rate, mfu in ((9, 1000.0, 0.5), (19, 20.0, 0.25), (29, 30.0, 0.5), (39, 52.0, 0.75)):
            writer.add_scalar("train/device/samples_per_sec", rate, step)
            writer.add_scalar("train/device/mfu", mfu, step)
        writer.add_scalar("lr-AdamW", 1e-4, 40)
    read = logged_throughput(tmp_path, 15)
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
    outputs = [
        "Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'x'\n\nDuring handling of the above "
        'exception, another exception occurred:\n\nTraceback (most recent call last):\n  File "b.py", line 2\n'
        "    f()\ntorch._dynamo.exc.Unsupported: graph break in layer 3\n  from user code\nEpoch 0: 5/30\n",
        "usage: mmlight fit [-h]\nmmlight fit: error: Key 'data.init_args.rot' is not expected\n",
        "",
    ]
    assert [last_error(text) for text in outputs] == [
        "torch._dynamo.exc.Unsupported: graph break in layer 3",
        "mmlight fit: error: Key 'data.init_args.rot' is not expected",
        "",
    ]


@pytest.mark.parametrize(
    "config, parameters",
    # the counts that the configs' headers state for their recipes' vocabularies; MultiMax (order 2) has 8
    # parameters per site, in 6 attention layers and on the output
    [("lm_wikitext103_multimax.yaml", 155_999_232 + 7 * 8), ("llm/llama_124m_softmax.yaml", 110_119_680)],
)
def test_text_step_builds_each_configs_network_at_its_vocabulary(config, parameters):
    """The text step's network is the config's at full size: the parameter count its header states."""
    from benchmarks.gpu.text_step import RECIPES, network_config
    from mmlight.models.transformer import TransformerLM

    (recipe,) = [r for r in RECIPES if r.config == config]
    with torch.device("meta"):
        network = TransformerLM(network_config(recipe, smoke=False))
    assert sum(p.numel() for p in network.parameters()) == parameters
