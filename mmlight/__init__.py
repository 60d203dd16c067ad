"""mmlight: attention reweighting (softmax, MultiMax, sparsemax, entmax-1.5, ev-softmax, top-k) at scale.

Package map:
    reweighting/  the reweighting functions (one file each, registered on import), their registry
                  (``build``), the config entry ``ReweightingSpec`` and the paper's metrics
    nn/           the attention entry point every model calls, and its observation point
    models/       networks built from typed configs (ViT/DeiT via timm)
    tasks/        LightningModules: loss, metrics, optimiser, schedule, logging
    data/         webdataset shard writing, text vocabularies and tokenisers, and the
                  LightningDataModules that stream them (``data/prepare/``: ``mmlight prepare``)
    callbacks/    monitoring: learned reweighting parameters by site, MultiMax curves, final metrics
    cli.py        the ``mmlight`` LightningCLI entry point
"""

__version__ = "0.1.0"
