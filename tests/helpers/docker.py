"""The Docker image tests' builds (buildah): the NGC stand-in and mmlight on it, built in the background."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmlight.data.shards import atomic_write

ROOT = Path(__file__).resolve().parents[2]


DOCKER = ROOT / "docker"


PREFIX = "localhost/mmlight-test"


DEBIAN = f"{PREFIX}/debian-python:bookworm"


TORCH_BASE = f"{PREFIX}/torch-base"


IMAGE = f"{PREFIX}/mmlight"


# Builds reach the package indexes through this machine's TLS proxy when there is one; its CA bundle
# is mounted into every build step (harmless where there is no proxy).
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


#: the image user: what the tests check the files of the image belong to
UID, GID = 2345, 2346
ENV = {**os.environ, "BUILDAH_ISOLATION": "chroot"}  # the OCI runtimes cannot set rlimits here


def buildah(*args: str, check: bool = True, timeout: float = 120, nice: bool = False) -> subprocess.CompletedProcess:
    argv = (["nice", "-n", "10"] if nice else []) + ["buildah", *args]
    result = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited with {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result


def buildah_unavailable() -> str | None:
    """Why buildah cannot build and run images here, or None when it can."""
    missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (Debian: apt-get install buildah debootstrap, as .ci/run does)"
    if os.geteuid() != 0:
        return "debootstrap and buildah's chroot isolation need root (CI runs as root)"
    probe = buildah("from", "scratch", check=False)
    if probe.returncode != 0:
        return f"buildah cannot create a container here: {probe.stderr.strip()}"
    container = probe.stdout.strip()
    try:
        mounted = buildah("mount", container, check=False)
        if mounted.returncode != 0:
            return f"buildah cannot mount a container's file system here: {mounted.stderr.strip()}"
    finally:
        buildah("rm", container, check=False)
    return None


def image_exists(name: str) -> bool:
    return buildah("images", "--quiet", name, check=False).returncode == 0


def layers(name: str) -> list[tuple[str, int]]:
    """(the step that made it, bytes uncompressed) of each layer of a local image, bottom first."""
    info = json.loads(buildah("inspect", "--type", "image", name).stdout)
    sizes = [layer["size"] for layer in json.loads(info["Manifest"])["layers"]]
    steps = [entry.get("created_by", "") for entry in info["Docker"].get("history", []) if not entry.get("empty_layer")]
    steps = [""] * (len(sizes) - len(steps)) + steps[-len(sizes) :]  # a committed rootfs may have none
    return list(zip(steps, sizes))


def build(containerfile: Path, tag: str, build_args: dict[str, str], check: bool = True) -> tuple[float, str]:
    """``buildah bud`` in Docker's image format (OCI drops SHELL); returns (seconds, output)."""
    args = ["bud", "--format", "docker", "--layers", "--force-rm", "-f", str(containerfile), "-t", tag]
    for name, value in build_args.items():
        args += ["--build-arg", f"{name}={value}"]
    if CA_BUNDLE.is_file():
        args += ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"]
    start = time.monotonic()
    result = buildah(*args, str(ROOT), check=check, timeout=1500, nice=True)
    return time.monotonic() - start, result.stdout + result.stderr


