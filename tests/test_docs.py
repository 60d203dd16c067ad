"""The docs stay true: every fenced shell command of README.md, docs/**/*.md and BENCHMARKS.md is covered,
and every relative link and anchor of theirs resolves.

A fenced block with no language (or ``sh``, ``bash``, ``shell``, ``console``) holds shell commands; other
blocks name their language (``text``, ``yaml``, ``python``, ...). Each command is checked by the rule of
its program, and a program without a rule fails, so a new command cannot go untested:

* ``mmlight fit|validate|test|predict``: the config and the options on the line are parsed with
  ``--print_config`` (``--ckpt_path`` left out: running from a checkpoint is ``tests/test_cli.py``'s);
* the other ``mmlight`` commands, ``python benchmarks/*.py``, ``python tools/*.py``, ``tensorboard``:
  ``--help`` exits 0 and names every option the line uses (``mmlight prepare <dataset> --help``, which
  lists the dataset's own options; the help of ``mmlight export FORMAT`` is its format's);
* ``sbatch``: the script exists and ``bash -n`` parses it; ``sbatch --test-only`` submits it where a
  SLURM cluster answers (``test_sbatch_test_only``, which skips otherwise);
* ``docker``/``podman``/``apptainer``/``srun``: the Dockerfile exists and the ``mmlight`` command run in
  the image is checked as above (the image itself: ``tests/test_docker.py``);
* ``pip install``: the extras exist in pyproject.toml; ``pytest``: the paths exist; ``mkdir``: nothing;
* ``python -c``: the checkpoint conversion of docs/finetuning.md, which ``tests/test_safe_load.py`` runs.

The README's Python blocks are run.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mmlight.safe_load import CONVERT_COMMAND

pytestmark = pytest.mark.usefixtures("plain_argv")  # LightningCLI reads sys.argv

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "BENCHMARKS.md"]
SHELL = {"", "sh", "bash", "shell", "console"}
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.S | re.M)
TRAINER_COMMANDS = {"fit", "validate", "test", "predict"}
IMAGE_ROOT = "/opt/mmlight/"  # the repository's place in the Docker image


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of a Markdown file."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", text)
    commands = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            commands.append(line)
    return commands


def doc_commands() -> list[tuple[str, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), command)
        for path in DOCS
        for language, text in fenced_blocks(path)
        if language in SHELL
        for command in shell_commands(text)
    ]


COMMANDS = doc_commands()


def split_env(command: str) -> tuple[dict[str, str], list[str]]:
    """The leading ``VAR=value`` assignments of a command, and its words after them. ``$s``-style shell
    variables read 0 (the loop variable of a documented ``for s in 0 1 2``)."""
    tokens = shlex.split(re.sub(r"\$\{?\w+\}?", "0", command))
    env = {}
    while tokens and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0]):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    return env, tokens


def words(command: str) -> list[str]:
    return split_env(command)[1]


def options(tokens: list[str]) -> list[str]:
    """The long options a command line uses (before a bare ``--``), without values and synopsis brackets."""
    tokens = tokens[: tokens.index("--")] if "--" in tokens else tokens
    names = (re.split(r"[=+\[\]]", t.strip("[]"))[0] for t in tokens if t.strip("[").startswith("--"))
    return [n for n in names if n and "*" not in n]


def mmlight_exit(args: list[str], capsys) -> tuple[int, str]:
    from mmlight.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out = capsys.readouterr()
    return exit_info.value.code or 0, out.out + out.err


@functools.cache
def script_help(program: tuple[str, ...]) -> str:
    result = subprocess.run([*program, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, f"{' '.join(program)} --help failed: {result.stderr[-2000:]}"
    return result.stdout


#: Runs each script given with ``--help`` as ``python SCRIPT --help`` would (``__main__``, its folder first on
#: ``sys.path``), one after another in one process, and writes {script: [exit status, help text]} as JSON.
HELP_RUNNER = """
import contextlib, io, json, runpy, sys
out, scripts = sys.argv[1], sys.argv[2:]
helps = {}
for script in scripts:
    sys.argv = [script, "--help"]
    sys.path.insert(0, script.rsplit("/", 1)[0])
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = stop.code or 0
    helps[script] = [status, text.getvalue()]
    sys.path.pop(0)
