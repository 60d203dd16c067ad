"""Data: webdataset shard writing and the LightningDataModules that stream shard sets, plus the
generated quick-start sets (digits, associative recall, toy translation)."""

from mmlight.data.digits import DigitsDataModule, write_digits_shards
from mmlight.data.images import ImageAugment, ImageShardDataModule
from mmlight.data.recall import RecallDataModule
from mmlight.data.shards import read_info, write_info
from mmlight.data.text import WikiTextDataModule
from mmlight.data.toy_translation import ToyTranslationDataModule
from mmlight.data.translation import TranslationDataModule

__all__ = [
    "DigitsDataModule",
    "write_digits_shards",
    "ImageAugment",
    "ImageShardDataModule",
    "RecallDataModule",
    "ToyTranslationDataModule",
    "TranslationDataModule",
    "WikiTextDataModule",
    "read_info",
    "write_info",
]
