"""docker/Dockerfile built and run with buildah, on a stand-in for NGC's PyTorch image.

The stand-in is Debian 12 from debootstrap, then docker/torch-base.Dockerfile on it (torch and
torchvision from PyPI, pinned in /etc/pip/constraint.txt as NGC pins its own). docker/Dockerfile is
built on it unchanged apart from the base argument, and run with ``buildah run`` (chroot isolation)
as the image's own user. Skips, saying why, where buildah or debootstrap is missing or cannot work
(not root, no mount); .ci/run installs both from Debian's packages. docs/docker.md has the figures.

The images are kept under ``localhost/mmlight-test/`` so that buildah's layer cache makes a rerun
quick; the Debian base is reused when present (``buildah rmi`` it to rebuild from Debian).

The builds are mostly downloads and disk writes. When this file's tests are among those chosen,
tests/conftest.py starts them in a background process (``python -m tests.helpers.docker``) as soon
as collection ends, so that they run alongside the CPU-bound tests; the ``images`` fixture waits for
that process. Run alone, or where nothing started it, the fixture builds in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers.checks import wait_for
from tests.helpers.docker import (
    DEBIAN,
    DOCKER,
    ENV,
    GID,
    IMAGE,
    PREFIX,
    TORCH_BASE,
    UID,
    background_figures,
    build,
    build_images,
    buildah,
    buildah_unavailable,
    image_exists,
)

GUARD_BASE = f"{PREFIX}/torch-too-old"
# Not 1000 (the default), so that the build arguments visibly reach the user and the files it writes.
QUICKSTART = "configs/quickstart/digits_multimax.yaml"
RUNS = "/opt/mmlight/runs"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def images(request) -> dict:
    """:func:`build_images`' figures: from the background build where one was started (tests/conftest.py),
    else built here."""
    reason = buildah_unavailable()
    if reason:
        pytest.skip(f"buildah cannot run: {reason}")
    figures = background_figures(getattr(request.config, "workerinput", {}).get("testrunuid"))
    if figures is None:
        figures = build_images()
    print(json.dumps({k: v for k, v in figures.items() if k != "build_log"}, indent=1))
    return figures


@pytest.fixture(scope="module")
def container(images):
    name = "mmlight-test-run"
    buildah("rm", name, check=False)
    buildah("from", "--name", name, IMAGE)
    yield name
    buildah("rm", name, check=False)


@pytest.fixture(scope="module")
def entrypoint(images) -> list[str]:
    """The image's ENTRYPOINT, which ``buildah run`` does not apply by itself."""
    config = json.loads(buildah("inspect", "--type", "image", IMAGE).stdout)["Docker"]["config"]
    return config["Entrypoint"]


def run_argv(container: str, argv: list[str], runs: Path | None = None) -> list[str]:
    volume = ["--volume", f"{runs}:{RUNS}"] if runs else []
    return ["buildah", "run", *volume, container, "--", *argv]


def run(container: str, argv: list[str], runs: Path | None = None, timeout: float = 600):
    return subprocess.run(
        run_argv(container, argv, runs), capture_output=True, text=True, env=ENV, timeout=timeout, check=False
    )


@pytest.fixture()
def runs(tmp_path) -> Path:
    """A host folder for the container's runs/, owned by the image's user as a user's own would be."""
    folder = tmp_path / "runs"
    folder.mkdir()
    os.chown(folder, UID, GID)
    return folder


def ran_or_cached(log: str, step_text: str, output: str) -> bool:
    """Whether the build's step whose command holds ``step_text`` ran here and printed ``output``, or came
    from buildah's layer cache: a cached layer is the result of the same step on the same inputs, and a
    step that fails leaves no layer, so it passed when it ran."""
    if output in log:
        return True
    steps = log.split("\nSTEP ")
    return any(step_text in step and "--> Using cache" in step for step in steps)


def test_build_installs_mmlight_on_the_stand_in_base(images):
    """The build passed the torch guard (versions unchanged) and its own Pillow-SIMD check."""
    log = images["build_log"]
    assert ran_or_cached(log, "diff -u /tmp/image-torch.txt", "+ diff -u /tmp/image-torch.txt /tmp/installed-torch.txt")
    assert ran_or_cached(log, "Pillow-SIMD", "PIL is Pillow-SIMD")
    sizes = images["sizes"]
    assert sizes[DEBIAN] < sizes[TORCH_BASE] < sizes[IMAGE]


