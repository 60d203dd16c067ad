"""The GPU run's control flow under faults, rehearsed on the CPU with small fake sections (the real ones
take minutes under the interpreter): a package that does not import, a compilation that hangs, a kill
at an arbitrary moment, and candidates of the check pool that fail or hang.

Each run is a process of its own (the run's watchdog ends its process). Each test checks that every
record written parses, that the sections before the fault have their records, and that the run ends
within its budget plus :data:`MARGIN_S`.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a run may take beyond its budget and hard grace: the interpreter's exit, the test's polling.
MARGIN_S = 5.0

PRELUDE = f"""
import time
STARTED = time.monotonic()
import json, os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
from benchmarks.gpu.main import Section, main


def fake(name, records=3, pause=0.0, size=0):
    def body(run):
        for i in range(records):
            run.emit(kind="fake", section=name, index=i, payload="x" * size)
            time.sleep(pause)
    return Section(name, body, 1, rest=True)
"""


def run_script(body: str, out: Path, budget: float, grace: float, env: dict | None = None, kill_after=None):
    """Run ``PRELUDE + body`` (which calls ``main``); ``(status, seconds, records)``. ``kill_after``: SIGKILL
    the process that many seconds after its first record."""
    argv = ["--smoke", "--out", str(out), "--budget", str(budget), "--hard-grace", str(grace)]
    code = PRELUDE + body + f"\nsys.exit(main({argv!r}, SECTIONS, started=STARTED))\n"
    began = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    if kill_after is not None:
        while not list(out.glob("*.jsonl")) or not next(out.glob("*.jsonl")).stat().st_size:
            assert child.poll() is None, "the run ended before its first record"
            time.sleep(0.02)
        time.sleep(kill_after)
        child.send_signal(signal.SIGKILL)
    child.communicate(timeout=budget + grace + 60)
    seconds = time.monotonic() - began
    (path,) = out.glob("gpu_run-*.jsonl")
    return child.returncode, seconds, [json.loads(line) for line in path.read_text().splitlines()]


def test_an_unimportable_package_costs_its_section_only(tmp_path):
    """webdataset and entmax shadowed by modules that raise on import: preflight names both, the section
    that imports webdataset records the error with the package's name, mmlight (which imports entmax only
    for the maps that need it) still builds and runs MultiMax, and the sections after them run."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    for name in ("webdataset", "entmax"):
        message = f"No module named {name!r} (injected)"
        (shadow / f"{name}.py").write_text(f"raise ModuleNotFoundError({message!r}, name={name!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])}
    # preflight imports only the packages this test reads (the smoke run of test_gpu_run.py imports them
    # all): each other one would be a cold import of torch, or of Lightning (about 10 s of CPU), for nothing
    body = """
from benchmarks.gpu import preflight
preflight.OPTIONAL = {name: preflight.OPTIONAL[name] for name in ("mmlight", "webdataset", "entmax", "tensorboard")}

def needs_webdataset(run):
    import webdataset  # noqa: F401

def multimax(run):
    import torch
    from mmlight.reweighting import build
    weights = build("multimax", order=2, backend="reference")(torch.zeros(2, 4))
    run.emit(kind="fake", section="multimax", index=0, weights=weights.tolist())

SECTIONS = [Section("preflight", "benchmarks.gpu.preflight:section", 10), fake("before"),
            Section("needs_webdataset", needs_webdataset, 1, rest=True), Section("multimax", multimax, 1, rest=True),
            fake("after")]
"""
    status, seconds, records = run_script(body, tmp_path / "out", budget=90, grace=5, env=env)
    assert status == 0 and seconds < 90 + MARGIN_S
    env_record = next(r for r in records if r["kind"] == "env")
    for name in ("webdataset", "entmax"):
        assert env_record["packages"][name] == f"ModuleNotFoundError: No module named '{name}' (injected)"
    assert env_record["packages"]["mmlight"].startswith("ok") and env_record["packages"]["tensorboard"].startswith("ok")
    assert set(env_record["missing"]) == {"webdataset", "entmax"}
    (error,) = [r for r in records if r["kind"] == "error"]
    assert error["section"] == "needs_webdataset" and error["missing_package"] == "webdataset"
    weights = next(r for r in records if r.get("section") == "multimax" and r["kind"] == "fake")["weights"]
    assert weights == [[0.25] * 4] * 2  # equal scores: uniform weights
    assert [r["section"] for r in records if r["kind"] == "fake"] == ["before"] * 3 + ["multimax"] + ["after"] * 3
    end = records[-1]
    assert end["kind"] == "end" and end["reason"] == "finished" and end["not_reached"] == []
    assert end["done"] == ["preflight", "before", "multimax", "after"]


def test_a_hanging_compilation_is_cut_off_and_a_stuck_one_ends_the_run(tmp_path):
    """A compilation that hangs in Python is cut at its own limit and its section goes on; one stuck where
    no timer reaches (SIGALRM blocked, as in native code) is ended by the watchdog at the budget plus
    the hard grace, which writes the closing record and exits with status 0."""
    body = """
def compiles(run):
    run.emit(kind="fake", section="compiles", index=0, **run.attempt("compile", 1.0, lambda: time.sleep(60)))
    run.emit(kind="fake", section="compiles", index=1)

def stuck(run):
    run.emit(kind="fake", section="stuck", index=0)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(600)

SECTIONS = [fake("before"), Section("compiles", compiles, 1, rest=True), Section("stuck", stuck, 1, rest=True),
            fake("never")]
"""
    budget, grace = 20.0, 2.0
    status, seconds, records = run_script(body, tmp_path / "out", budget=budget, grace=grace)
    assert status == 0 and seconds < budget + grace + MARGIN_S
    cut = next(r for r in records if r.get("section") == "compiles" and r.get("index") == 0)
    assert cut["error"].startswith("Overrun: not done in 1 s")
    assert [r.get("index") for r in records if r.get("section") == "compiles" and r["kind"] == "fake"] == [0, 1]
    assert [r["section"] for r in records if r["kind"] == "section"] == ["before", "compiles"]
    end = records[-1]
    assert end["kind"] == "end" and end["reason"].startswith("hard end") and "inside stuck" in end["reason"]
    assert end["done"] == ["before", "compiles"] and end["cut_off"] == ["stuck"] and end["not_reached"] == ["never"]
    assert budget + grace - 1 < end["elapsed_s"] < budget + grace + 1


@pytest.mark.parametrize("kill_after", [0.3, 1.7])
def test_a_kill_leaves_whole_records_of_the_sections_before_it(tmp_path, kill_after):
    """SIGKILL at an arbitrary moment: every line parses (each record is one write), and each section
    recorded as done has all its records, as have the sections before it."""
    body = "SECTIONS = [fake(f's{i}', records=10, pause=0.03, size=20000) for i in range(8)]\n"
    status, seconds, records = run_script(body, tmp_path / "out", budget=60, grace=5, kill_after=kill_after)
    assert status == -signal.SIGKILL and seconds < 60 + MARGIN_S
    done = [r["section"] for r in records if r["kind"] == "section"]
    assert done == [f"s{i}" for i in range(len(done))] and len(done) < 8  # the kill came before the end
    fakes = [(r["section"], r["index"]) for r in records if r["kind"] == "fake"]
    # the records are those of the sections done, then a first part of the one the kill cut
    every = [(f"s{i}", j) for i in range(len(done) + 1) for j in range(10)]
    assert len(fakes) >= 10 * len(done) and fakes == every[: len(fakes)]
    assert all(len(r["payload"]) == 20000 for r in records if r["kind"] == "fake")


def test_the_check_pool_records_each_verdict_and_drops_a_failing_or_hanging_candidate(tmp_path):
    """One worker, three tasks: one that raises, one that hangs past its limit (its worker is killed and
    replaced), one that passes; each verdict is handed back as it comes, in that order."""
    (tmp_path / "fake_tasks.py").write_text(
        "import time\n"
        "def fails():\n    raise RuntimeError('out of resources: shared memory')\n"
        "def hangs():\n    time.sleep(600)\n"
        "def passes(x):\n    return {'ok': True, 'value': x * x}\n"
    )
    body = f"""
sys.path.insert(0, {str(tmp_path)!r})
from benchmarks.gpu.pool import run_pool

def checks(run):
    tasks = [("fake_tasks:fails", ()), ("fake_tasks:hangs", ()), ("fake_tasks:passes", (7,))]
    left = run_pool(run, tasks, 1, 6.0, lambda i, verdict: run.emit(kind="verdict", index=i, **verdict))
    run.emit(kind="left", indices=left)

SECTIONS = [Section("checks", checks, 1, rest=True)]
"""
    status, seconds, records = run_script(body, tmp_path / "out", budget=90, grace=5)
    assert status == 0 and seconds < 90 + MARGIN_S
    verdicts = [r for r in records if r["kind"] == "verdict"]
    assert [(r["index"], r["ok"]) for r in verdicts] == [(0, False), (1, False), (2, True)]
    assert verdicts[0]["error"] == "RuntimeError: out of resources: shared memory"
    assert verdicts[1]["error"] == "Timeout: not done in 6 s; worker killed"
    assert verdicts[2]["value"] == 49
    assert next(r for r in records if r["kind"] == "left")["indices"] == []


def test_a_failed_import_is_missing_and_one_past_the_limit_is_slow_as_the_docs_say():
    from benchmarks.gpu import preflight

    packages = {
        "mmlight": "ok 0.1.0",
        "timm": f"{preflight.TIMEOUT} {preflight.IMPORT_LIMIT_S:.0f} s",
        "entmax": "ModuleNotFoundError: No module named 'entmax'",
        "lightning": "failed",
    }
    missing, slow = preflight.unavailable(packages)
    assert missing == {"entmax": preflight.OPTIONAL["entmax"], "lightning": "fit"}
    assert slow == {"timm": "step (timm's DeiT-small, the compiled peer)"}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text()
    assert f"for at most {preflight.IMPORT_LIMIT_S:g} s: one that fails is recorded as `missing`" in doc


def test_an_import_still_running_at_the_limit_is_cut_off_and_named(tmp_path, monkeypatch):
    from benchmarks.gpu import preflight

    (tmp_path / "slow_pkg.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "quick_pkg.py").write_text("__version__ = '1.2'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    began = time.monotonic()
    found = preflight.imports(["slow_pkg", "quick_pkg"], limit_s=2.0)
    assert time.monotonic() - began < 10
    assert found == {"slow_pkg": f"{preflight.TIMEOUT} 2 s", "quick_pkg": "ok 1.2"}
