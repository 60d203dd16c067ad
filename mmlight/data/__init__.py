"""Data: webdataset shard writing and the LightningDataModules that stream shard sets."""

from mmlight.data.digits import DigitsDataModule, write_digits_shards
from mmlight.data.images import ImageAugment, ImageShardDataModule
from mmlight.data.shards import read_info, write_info
from mmlight.data.text import WikiTextDataModule
from mmlight.data.translation import TranslationDataModule

__all__ = ["DigitsDataModule", "write_digits_shards", "ImageAugment", "ImageShardDataModule",
           "TranslationDataModule", "WikiTextDataModule", "read_info", "write_info"]