def test_default_user_is_the_build_arguments_ids(container):
    result = run(container, ["python", "-c", "import os; print(os.getuid(), os.getgid(), os.getcwd())"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(UID), str(GID), "/opt/mmlight"]


def test_help_and_doctor_through_the_entrypoint(container, entrypoint):
    assert entrypoint == ["tini", "--", "mmlight"]
    helped = run(container, [*entrypoint, "--help"])
    assert helped.returncode == 0, helped.stderr
    assert "fit" in helped.stdout
    doctor = run(container, [*entrypoint, "doctor"])
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "VERDICT: no GPU here." in doctor.stdout


def test_pillow_simd_replaced_pillow(container):
    script = "from mmlight.data.image_decode import pillow_build; print(pillow_build())"
    result = run(container, ["python", "-c", script])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Pillow-SIMD"), result.stdout


def owned_files(folder: Path) -> list[Path]:
    files = list(folder.rglob("*"))
    assert files, f"nothing was written under {folder}"
    wrong = [path for path in files if (path.stat().st_uid, path.stat().st_gid) != (UID, GID)]
    assert not wrong, f"not owned by {UID}:{GID}: {wrong}"
    return files


def scalar_tags(events: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    return accumulator.Tags()["scalars"]


def test_quick_start_writes_to_the_mounted_folder(container, entrypoint, runs):
    import torch

    result = run(container, [*entrypoint, "fit", "--config", QUICKSTART, "--trainer.max_epochs", "1"], runs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = owned_files(runs)
    checkpoints = [path for path in files if path.suffix == ".ckpt"]
    events = [path for path in files if path.name.startswith("events.out.tfevents")]
    assert checkpoints and events, files
    assert torch.load(checkpoints[0], map_location="cpu", weights_only=False)["epoch"] == 0
    assert any(tag.startswith("train/") for tag in scalar_tags(events[0]))


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every process below pid, from /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        parent = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append((int(stat.parent.name), name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def test_sigterm_through_tini_stops_training_cleanly(container, entrypoint, runs):
    """SIGTERM to tini (what ``docker stop`` sends to PID 1) reaches Lightning, which stops the run
    at the next step and tears down; the files already written stay readable."""
    import torch

    argv = [*entrypoint, "fit", "--config", QUICKSTART, "--trainer.max_epochs", "100"]
    process = subprocess.Popen(
        run_argv(container, argv, runs), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV
    )
    try:
        wait_for(lambda: list(runs.rglob("*.ckpt")) or process.poll() is not None, 300, "the first checkpoint", 0.5)
        assert process.poll() is None, process.stdout.read()[-3000:]
        tini = [pid for pid, name in descendants(process.pid) if name == "tini"]
        assert len(tini) == 1, descendants(process.pid)
        os.kill(tini[0], signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-3000:]
    assert "Received SIGTERM" in output and "Traceback" not in output, output[-3000:]
    files = owned_files(runs)
    for checkpoint in (path for path in files if path.suffix == ".ckpt"):
        assert "state_dict" in torch.load(checkpoint, map_location="cpu", weights_only=False)
    events = [path for path in files if path.name.startswith("events.out.tfevents")]
    assert events and any(tag.startswith("train/") for tag in scalar_tags(events[0]))


WRITE_PROBE = """
import json, os, sys, sysconfig
places = {p: None for p in sys.argv[1:] + [sysconfig.get_paths()["purelib"]]}
for place in places:
    try:
        with open(os.path.join(place, ".write-probe"), "w"):
            pass
        os.remove(os.path.join(place, ".write-probe"))
        places[place] = "written"
    except OSError as error:
        places[place] = error.strerror
print(json.dumps(places))
"""


def test_user_cannot_write_outside_its_own_folders(container):
    own = ["/opt/mmlight", "/home/mmlight", "/home/mmlight/.triton/cache", "/tmp"]
    system = ["/", "/etc", "/usr", "/usr/local/bin", "/opt", "/opt/venv", "/opt/venv/bin", "/root", "/var"]
    result = run(container, ["python", "-c", WRITE_PROBE, *own, *system])
    assert result.returncode == 0, result.stderr
    places = json.loads(result.stdout)
    assert {place: places[place] for place in own} == {place: "written" for place in own}
    refused = {place: outcome for place, outcome in places.items() if place not in own}
    assert all(outcome != "written" for outcome in refused.values()), refused
    assert len(refused) == len(system) + 1  # site-packages too


FAKE_OLD_TORCH = (  # one line of Python for `python -c "..."` in a RUN step
    "import importlib.metadata, pathlib, re, torch; "
    "meta = pathlib.Path(importlib.metadata.distribution('torch')._path) / 'METADATA'; "
    "meta.write_text(re.sub('(?m)^Version: .*$', 'Version: 2.3.0', meta.read_text(), count=1)); "
    "version = pathlib.Path(torch.__file__).with_name('version.py'); "
    "version.write_text(re.sub('(?m)^__version__ = .*$', '__version__ = ' + repr('2.3.0'), version.read_text()))"
)


def test_torch_guard_stops_a_build_that_would_replace_torch(images, tmp_path):
    """A base without the constraint file whose torch (2.3.0) is older than pyproject.toml's torch>=2.4:
    pip would replace it, and the guard fails the build with its message."""
    containerfile = tmp_path / "Containerfile"
    containerfile.write_text(
        f'FROM {TORCH_BASE}\nENV PIP_CONSTRAINT=\nRUN rm /etc/pip/constraint.txt && python -c "{FAKE_OLD_TORCH}"\n'
    )
    build(containerfile, GUARD_BASE, {})
    probe = buildah("from", GUARD_BASE).stdout.strip()
    try:
        faked = buildah("run", probe, "--", "python", "-c", "import torch; print(torch.__version__)").stdout
        assert faked.split() == ["2.3.0"]
        _, log = build(
            DOCKER / "Dockerfile",
            f"{PREFIX}/guard-must-fail",
            {"BASE_IMAGE": GUARD_BASE, "UID": str(UID), "GID": str(GID)},
            check=False,
        )
        assert "pip install replaced the image's torch 2.3.0 with" in log, log[-4000:]
        assert not image_exists(f"{PREFIX}/guard-must-fail")
    finally:
        buildah("rm", probe, check=False)
        buildah("rmi", "--force", GUARD_BASE, check=False)