open(out, "w").write(json.dumps(helps))
"""


@functools.cache
def python_script_helps() -> dict[str, tuple[int, str]]:
    """``--help`` of every ``benchmarks/`` and ``tools/`` script the docs run, from one Python process: the
    scripts import torch, and a process each would import it once per script."""
    scripts = {str(ROOT / words(c)[1]) for _, c in COMMANDS if words(c)[0] == "python" and words(c)[1] != "-c"}
    scripts = sorted(script for script in scripts if Path(script).is_file())  # a missing one fails its own test
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "helps.json"
        subprocess.run([sys.executable, "-c", HELP_RUNNER, str(out), *scripts], cwd=ROOT, timeout=600, check=True)
        return {script: tuple(result) for script, result in json.loads(out.read_text()).items()}


def check_help_names(help_text: str, tokens: list[str], command: str) -> None:
    missing = [o for o in options(tokens) if not re.search(re.escape(o) + r"\b", help_text)]
    assert not missing, f"{command!r} uses options its --help does not name: {missing}"


def without_ckpt_path(args: list[str]) -> list[str]:
    """The arguments without ``--ckpt_path`` and the checkpoint paths after it."""
    if "--ckpt_path" not in args:
        return args
    i = args.index("--ckpt_path")
    j = i + 1
    while j < len(args) and not args[j].startswith("--"):
        j += 1
    return args[:i] + args[j:]


def check_mmlight(tokens: list[str], command: str, capsys) -> None:
    assert len(tokens) > 1, f"{command!r}: no mmlight command"
    sub, args = tokens[1], [a.removeprefix(IMAGE_ROOT) for a in tokens[2:]]
    if sub in TRAINER_COMMANDS:
        code, out = mmlight_exit([sub, *without_ckpt_path(args), "--print_config"], capsys)
        assert code == 0, f"{command!r} does not parse:\n{out[-3000:]}"
        assert "class_path: mmlight.tasks." in out
        return
    dataset = next(a for a in args if not a.startswith("-")) if sub == "prepare" else None
    # `mmlight prepare DATASET` and `mmlight export FORMAT`: the dataset's or format's own options
    help_args = [sub, args[0], "--help"] if sub == "export" else [sub, *([dataset] if dataset else []), "--help"]
    code, out = mmlight_exit(help_args, capsys)
    assert code == 0, f"mmlight {' '.join(help_args)} failed:\n{out[-3000:]}"
    check_help_names(out, args, command)
    if sub == "prepare":
        assert re.search(rf"\b{dataset}\b", out), f"{command!r}: mmlight prepare does not know {dataset!r}"


def check_python(tokens: list[str], command: str) -> None:
    script = ROOT / tokens[1]
    assert script.parent.name in ("benchmarks", "tools") and script.is_file(), f"{command!r}: no script {script}"
    status, help_text = python_script_helps()[str(script)]
    assert status == 0, f"{command!r}: python {tokens[1]} --help exited with {status}"
    check_help_names(help_text, tokens[2:], command)


def check_sbatch(tokens: list[str], command: str) -> None:
    scripts = [t for t in tokens[1:] if t.endswith(".sh")]
    assert len(scripts) == 1 and (ROOT / scripts[0]).is_file(), f"{command!r}: no script"
    subprocess.run(["bash", "-n", str(ROOT / scripts[0])], check=True)
    after = tokens[tokens.index(scripts[0]) + 1 :]
    config = next((a for a in after if a.endswith(".yaml")), None)
    if config is not None:
        assert (ROOT / config).is_file(), f"{command!r}: no config {config}"


def check_container(tokens: list[str], command: str, capsys) -> None:
    if tokens[0] == "srun":
        tokens = tokens[1:]
    runtime, action = tokens[0], tokens[1]
    assert runtime in ("docker", "podman", "apptainer"), command
    if action == "build" and runtime != "apptainer":
        dockerfile = tokens[tokens.index("-f") + 1]
        assert (ROOT / dockerfile).is_file() and "-t" in tokens, command
        assert re.fullmatch(r"mmlight(-base)?(:\w+)?", tokens[tokens.index("-t") + 1]), command
        base = [t.split("=", 1)[1] for t in tokens if t.startswith("BASE_IMAGE=")]
        assert base in ([], ["mmlight-base"]), f"a base the docs build first, or NGC's default: {command}"
    elif action == "build":
        assert re.fullmatch(r"docker(-daemon)?://.*mmlight:latest", tokens[-1]), command
    else:
        assert action in ("run", "exec") and {"mmlight", "mmlight:cpu"} & set(tokens[2:]), command
        image = max(
            i for i, t in enumerate(tokens) if t in ("mmlight", "mmlight:cpu", "mmlight.sif") and i + 1 < len(tokens)
        )
        inside = tokens[image + 1 :]
        inside = inside if inside[0] == "mmlight" else ["mmlight", *inside]  # the image's entrypoint is mmlight
        check_mmlight(inside, command, capsys)


def check_image_test_step(command: str, capsys) -> None:
    """A step of docs/docker.md's buildah recipe: tests/test_docker_image.py (with the builds of
    tests/helpers/docker.py) takes the same step (the same buildah subcommand, the same Dockerfile,
    debootstrap's minbase variant), and an ``mmlight`` command run inside the image is checked as above."""
    test = "".join((ROOT / "tests" / name).read_text() for name in ("test_docker_image.py", "helpers/docker.py"))
    for sub in re.findall(r"buildah (\w+)", command):
        assert f'"{sub}"' in test, f"{command!r}: tests/test_docker_image.py never runs buildah {sub}"
    for dockerfile in re.findall(r"-f (\S+)", command):
        assert (ROOT / dockerfile).is_file() and Path(dockerfile).name in test, command
    if "debootstrap" in command:
        assert "--variant=minbase" in command and '"--variant=minbase"' in test, command
    if " -- tini -- mmlight " in command:
        check_mmlight(words(command.split(" -- tini -- ", 1)[1]), command, capsys)


def check_pip(tokens: list[str], command: str) -> None:
    assert tokens[1:3] == ["install", "-e"], command
    extras = re.fullmatch(r"\.\[([\w,]+)\]", tokens[3]).group(1).split(",")
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    missing = [e for e in extras if not re.search(rf"^{e}\s*=", section, re.M)]
    assert not missing, f"{command!r}: extras {missing} not in pyproject.toml"


def check_pytest(tokens: list[str], command: str) -> None:
    paths = [t for t in tokens[1:] if t.startswith("tests")]
    assert all((ROOT / p).exists() for p in paths), f"{command!r}: a path does not exist"
    if "-m" in tokens:
        marker = tokens[tokens.index("-m") + 1].removeprefix("not ")
        assert marker in (ROOT / "pyproject.toml").read_text(), f"{command!r}: marker {marker!r} not declared"


@pytest.mark.parametrize("doc, command", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_command_is_covered(doc, command, capsys):
    tokens = words(command)
    program = tokens[0]
    if program == "mmlight":
        check_mmlight(tokens, command, capsys)
    elif program == "python" and tokens[1] == "-c":
        # the one-liner that converts a trusted checkpoint: tests/test_safe_load.py runs it as the doc writes it
        assert command.startswith(f"{CONVERT_COMMAND} "), f"{doc}: no test runs {command!r}"
    elif program == "python":
        check_python(tokens, command)
    elif program == "sbatch":
        check_sbatch(tokens, command)
    elif program in ("docker", "podman", "apptainer", "srun"):
        check_container(tokens, command, capsys)
    elif program == "pip":
        check_pip(tokens, command)
    elif program == "pytest":
        check_pytest(tokens, command)
    elif program == "tensorboard":
        tensorboard = shutil.which("tensorboard", path=str(Path(sys.executable).parent)) or "tensorboard"
        check_help_names(script_help((tensorboard,)), tokens[1:], command)
    elif program == "mkdir":
        assert tokens == ["mkdir", "-p", "runs"], command
    elif "buildah" in command or program == "debootstrap":
        check_image_test_step(command, capsys)
    else:
        pytest.fail(f"{doc}: no test covers {command!r}; add a rule to tests/test_docs.py")


def test_the_docs_have_commands_and_untagged_blocks_are_shell():
    """The extraction finds the README's commands; blocks that are not shell say what they are."""
    readme = [c for d, c in COMMANDS if d == "README.md"]
    assert 'pip install -e ".[dev]"' in readme
    assert "mmlight fit --config configs/quickstart/digits_multimax.yaml" in readme
    assert sum(c.startswith("mmlight ") for c in readme) >= 10
    assert shell_commands("a \\\n  b  # c\n\n# d\ne") == ["a b", "e"]
    assert options(["mmlight", "x", "[--num_samples", "N]", "--a=1", "--b+=c", "--data.*", "--", "--late"]) == [
        "--num_samples",
        "--a",
        "--b",
    ]


def slurm_cluster_answers() -> bool:
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    return subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30).returncode == 0


SBATCH = [(d, c) for d, c in COMMANDS if words(c)[0] == "sbatch"]
# the test cluster has one node, no GPUs and no named partition or account: the resources are
# replaced after the documented options (sbatch takes the last value), and lines naming a partition
# or account as a placeholder are checked statically only
TEST_CLUSTER = ["--nodes", "1", "--ntasks-per-node", "1", "--gpus-per-node", "0", "--cpus-per-task", "1"]


@pytest.mark.parametrize("doc, command", SBATCH, ids=[f"{d}:{c[:60]}" for d, c in SBATCH])
def test_sbatch_test_only(doc, command):
    if not slurm_cluster_answers():
        pytest.skip("no SLURM cluster answers scontrol ping (.ci/slurm-cluster.sh starts one)")
    env, tokens = split_env(command)
    if {"PARTITION", "ACCOUNT"} & set(tokens):
        pytest.skip(f"{command!r} names a partition or account placeholder")
    script = next(i for i, t in enumerate(tokens) if t.endswith(".sh"))
    argv = ["sbatch", "--test-only", *tokens[1:script], *TEST_CLUSTER, *tokens[script:]]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60, env={**os.environ, **env})
    assert result.returncode == 0, f"{' '.join(argv)}:\n{result.stderr}"


