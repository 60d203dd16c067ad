"""Callbacks: attention statistics, monitoring of reweighting parameters, skipped samples, final metrics; the last checkpoint."""

from mmlight.callbacks.attention_stats import AttentionStats
from mmlight.callbacks.checkpoint import LastCheckpoint
from mmlight.callbacks.final_metrics import FinalMetrics
from mmlight.callbacks.reweighting_monitor import ReweightingMonitor, monitored_scalars, reweighting_sites
from mmlight.callbacks.skipped_samples import SkippedSamplesMonitor

__all__ = ["AttentionStats", "FinalMetrics", "LastCheckpoint", "ReweightingMonitor", "SkippedSamplesMonitor",
           "monitored_scalars", "reweighting_sites"]
