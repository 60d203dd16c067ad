"""mmlight: attention reweighting at scale (softmax, MultiMax, sparsemax, entmax-1.5, α-entmax, ev-softmax,
top-k, and the functions that may attend to nothing or learn per head: softmax1, the learned sink, softpick,
sigmoid, ssmax, stick-breaking) and gated attention; ``mmlight.reweighting.available()`` names every
registered function: ``softmax``, ``multimax``, ``sparsemax``, ``entmax15``, ``alpha_entmax``,
``evsoftmax``, ``topk``, ``softmax1``, ``sink``, ``softpick``, ``sigmoid``, ``ssmax``, ``stickbreaking``.

Package map, bottom layer first (a module imports only its own package and the lines before its own;
``tests/test_layers.py`` checks it):
    kernels/      the Triton kernels of MultiMax (row-wise, fused attention, cross-entropy)
    safe_load.py  files from elsewhere read as data: checkpoints, pretrained weights, CIFAR pickles
    reweighting/  the reweighting functions (one file each, registered on import), their registry
                  (``build``), the config entry ``ReweightingSpec``, the backends, and the measures of
                  attention weights (``metrics.py``: the paper's M and S, entropy, rollout)
    nn/           the attention entry point every model calls, its observation point, the output gate
    models/, data/  networks built from typed configs (ViT/DeiT via timm, fairseq-shaped transformers);
                  webdataset shards, vocabularies, tokenisers, the LightningDataModules that stream
                  them, and the dataset preparers (``data/prepare/``)
    tasks/        LightningModules: loss, metrics, optimiser, schedule, logging
    analysis/     attention statistics, figures and robustness interventions
    callbacks/    monitoring: learned reweighting parameters by site, MultiMax curves, final metrics
    ckpt_path.py, slurm.py, experiments/  ``--ckpt_path`` checked and ``last`` resolved; the SLURM run
                  directory and task-count check; table files of runs
    export/       Llama-style LMs as transformers models, and the functions as transformers attention
    lightning_cli.py  the LightningCLI of fit, validate, test and predict
    commands/     ``mmlight prepare``, ``analyze``, ``sweep``, ``collect``, ``export`` and ``doctor``
    cli.py        the ``mmlight`` command: its commands and their help

The layers and what each may import: docs/architecture.md, "Layers".
"""

__version__ = "0.1.0"