def test_readme_python_runs():
    """The README's Python blocks run as written (on the CPU)."""
    blocks = [text for language, text in fenced_blocks(ROOT / "README.md") if language == "python"]
    assert blocks
    for text in blocks:
        namespace: dict = {}
        exec(compile(text, "README.md", "exec"), namespace)
    assert tuple(namespace["y"].shape) == (2, 16, 64)


# ---------------------------------------------------------------------------------------------------------
# References to code and tests: `path.py::name`, `test_module::test_name`, `tests/...` and `dir/file.py`

#: a code or test reference in backticks: a path (``.py`` optional for test modules), ``::`` and a dotted name
CODE_REFERENCE = re.compile(r"`([\w./-]+?)::([\w*]+(?:\.[\w*]+)*)(?:\(.*?\))?(\.\.\.)?`")
#: a file path in backticks: ``tests/...``, ``dir/file.py`` or a test module ``test_x.py``
PATH_REFERENCE = re.compile(r"`((?:tests/[\w./*<>-]*)|(?:[\w.-]+/)+[\w.*<>-]+\.py|test_[\w*<>]+\.py)`")
#: where a reference may be rooted: the repository, the package, the tests
ROOTS = ("", "mmlight/", "tests/")


@functools.cache
def python_files() -> list[str]:
    """Every Python file of the repository (tracked, or new and not ignored), as a path relative to it:
    git's list, so that a virtual environment inside the clone (CI's ``.ci-venv``) is not read."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(f for f in listed if (ROOT / f).is_file())


def files_named(path: str) -> list[str]:
    """The files a reference's path may mean: rooted at the repository, the package or the tests, or (a
    bare or partial path such as ``backend.py``) any file whose path ends with it."""
    path = path if path.endswith(".py") else f"{path}.py"
    rooted = [f"{root}{path}" for root in ROOTS if (ROOT / root / path).is_file()]
    return rooted or [f for f in python_files() if f.endswith("/" + path)]


def defines(path: str, dotted: str, prefix: bool = False) -> bool:
    """Whether the module at ``path`` defines ``dotted`` (``name`` or ``Class.member``) at top level or in a
    class body; ``prefix``: a name that starts with the last part (a name shortened with ``...``)."""
    import ast

    scope = ast.parse((ROOT / path).read_text(encoding="utf-8")).body
    *outer, last = dotted.split(".")
    for part in outer:
        scope = next((n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        if scope is None:
            return False
    names = set()
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return any(n.startswith(last) for n in names) if prefix else last in names


def doc_references(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    return [(path.relative_to(ROOT).as_posix(), m) for path in DOCS for m in pattern.finditer(path.read_text())]


def test_reference_patterns_read_every_form():
    found = [m.groups() for m in CODE_REFERENCE.finditer("`a/b.py::C.d` `test_x::test_y_...` `n.py::f(x, y)` `t::*`")]
    assert found == [("a/b.py", "C.d", None), ("test_x", "test_y_", "..."), ("n.py", "f", None), ("t", "*", None)]
    paths = PATH_REFERENCE.findall("`tests/a/` `nn/sites.py` `test_doctor.py` `x.py` `tests/test_<name>.py` `a b.py`")
    assert paths == ["tests/a/", "nn/sites.py", "test_doctor.py", "tests/test_<name>.py"]
    assert files_named("backend.py") == ["mmlight/reweighting/backend.py"]
    assert files_named("tasks/test_metrics") == ["tests/tasks/test_metrics.py"]
    assert files_named("prepare/writer.py") == []
    assert defines("mmlight/tasks/stages.py", "EvalStages") and not defines("mmlight/tasks/stages.py", "Missing")
    assert defines("mmlight/reweighting/base.py", "Reweighting.reference")
    assert not defines("mmlight/reweighting/base.py", "Reweighting.nothing")
    assert defines("tests/test_docs.py", "test_reference_pat", prefix=True)


@pytest.mark.parametrize(
    "doc, reference",
    [(doc, m.group(0)) for doc, m in doc_references(CODE_REFERENCE)] or [("none", "none")],
)
def test_every_code_and_test_reference_resolves(doc, reference):
    """`path.py::name` and `test_module::test_name` name a file of the repository that defines the name."""
    path, name, shortened = CODE_REFERENCE.fullmatch(reference).groups()
    candidates = files_named(path)
    assert candidates, f"{doc}: {reference}: no file {path}"
    if name != "*":
        assert any(defines(c, name, prefix=bool(shortened)) for c in candidates), f"{doc}: {reference}: no {name}"


@pytest.mark.parametrize("doc, reference", [(doc, m.group(1)) for doc, m in doc_references(PATH_REFERENCE)])
def test_every_path_reference_exists(doc, reference):
    """A file or folder path in the docs exists (a ``<name>`` placeholder is any name; a glob matches)."""
    pattern = re.sub(r"<\w+>", "*", reference).rstrip("/")
    if "/" not in reference:  # a test module named alone
        assert list((ROOT / "tests").rglob(pattern)), f"{doc}: no test module {reference}"
        return
    matches = [m for root in ROOTS for m in ROOT.glob(root + pattern)] if "*" in pattern else None
    if matches is None:
        matches = [ROOT / root / pattern for root in ROOTS if (ROOT / root / pattern).exists()]
        matches += [f for f in python_files() if f.endswith("/" + pattern)]
    assert matches, f"{doc}: {reference} does not exist"


# ---------------------------------------------------------------------------------------------------------
# The reweighting functions: every table and list of them is the registry's

#: the files that list the functions, and how: a Markdown table headed ``| name |`` (exactly the registry's
#: names), or every name in backticks somewhere in the text
FUNCTION_TABLES = ("README.md", "docs/reweightings.md")
FUNCTION_LISTS = ("docs/architecture.md", "mmlight/__init__.py")
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()


def name_tables(text: str) -> list[list[str]]:
    """The first column of every Markdown table whose header's first cell is ``name``, backticks removed."""
    tables, rows = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            rows = None
        elif rows is None and cells[0] == "name":
            rows = []
            tables.append(rows)
        elif rows is not None and not set(cells[0]) <= set("-: "):
            rows.append(cells[0].strip("`"))
    return tables


