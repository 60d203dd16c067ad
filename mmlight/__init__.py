"""mmlight: attention reweighting (softmax, MultiMax, sparsemax, entmax-1.5, ev-softmax, top-k) at scale.

Package map:
    reweighting/  the reweighting functions, their registry (``build``) and the paper's metrics
    nn/           the attention entry point every model calls
    models/       networks built from typed configs (ViT/DeiT via timm)
    tasks/        LightningModules: loss, metrics, optimiser, schedule, logging
    data/         webdataset shard writing, text vocabularies and tokenisers, and the
                  LightningDataModules that stream them (``data/prepare/``: ``mmlight prepare``)
    callbacks/    monitoring: MultiMax parameters and modulation curves, final metrics
    cli.py        the ``mmlight`` LightningCLI entry point
"""

__version__ = "0.1.0"
