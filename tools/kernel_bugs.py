"""Plant each one-line bug of ``tools/kernel_bugs.toml`` in the Triton kernel files (which mutmut does not
mutate: ``tools/mutation.py``'s ``BY_HAND``) and check that a test catches it (docs/testing.md).

    python tools/kernel_bugs.py              # every bug; exit status 1 if one is not caught
    python tools/kernel_bugs.py --bug 3 7    # some of them (1-based, in the file's order)

The tree (tracked and untracked files, as the working tree has them) is copied to
``build/kernel-bugs/tree``; its tests run there, so the working tree is never changed. First every named
test runs on the unchanged copy and must pass; then for each bug its file is changed, its tests run under
Triton's interpreter (``-x``, one process) and the file is restored. A bug is caught when pytest reports
a failed test (exit status 1); any other outcome (passed, an error before the tests) is reported as not
caught. The report is ``build/kernel-bugs/report.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
BUGS = ROOT / "tools" / "kernel_bugs.toml"
BUILD = ROOT / "build" / "kernel-bugs"


@dataclass(frozen=True)
class Bug:
    """One planted bug.

    Args:
        file: the kernel file, relative to the repository root.
        find: the text changed; it occurs exactly once in ``file``, or ``occurrence`` names which one.
        replace: what ``find`` becomes.
        tests: pytest node ids (or files) that should catch it.
        what: the bug in words.
        occurrence: which occurrence of ``find`` (1-based) when it occurs more than once.
    """

    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    what: str
    occurrence: int | None = None


def load(path: Path = BUGS) -> list[Bug]:
    """The bugs of ``path``, in its order."""
    return [Bug(**{**entry, "tests": tuple(entry["tests"])}) for entry in tomllib.loads(path.read_text())["bug"]]


def planted(source: str, bug: Bug) -> str:
    """``source`` with ``bug`` planted; a ValueError when ``find`` does not occur as the bug states."""
    starts = [m.start() for m in re.finditer(re.escape(bug.find), source)]
    if bug.occurrence is None and len(starts) != 1:
        raise ValueError(f"{bug.file}: {bug.find!r} occurs {len(starts)} times, not once (set occurrence)")
    if bug.occurrence is not None and not 1 <= bug.occurrence <= len(starts):
        raise ValueError(f"{bug.file}: {bug.find!r} occurs {len(starts)} times, not {bug.occurrence} or more")
    at = starts[(bug.occurrence or 1) - 1]
    return source[:at] + bug.replace + source[at + len(bug.find) :]


def copy_tree(dest: Path) -> None:
    """The tracked and untracked (not ignored) files of the working tree, copied to ``dest``."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    shutil.rmtree(dest, ignore_errors=True)
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, str]:
    """pytest's exit status on ``tests`` in ``tree`` under Triton's interpreter, and the first failed test."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "", *tests]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    failed = re.search(r"^FAILED (\S+)", done.stdout, re.M)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    return done.returncode, failed.group(1) if failed else last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", type=int, nargs="*", help="the bugs to plant, 1-based (default: all)")
    args = parser.parse_args(argv)
    bugs = load()
    outside = [i for i in args.bug or () if not 1 <= i <= len(bugs)]
    if outside:
        parser.error(f"--bug takes numbers from 1 to {len(bugs)} (tools/kernel_bugs.toml's order), got {outside}")
    chosen = args.bug or range(1, len(bugs) + 1)
    tree = BUILD / "tree"
    copy_tree(tree)
    tests = tuple(dict.fromkeys(t for i in chosen for t in bugs[i - 1].tests))
    status, first = run_tests(tree, tests)
    if status != 0:
        print(f"the named tests do not pass on the unchanged tree (pytest exit status {status}): {first}")
        return 1
    rows, missed = [], 0
    for i in chosen:
        bug = bugs[i - 1]
        path = tree / bug.file
        original = path.read_text()
        path.write_text(planted(original, bug))
        start = time.monotonic()
        try:
            status, first = run_tests(tree, bug.tests)
        finally:
            path.write_text(original)
        caught = status == 1
        missed += not caught
        verdict = f"caught by `{first}`" if caught else f"NOT CAUGHT (pytest exit status {status})"
        rows.append(
            f"| {i} | `{bug.file.removeprefix('mmlight/')}` | {bug.what} | {verdict} | {time.monotonic() - start:.0f} |"
        )
        print(rows[-1], flush=True)
    report = ["| bug | file | what | result | seconds |", "|---|---|---|---|---|", *rows]
    (BUILD / "report.md").write_text("\n".join(report) + "\n")
    print(f"{len(rows) - missed} of {len(rows)} caught; report: {BUILD / 'report.md'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