def test_name_tables_reads_the_first_column_of_name_tables():
    text = "| name | x |\n|---|---|\n| `a` | 1 |\n| `b` | 2 |\n\n| other | y |\n|---|---|\n| `c` | 3 |\n"
    assert name_tables(text) == [["a", "b"]]


@pytest.mark.parametrize("doc", FUNCTION_TABLES)
def test_every_function_table_is_the_registry(doc):
    """The table of functions names each registered function once and nothing else, and a heading that
    counts them ("The twelve functions") counts them all."""
    from mmlight.reweighting import available

    text = (ROOT / doc).read_text(encoding="utf-8")
    tables = name_tables(text)
    assert len(tables) == 1, f"{doc}: {len(tables)} tables headed | name |"
    assert sorted(tables[0]) == sorted(available()) and len(set(tables[0])) == len(tables[0])
    for word in re.findall(r"^#+ The (\w+) functions", text, re.M):
        assert NUMBER_WORDS.index(word) == len(available()), f"{doc}: 'The {word} functions'"


@pytest.mark.parametrize("doc", FUNCTION_LISTS)
def test_every_function_list_names_the_whole_registry(doc):
    """The package map of the architecture and the package's docstring name every registered function in
    backticks (``name`` or `name`)."""
    from mmlight.reweighting import available

    named = set(re.findall(r"`+(\w+)`+", (ROOT / doc).read_text(encoding="utf-8")))
    assert sorted(set(available()) - named) == []


