"""One prepared GPU run of mmlight's kernels and training steps (the package ``benchmarks/gpu/``).

    python benchmarks/gpu_run.py --out "$OUT"                 # on the GPU: 480 s budget
    python benchmarks/gpu_run.py --smoke --out /tmp/smoke     # the same control flow on the CPU

See ``benchmarks/gpu/__init__.py`` for the sections and docs/kernels.md ("Measuring on a GPU").
"""

import time

STARTED = time.monotonic()  # the budget counts from the interpreter's first line

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: ``benchmarks.gpu``

from benchmarks.gpu import interpreter_for_smoke  # noqa: E402

interpreter_for_smoke(sys.argv[1:])

from benchmarks.gpu.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(started=STARTED))
