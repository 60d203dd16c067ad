"""Section ``preflight``: versions, the device, and which optional packages import.

Each package is imported in a process of its own, all at once, each for at most
:data:`IMPORT_LIMIT_S` seconds, so a package that is missing, broken or slow to import is a field of
this record, not a failure of the run. The sections that need one record their own error naming it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

from benchmarks.gpu.record import Run

#: Packages the sections import beyond torch and Triton, and who needs them.
OPTIONAL = {
    "mmlight": "every section but this one",
    "timm": "step (timm's DeiT-small, the compiled peer)",
    "lightning": "fit",
    "jsonargparse": "fit (mmlight's command line)",
    "webdataset": "fit (the shards' loader)",
    "tensorboard": "fit (its logged images/s)",
    "yaml": "fit",
    "entmax": "mmlight's sparsemax, entmax15 and alpha_entmax (not timed here)",
}
#: Seconds each import may take. Cold imports run side by side can be slow: on an H200 node timm and
#: lightning took over 8 s, and were there.
IMPORT_LIMIT_S = 15.0
TIMEOUT = "timeout: not imported in"
SMI_FIELDS = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.draw,power.limit,temperature.gpu"


def nvidia_smi(timeout: float = 5.0) -> dict | None:
    """Clocks, power, temperature and driver as ``nvidia-smi`` reads them (None without it)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(zip(SMI_FIELDS.split(","), (v.strip() for v in out.splitlines()[0].split(",")))) if out else None


def imports(names: list[str], limit_s: float) -> dict[str, str]:
    """``name -> "ok <version>"`` or the error's last line (``"timeout"`` past ``limit_s``), each package
    imported in a fresh interpreter, all in parallel."""
    code = "import importlib, sys; m = importlib.import_module(sys.argv[1]); print(getattr(m, '__version__', '?'))"
    children = {
        name: subprocess.Popen(
            [sys.executable, "-c", code, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name in names
    }
    end = time.monotonic() + limit_s
    found = {}
    for name, child in children.items():
        try:
            out, err = child.communicate(timeout=max(end - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            found[name] = f"{TIMEOUT} {limit_s:.0f} s"
            continue
        lines = [line for line in err.splitlines() if line.strip()]
        found[name] = f"ok {out.strip()}" if child.returncode == 0 else (lines[-1] if lines else "failed")
    return found


def unavailable(packages: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(missing, slow)`` of :func:`imports`' result, each ``name -> who needs it``: the packages whose
    import failed, and those still importing at the limit (most likely present: the sections that need
    them import them without a limit, and name them if they fail)."""
    missing = {n: OPTIONAL[n] for n, state in packages.items() if not state.startswith(("ok", TIMEOUT))}
    slow = {n: OPTIONAL[n] for n, state in packages.items() if state.startswith(TIMEOUT)}
    return missing, slow


def section(run: Run) -> None:
    import torch

    cuda = torch.cuda.is_available()
    packages = imports(list(OPTIONAL), min(IMPORT_LIMIT_S, max(run.left(), 1)))
    missing, slow = unavailable(packages)
    props = torch.cuda.get_device_properties(0) if cuda else None
    run.emit(
        kind="env",
        python=platform.python_version(),
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if cuda else None,
        capability=list(torch.cuda.get_device_capability()) if cuda else None,
        sms=props.multi_processor_count if props else None,
        memory_gib=round(props.total_memory / 2**30, 1) if props else None,
        cpus=os.cpu_count(),
        nvidia_smi=nvidia_smi(),
        packages=packages,
        missing=missing,
        slow=slow,
    )
