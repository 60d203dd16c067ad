"""Tasks: LightningModules that own loss, metrics, optimiser, schedule and logging."""

from mmlight.tasks.classification import ImageClassifier
from mmlight.tasks.language_model import LanguageModel
from mmlight.tasks.translator import Translator

__all__ = ["ImageClassifier", "LanguageModel", "Translator"]
