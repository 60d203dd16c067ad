"""Callbacks: attention statistics, monitoring of reweighting parameters, skipped samples, data-loader
waits, final metrics; the last checkpoint and the checkpoint on SLURM's warning signal; per-step
seeding and the data position of a resumed run; the progress bar."""

from mmlight.callbacks.attention_stats import AttentionStats
from mmlight.callbacks.checkpoint import LastCheckpoint
from mmlight.callbacks.data_position import DataPosition
from mmlight.callbacks.data_wait import DataWaitMonitor
from mmlight.callbacks.final_metrics import FinalMetrics
from mmlight.callbacks.progress import StepProgressBar
from mmlight.callbacks.requeue import SlurmRequeue
from mmlight.callbacks.reweighting_monitor import ReweightingMonitor, monitored_scalars, reweighting_sites
from mmlight.callbacks.skipped_samples import SkippedSamplesMonitor
from mmlight.callbacks.step_seed import StepSeed
from mmlight.callbacks.throughput import Throughput

__all__ = [
    "AttentionStats",
    "DataPosition",
    "DataWaitMonitor",
    "FinalMetrics",
    "LastCheckpoint",
    "ReweightingMonitor",
    "SkippedSamplesMonitor",
    "SlurmRequeue",
    "StepProgressBar",
    "StepSeed",
    "Throughput",
    "monitored_scalars",
    "reweighting_sites",
]
