"""Fetch the wheels a GPU node without internet needs to run mmlight: what ``pyproject.toml`` requires
(with the dependencies of each, transitively) beyond what the node already has.

``benchmarks/gpu_wheels.sh`` runs it. Each round downloads the missing requirements with
``pip download --no-deps --only-binary=:all:`` for the node's Python and platform, then reads each new
wheel's ``Requires-Dist`` (markers evaluated for the node, extras as asked) for the next round; a
requirement with no binary wheel is built into one from its source (``pip wheel --no-deps``, pure
Python); one that neither gives is reported, and the run's section that needs it records it. One
version of each package: installing two stops ``pip install``.
"""

from __future__ import annotations

import argparse
import email.parser
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
#: What a GPU node with PyTorch has, unless told more: never fetched (a wheel of torch's companions
#: would replace the node's own build, matched to its driver).
NODE_DEFAULT = ["torch", "torchvision", "triton", "numpy"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_wheels.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", type=Path, default=Path(".whl"), help="folder the wheels go to (.whl)")
    p.add_argument(
        "--have", nargs="*", default=[], help="packages the node has, beyond torch, torchvision, triton, numpy"
    )
    p.add_argument("--have-file", type=Path, help="the node's `pip freeze` (or one package name a line)")
    p.add_argument("--python-version", default="3.12", help="the node's Python, major.minor (3.12)")
    p.add_argument("--platform", nargs="+", default=PLATFORMS, help="the node's wheel platform tags")
    p.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml", help="whose dependencies")
    p.add_argument("--dry-run", action="store_true", help="print the first round's requirements, fetch nothing")
    return p


def node_environment(python_version: str) -> dict[str, str]:
    """Marker values of a Linux x86-64 CPython ``python_version`` node."""
    env = default_environment()
    env.update(
        python_version=python_version,
        python_full_version=f"{python_version}.0",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        platform_system="Linux",
        sys_platform="linux",
        platform_machine="x86_64",
        os_name="posix",
    )
    return env


def have_names(names: list[str], have_file: Path | None) -> set[str]:
    """Canonical names of what the node has: the defaults, ``names``, and ``have_file``'s lines."""
    lines = have_file.read_text().splitlines() if have_file else []
    listed = [
        line.split("==")[0].split(" @ ")[0].strip() for line in lines if line.strip() and not line.startswith("#")
    ]
    return {canonicalize_name(n) for n in [*NODE_DEFAULT, *names, *listed]}


def project_requirements(pyproject: Path) -> list[Requirement]:
    import tomllib

    return [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]


def needed(requirements: list[Requirement], have: set[str], env: dict) -> list[Requirement]:
    """The requirements that apply on the node (markers) and that it does not have, one per name."""
    found: dict[str, Requirement] = {}
    for r in requirements:
        name = canonicalize_name(r.name)
        if name in have or name in found:
            continue
        if r.marker is None or r.marker.evaluate({**env, "extra": ""}):
            found[name] = r
    return list(found.values())


def requires_of(wheel: Path, extras: set[str], env: dict) -> list[Requirement]:
    """The ``Requires-Dist`` of ``wheel`` that apply on the node with ``extras`` requested."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(name).decode())
    applying = []
    for line in metadata.get_all("Requires-Dist") or []:
        r = Requirement(line)
        if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in {"", *extras}):
            applying.append(
                Requirement(f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}{r.specifier}")
            )
    return applying


def fetch(requirement: Requirement, args) -> bool:
    """Download a wheel of ``requirement`` (or build one from its source); False if neither works."""
    platforms = [a for p in args.platform for a in ("--platform", p)]
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(args.dest)]
    download += ["--python-version", args.python_version, "--implementation", "cp", *platforms, str(requirement)]
    if subprocess.run(download).returncode == 0:
        return True
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(args.dest), str(requirement)]
    return subprocess.run(build).returncode == 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    env = node_environment(args.python_version)
    have = have_names(args.have, args.have_file)
    todo = needed(project_requirements(args.pyproject), have, env)
    if args.dry_run:
        print("\n".join(map(str, todo)))
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    done: dict[str, Path] = {}
    failed = []
    while todo:
        extras = {canonicalize_name(r.name): set(r.extras) for r in todo}
        for r in todo:
            if not fetch(r, args):
                failed.append(str(r))
        following = []
        for wheel in args.dest.glob("*.whl"):
            name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
            if name in extras and name not in done:
                done[name] = wheel
                following += requires_of(wheel, extras[name], env)
        todo = needed(following, have | set(done) | {canonicalize_name(f.split("[")[0]) for f in failed}, env)
    size = sum(w.stat().st_size for w in done.values()) / 2**20
    print(f"{len(done)} wheels, {size:.1f} MiB, in {args.dest}: {' '.join(sorted(w.name for w in done.values()))}")
    if failed:
        print(f"no wheel for: {', '.join(failed)} (the sections that import them record it)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
