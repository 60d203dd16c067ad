"""docker/Dockerfile built and run with buildah, on a stand-in for NGC's PyTorch image.

The stand-in is Debian 12 from debootstrap, then docker/torch-base.Dockerfile on it with the oldest
torch, torchvision and Triton that mmlight supports (.ci/oldest-pair.txt, from PyPI), pinned in
/etc/pip/constraint.txt as NGC pins its own. docker/Dockerfile is built on it unchanged apart from the
base argument, and run with ``buildah run`` (chroot isolation) as the image's own user. Skips, saying
why, where buildah or debootstrap is missing or cannot work (not root, no mount); .ci/run installs both
from Debian's packages. docs/docker.md has the figures.

The images are kept under ``localhost/mmlight-test/`` so that buildah's layer cache makes a rerun
quick; the Debian base is reused when present (``buildah rmi`` it to rebuild from Debian).

The builds are mostly downloads and disk writes. When this file's tests are among those chosen,
tests/conftest.py starts them in a background process (``python -m tests.helpers.docker``) as soon
as collection ends, so that they run alongside the CPU-bound tests; the ``images`` fixture waits for
that process. Run alone, or where nothing started it, the fixture builds in-process.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.helpers.checks import wait_for
from tests.helpers.docker import (
    DEBIAN,
    DOCKER,
    ENV,
    GID,
    IMAGE,
    OLDEST_PAIR,
    PREFIX,
    ROOT,
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


def test_image_keeps_the_stand_ins_pinned_oldest_pair(container):
    """The stand-in holds the oldest supported pair pinned in NGC's constraint file, and the mmlight image
    built on it still has exactly that pair (its other packages came from the install)."""
    script = (
        "import importlib.metadata as m, os, pathlib; "
        "print(os.environ['PIP_CONSTRAINT']); "
        "print(pathlib.Path(os.environ['PIP_CONSTRAINT']).read_text().strip()); "
        "print(*(f'{n}=={m.version(n)}' for n in ('torch', 'torchvision', 'triton')), 'mmlight', m.version('mmlight'))"
    )
    result = run(container, ["python", "-c", script])
    assert result.returncode == 0, result.stderr
    path, *constraints, installed = result.stdout.strip().splitlines()
    assert path == "/etc/pip/constraint.txt"
    assert sorted(constraints) == sorted(OLDEST_PAIR)
    assert installed.split() == [*OLDEST_PAIR, "mmlight", importlib.metadata.version("mmlight")]


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
    # what the container wrote where the host reads it; the logged values are checked outside Docker
    # (tests/callbacks/test_throughput.py, tests/tasks/): here they depend on the image's CPU and timing
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
    assert events and any(tag.startswith("train/") for tag in scalar_tags(events[0]))  # values: as above


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


def test_a_requirement_needing_another_torch_fails_the_build_naming_the_conflict(images, tmp_path):
    """NGC's mechanism: under the stand-in's constraint file, an mmlight whose requirements need another
    torch than the image's pinned one is not installed over it; pip stops the build and names both sides."""
    pinned = next(requirement for requirement in OLDEST_PAIR if requirement.startswith("torch=="))
    needs_other = "torch>" + pinned.removeprefix("torch==")
    context = tmp_path / "context"  # the source, with the requirement changed
    shutil.copytree(ROOT / "mmlight", context / "mmlight", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", ".dockerignore"):
        shutil.copy(ROOT / name, context / name)
    pyproject, count = re.subn(r'"torch>=[^"]*"', f'"{needs_other}"', (ROOT / "pyproject.toml").read_text())
    assert count == 1
    (context / "pyproject.toml").write_text(pyproject)
    tag = f"{PREFIX}/conflict-must-fail"
    _, log = build(
        DOCKER / "Dockerfile", tag, {"BASE_IMAGE": TORCH_BASE, "UID": str(UID), "GID": str(GID)}, False, context
    )
    assert "ResolutionImpossible" in log, log[-4000:]
    assert f"depends on {needs_other}" in log and f"The user requested (constraint) {pinned}" in log, log[-4000:]
    assert "pip install replaced the image's torch 2" not in log  # pip refused before the guard had to act
    assert not image_exists(tag)


#: the torch that the guard test's base lets pip install: a local wheel holding only ``torch.__version__``,
#: a build of the pinned version (a local label matches ``torchvision``'s ``torch==2.9.1``)
GUARD_TORCH = next(r for r in OLDEST_PAIR if r.startswith("torch==")).removeprefix("torch==") + "+guard"


def stand_in_torch_wheel(folder: Path, version: str) -> Path:
    """A wheel of a ``torch`` whose only content is its version: what pip installs in place of the image's."""
    name = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f"__version__ = {version!r}\n",
        f"{name}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{name}/WHEEL": "Wheel-Version: 1.0\nGenerator: mmlight-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{name}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{name}/RECORD"])
    wheel = folder / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def test_torch_guard_stops_a_build_that_would_replace_torch(images, tmp_path):
    """A base whose torch (metadata and ``torch.__version__``, 2.3.0) is below pyproject.toml's floor and
    whose constraint file pins another build (a local wheel, so that no CUDA torch is downloaded): pip
    replaces the image's torch, and the guard fails the build naming both versions. The base is the
    built mmlight image, back to root as NGC's is, so that the install step finds every other
    requirement in place (on the stand-in torch base it installed them all first: 2 minutes)."""
    wheel = stand_in_torch_wheel(tmp_path, GUARD_TORCH)
    (tmp_path / "Containerfile").write_text(
        f"FROM {IMAGE}\nUSER root\nCOPY {wheel.name} /opt/wheels/\nENV PIP_FIND_LINKS=/opt/wheels\n"
        f'RUN python -c "{FAKE_OLD_TORCH}" && sed -i "s/^torch==.*/torch=={GUARD_TORCH}/" /etc/pip/constraint.txt\n'
    )
    build(tmp_path / "Containerfile", GUARD_BASE, {}, context=tmp_path)
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
        assert f"pip install replaced the image's torch 2.3.0 with {GUARD_TORCH}" in log, log[-4000:]
        assert not image_exists(f"{PREFIX}/guard-must-fail")
    finally:
        buildah("rm", probe, check=False)
        buildah("rmi", "--force", GUARD_BASE, check=False)
