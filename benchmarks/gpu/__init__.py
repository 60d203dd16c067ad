"""One prepared GPU run of mmlight's kernels and training steps, for a short lease of one H100/H200.

``python benchmarks/gpu_run.py --out DIR`` (or ``python -m benchmarks.gpu``) runs, in order of
worth, each section as far as the budget (480 s by default) allows:

1. ``preflight`` (:mod:`.preflight`): versions, device, which optional packages import;
2. ``correctness`` (:mod:`.correctness`): the shipped kernels against fp32, as ``mmlight doctor`` checks;
3. ``step`` (:mod:`.step`): the DeiT-small training step, softmax and MultiMax, eager and compiled, and
   timm's compiled DeiT-small as the peer;
4. ``attention`` (:mod:`.attention`): the fused kernel against SDPA at N = 197 and causal 1k/4k, as
   shipped, with each switch, all on, and the FlexAttention peer;
5. ``rowwise`` (:mod:`.rowwise`): ceilings, the fused cross-entropy and the row-wise kernel;
6. ``text_step`` (:mod:`.text_step`): the text recipes' networks (LM, translator, Llama-style), eager and
   compiled;
7. ``sweep`` (:mod:`.sweep`), ``profile`` (:mod:`.step`), ``fit`` (:mod:`.fit`).

:mod:`.record` holds the records and the deadlines, :mod:`.pool` the check pool, :mod:`.main` the
command line and the order. Records are JSON lines appended as each is measured.
"""

import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
if str(BENCHMARKS) not in sys.path:  # the scripts beside the package import each other by name
    sys.path.append(str(BENCHMARKS))


def interpreter_for_smoke(argv: list[str]) -> None:
    """Under ``--smoke`` without CUDA, Triton's interpreter: set before any kernel is defined."""
    if "--smoke" in argv:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
