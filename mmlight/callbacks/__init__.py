"""Callbacks: monitoring of reweighting parameters, skipped samples, and final metrics."""

from mmlight.callbacks.final_metrics import FinalMetrics
from mmlight.callbacks.reweighting_monitor import ReweightingMonitor, multimax_modules
from mmlight.callbacks.skipped_samples import SkippedSamplesMonitor

__all__ = ["FinalMetrics", "ReweightingMonitor", "SkippedSamplesMonitor", "multimax_modules"]
