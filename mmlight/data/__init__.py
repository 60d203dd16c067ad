"""Data: webdataset shard writing and the LightningDataModules that stream shard sets, plus the
generated quick-start sets (digits, associative recall, toy translation).

The names below are imported from their modules on first use, so that ``mmlight prepare`` (which
imports :mod:`mmlight.data.prepare`, and so this package) writes shards without importing Lightning.
:func:`load_all` imports every DataModule, as the command line does to know them by their short names.
"""

import importlib

#: Each exported name -> the module that defines it.
EXPORTS = {
    "DigitsDataModule": "mmlight.data.digits",
    "write_digits_shards": "mmlight.data.digits",
    "ImageAugment": "mmlight.data.images",
    "ImageShardDataModule": "mmlight.data.images",
    "RecallDataModule": "mmlight.data.recall",
    "ToyTranslationDataModule": "mmlight.data.toy_translation",
    "TranslationDataModule": "mmlight.data.translation",
    "WikiTextDataModule": "mmlight.data.text",
    "read_info": "mmlight.data.shards",
    "write_info": "mmlight.data.shards",
}
__all__ = [*EXPORTS, "load_all"]


def __getattr__(name: str):
    if name not in EXPORTS:
        raise AttributeError(f"module 'mmlight.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value  # a later lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})


def load_all() -> None:
    """Import every exported name's module (the DataModules among them)."""
    for name in EXPORTS:
        __getattr__(name)
