"""benchmarks/gpu_wheels.sh and the documented GPU run: the command lines of docs/kernels.md ("Measuring on
a GPU") parse with the scripts' own parsers, the figures it states are the code's, and the wheel
resolver keeps what applies on the node (markers, extras) and drops what the node has. No network."""

import email.message
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from benchmarks.gpu import main as run_main
from benchmarks.gpu import wheels
from benchmarks.gpu.record import HARD_GRACE_S

ROOT = Path(__file__).resolve().parents[2]
SECTION = (ROOT / "docs" / "kernels.md").read_text().split("## Measuring on a GPU")[1]


def documented(script: str) -> list[list[str]]:
    """The arguments after ``script`` on each line of the section's fenced blocks that runs it (up to a
    redirection or a pipe)."""
    found = []
    for block in re.findall(r"^```\w*\n(.*?)^```", SECTION, flags=re.MULTILINE | re.DOTALL):
        for line in block.splitlines():
            if script in line:
                tokens = shlex.split(line.split(script, 1)[1])
                ends = [i for i, t in enumerate(tokens) if t in ("2>&1", "|")]
                found.append(tokens[: ends[0]] if ends else tokens)
    return found


def test_documented_command_lines_parse():
    (fetch,) = documented("benchmarks/gpu_wheels.sh")
    args = wheels.parser().parse_args(fetch)
    assert args.have_file == Path("node-packages.txt") and args.dest == Path(".whl")
    runs = documented("benchmarks/gpu_run.py")
    assert len(runs) == 2
    on_gpu, smoke = (run_main.parser().parse_args(argv) for argv in runs)
    assert (on_gpu.out, on_gpu.budget, on_gpu.smoke) == (Path("gpu-records"), None, False)
    assert smoke.smoke and smoke.out == Path("/tmp/gpu-run-smoke")


def test_documented_figures_are_the_codes():
    """The sections' table in their order, the budget, the hard grace and the bound they give."""
    table = re.findall(r"^\| `(\w+)` \|", SECTION, flags=re.MULTILINE)
    assert table == run_main.NAMES
    bound = run_main.BUDGET_S + HARD_GRACE_S
    assert f"`--budget` is {run_main.BUDGET_S:.0f} s" in SECTION
    assert f"`--hard-grace` seconds ({HARD_GRACE_S:.0f})" in SECTION
    assert f"within {bound:.0f} s of its start" in SECTION and f"at most {bound:.0f} s" in SECTION
    timeout = int(re.search(r"timeout (\d+) python3 benchmarks/gpu_run.py", SECTION).group(1))
    assert bound < timeout <= 540  # the second guard leaves the run its bound
    assert f"Its budget is {run_main.SMOKE_BUDGET_S:,.0f} s" in SECTION


def fake_wheel(folder: Path, name: str, requires: list[str]) -> Path:
    metadata = email.message.Message()
    metadata["Metadata-Version"] = "2.1"
    metadata["Name"] = name
    metadata["Version"] = "1.0"
    for line in requires:
        metadata["Requires-Dist"] = line
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-1.0.dist-info/METADATA", metadata.as_string())
    return path


def test_resolver_keeps_what_applies_on_the_node(tmp_path):
    """Python 3.12 on Linux x86-64, extra ``signatures`` asked for: the old-Python, Windows and other-extra
    lines drop out; what the node has (torch, by default) drops out in ``needed``; one line per name."""
    wheel = fake_wheel(
        tmp_path,
        "pkg",
        [
            "alpha>=1",
            "beta; python_version < '3.9'",
            "gamma>=2; extra == 'signatures'",
            "delta; extra == 'other'",
            "epsilon; sys_platform == 'win32'",
            "zeta; platform_machine == 'x86_64' and python_version >= '3.12'",
            "torch>=2",
            "Alpha<3",
        ],
    )
    env = wheels.node_environment("3.12")
    requires = wheels.requires_of(wheel, {"signatures"}, env)
    assert [str(r) for r in requires] == ["alpha>=1", "gamma>=2", "zeta", "torch>=2", "Alpha<3"]
    have = wheels.have_names(["Zeta"], None)
    assert [str(r) for r in wheels.needed(requires, have, env)] == ["alpha>=1", "gamma>=2"]


def test_script_lists_what_the_node_lacks(tmp_path):
    """``--dry-run`` with a ``pip freeze`` that holds all of pyproject.toml's dependencies but two: those two,
    as pyproject.toml writes them."""
    dependencies = [
        Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    lacking = {"entmax", "webdataset"}
    freeze = [f"{r.name}==0.0" for r in dependencies if r.name not in lacking]
    (tmp_path / "node.txt").write_text("# pip freeze\n" + "\n".join(freeze) + "\n")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(ROOT / "benchmarks" / "gpu_wheels.sh"), "--have-file", str(tmp_path / "node.txt"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == [str(r) for r in dependencies if r.name in lacking]
