"""mmlight: attention reweighting (softmax, MultiMax, sparsemax, entmax-1.5, ev-softmax, top-k, and
the functions that may attend to nothing: softmax1, the learned sink, softpick, sigmoid, stick-breaking;
Scalable-Softmax, α-entmax) and gated attention, at scale.

Package map (bottom layer first):
    kernels/      the Triton kernels of MultiMax (row-wise, fused attention, cross-entropy)
    reweighting/  the reweighting functions (one file each, registered on import), their registry
                  (``build``), the config entry ``ReweightingSpec`` and the paper's metrics
    nn/           the attention entry point every model calls, its observation point, the output gate
    models/       networks built from typed configs (ViT/DeiT via timm)
    tasks/        LightningModules: loss, metrics, optimiser, schedule, logging
    data/         webdataset shard writing, text vocabularies and tokenisers, and the
                  LightningDataModules that stream them (``data/prepare/``: ``mmlight prepare``)
    callbacks/    monitoring: learned reweighting parameters by site, MultiMax curves, final metrics
    analysis/     attention statistics, figures and robustness (``mmlight analyze``)
    experiments/  tables of runs (``mmlight sweep``, ``mmlight collect``)
    ckpt_path.py  ``--ckpt_path`` checked before any work, ``last`` resolved to the newest resume point
    slurm.py      the SLURM run directory and the task-count check
    lightning_cli.py  the LightningCLI of fit, validate, test and predict
    doctor.py     ``mmlight doctor``: the environment and the kernels on this machine
    cli.py        the ``mmlight`` command: its nine commands and their help

The layers and what each may import: docs/architecture.md, "Layers".
"""

__version__ = "0.1.0"
