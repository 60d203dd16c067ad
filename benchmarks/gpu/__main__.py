"""``python -m benchmarks.gpu ...``: the same run as ``python benchmarks/gpu_run.py ...``."""

import time

STARTED = time.monotonic()  # the budget counts from the interpreter's first line

import sys  # noqa: E402

from benchmarks.gpu import interpreter_for_smoke  # noqa: E402

interpreter_for_smoke(sys.argv[1:])

from benchmarks.gpu.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(started=STARTED))
