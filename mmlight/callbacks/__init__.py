"""Callbacks: monitoring of reweighting parameters and final metrics."""

from mmlight.callbacks.final_metrics import FinalMetrics
from mmlight.callbacks.reweighting_monitor import ReweightingMonitor, multimax_modules

__all__ = ["FinalMetrics", "ReweightingMonitor", "multimax_modules"]