def debootstrap_base() -> None:
    """Debian 12 with Python 3.11 and venv, committed as a local image (no registry needed)."""
    container = buildah("from", "scratch").stdout.strip()
    try:
        root = buildah("mount", container).stdout.strip()
        argv = [
            "nice",
            "-n",
            "10",
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            "bookworm",
            root,
            "http://deb.debian.org/debian",
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(Path(root) / cache, ignore_errors=True)
        buildah("config", "--cmd", "/bin/bash", container)
        buildah("commit", container, DEBIAN, timeout=600)
    finally:
        buildah("rm", container, check=False)


def build_images() -> dict:
    """The stand-in for NGC (the Debian base, then docker/torch-base.Dockerfile) and mmlight built on it;
    build times (s), image sizes and the mmlight layers (bytes), and the mmlight build's log."""
    figures: dict = {}
    if not image_exists(DEBIAN):
        start = time.monotonic()
        debootstrap_base()
        figures["debootstrap_s"] = time.monotonic() - start
    figures["torch_base_s"], _ = build(DOCKER / "torch-base.Dockerfile", TORCH_BASE, {"PYTHON_IMAGE": DEBIAN})
    figures["mmlight_s"], figures["build_log"] = build(
        DOCKER / "Dockerfile", IMAGE, {"BASE_IMAGE": TORCH_BASE, "UID": str(UID), "GID": str(GID)}
    )
    figures["sizes"] = {name: sum(size for _, size in layers(name)) for name in (DEBIAN, TORCH_BASE, IMAGE)}
    base_layers = len(layers(TORCH_BASE))
    figures["mmlight_layers"] = [(step[-100:], size) for step, size in layers(IMAGE)[base_layers:]]
    return figures


#: the background build that this process started: (process, its result file, its log file)
BACKGROUND: dict[str, tuple[subprocess.Popen, Path, Path]] = {}


def build_folder(run_id: str | None) -> Path:
    """Where a background build writes ``images.json`` (or ``failed``) and ``build.log``. Under xdist, one
    folder per test run (its ``testrunuid``), so that the worker running the Docker tests finds the build
    the controller started; otherwise a fresh temporary folder."""
    if run_id is None:
        return Path(tempfile.mkdtemp(prefix="mmlight-docker-build-"))
    folder = Path(tempfile.gettempdir()) / f"mmlight-docker-build-{run_id}"
    folder.mkdir(exist_ok=True)
    return folder


def start_background_build(run_id: str | None = None) -> None:
    """Start :func:`build_images` in a process of its own (where buildah can run), for the ``images``
    fixture of tests/test_docker_image.py; ``run_id``: xdist's ``testrunuid`` (see :func:`build_folder`)."""
    if BACKGROUND or buildah_unavailable() is not None:
        return
    folder = build_folder(run_id)
    result, log = folder / "images.json", folder / "build.log"
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.docker", str(result)],
            cwd=ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=ENV,
            start_new_session=True,  # its own process group, which stop_background_build ends whole
        )
    BACKGROUND["build"] = (process, result, log)


def background_figures(run_id: str | None, timeout: float = 1800) -> dict | None:
    """The figures of the background build of this test run, once it has ended (started by this process,
    or under xdist by the controller: ``run_id``); None when no build was started."""
    folder = Path(tempfile.gettempdir()) / f"mmlight-docker-build-{run_id}"
    started = BACKGROUND.pop("build", None)
    if started is not None:
        process, result, log = started
        process.wait(timeout=timeout)
    elif run_id is not None and folder.is_dir():
        result, log = folder / "images.json", folder / "build.log"
        deadline = time.monotonic() + timeout
        while not (result.exists() or (folder / "failed").exists()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the background image build did not end in {timeout} s:\n{log.read_text()[-6000:]}")
            time.sleep(5)
    else:
        return None
    try:
        assert result.exists(), f"the background image build failed:\n{log.read_text()[-6000:]}"
        return json.loads(result.read_text())
    finally:
        shutil.rmtree(result.parent, ignore_errors=True)


def stop_background_build() -> None:
    """End a background build still running (the session ended before the fixture waited for it)."""
    process, result, _ = BACKGROUND.pop("build", (None, None, None))
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    if result is not None:
        shutil.rmtree(result.parent, ignore_errors=True)


if __name__ == "__main__":  # the background build: python -m tests.helpers.docker RESULT.json
    result = Path(sys.argv[1])
    try:
        figures = build_images()
    except BaseException:
        (result.parent / "failed").touch()  # for a worker waiting on the files (background_figures)
        raise
    with atomic_write(result) as tmp:  # whole or absent, for the same reader
        tmp.write_text(json.dumps(figures))
