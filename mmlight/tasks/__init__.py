"""Tasks: LightningModules that own loss, metrics, optimiser, schedule and logging."""

from mmlight.tasks.classification import ImageClassifier

__all__ = ["ImageClassifier"]