# ---------------------------------------------------------------------------------------------------------
# Links: every relative Markdown link (and image) names a file git knows, and its anchor a heading there

#: ``[text](target)`` or ``![alt](target "title")``; the text may hold one level of brackets
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
#: inline code, where brackets are code and not links
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def markdown_text(path: Path) -> str:
    """The prose of a Markdown file: fenced blocks and inline code removed."""
    return CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))


def heading_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: the text of links and code kept, lower case, every character
    that is neither a letter, a digit, ``_``, ``-`` nor a space dropped, spaces made ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, a repeated one numbered ``-1``, ``-2``, ... as GitHub does."""
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        anchor, n = heading_anchor(heading), 0
        while (anchor if n == 0 else f"{anchor}-{n}") in found:
            n += 1
        found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


@functools.cache
def git_paths() -> frozenset[str]:
    """Every file git knows (tracked, or new and not ignored) and every folder above one, relative to
    the repository."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    folders = {"/".join(f.split("/")[:i]) for f in listed for i in range(1, f.count("/") + 1)}
    return frozenset(listed) | folders


def broken_links(doc: Path, root: Path = ROOT, known: frozenset[str] | None = None) -> list[str]:
    """The relative links of ``doc`` whose file git does not know, or whose anchor no heading of the
    target (``#anchor`` alone: of ``doc``) gives."""
    known = git_paths() if known is None else known
    broken = []
    for target in LINK.findall(markdown_text(doc)):
        if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:: not the repository's
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc.resolve()
        try:
            relative = file.relative_to(root.resolve()).as_posix()
        except ValueError:
            broken.append(f"{target} (outside the repository)")
            continue
        if relative not in known:
            broken.append(f"{target} (no such file in git)")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target} (no heading #{anchor} in {relative})")
    return broken


def test_heading_anchors_are_githubs():
    """Anchors as GitHub renders them for headings of these docs (read off the rendered pages)."""
    assert heading_anchor("Image classification: digits") == "image-classification-digits"
    assert heading_anchor("During training: `AttentionStats`") == "during-training-attentionstats"
    assert heading_anchor("Robustness (`--robustness`)") == "robustness---robustness"
    assert heading_anchor("The CPU comparison: `configs/tables/cpu_reweighting.yaml`") == (
        "the-cpu-comparison-configstablescpu_reweightingyaml"
    )
    assert heading_anchor("α-entmax & [the sink](x.md)") == "α-entmax--the-sink"


def test_broken_links_finds_a_missing_file_a_missing_anchor_and_passes_the_rest(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Twice\n\n## Twice\n")
    doc = tmp_path / "docs" / "b.md"
    doc.write_text(
        "# B: `c`\n\n[ok](a.md#twice-1) [self](#b-c) ![img](../x.png) [web](https://x.org/#y) `[code](no.md)`\n"
        "[gone](c.md) [anchor](a.md#thrice) [out](../../elsewhere.md)\n\n```\n[fenced](no.md)\n```\n"
    )
    known = frozenset({"docs", "docs/a.md", "docs/b.md", "x.png"})
    assert broken_links(doc, tmp_path, known) == [
        "c.md (no such file in git)",
        "a.md#thrice (no heading #thrice in docs/a.md)",
        "../../elsewhere.md (outside the repository)",
    ]


LINKED_DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(doc):
    assert broken_links(doc) == [], f"{doc.relative_to(ROOT)}: broken links"


def test_the_readme_stays_within_260_lines():
    """The README is the front page: detail belongs in docs/, which it links to."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; move detail to docs/"
