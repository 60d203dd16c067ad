"""Training speed in the logs: samples/s (and tokens/s for the sequence tasks), per device and in
total, the model FLOPs per sample and the model FLOP utilisation (MFU) against the device's peak.

Built on Lightning's :class:`~lightning.pytorch.callbacks.ThroughputMonitor` (TensorBoard tags
``train/device/samples_per_sec``, ``train/samples_per_sec`` (all devices, with several),
``train/device/items_per_sec`` (tokens), ``train/device/flops_per_sec``, ``train/device/mfu``, over
a window of batches). The FLOPs of one
training step (forward and backward) are counted once, by torch's FLOP counter
(:func:`lightning.fabric.utilities.throughput.measure_flops`) on a copy of the network on the meta
device: matmuls and attention only, as MFU is usually defined. The end of fit prints the mean.
"""

from __future__ import annotations

import copy

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from mmlight.reweighting import Reweighting

#: Dense bf16 tensor-core peak per GPU, FLOP/s, by a substring of the CUDA device name. Sources:
#: NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOPS bf16 dense; the datasheet's 1,979 is with
#: sparsity), H200 datasheet (989, the same chip), A100 datasheet (312). Other devices (the CPU
#: included) have no entry: no MFU is logged for them.
PEAK_BF16_DENSE = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak from :data:`PEAK_BF16_DENSE`, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_DENSE.items() if key in name), None)


def training_step_flops(pl_module, batch) -> int:
    """FLOPs of one training step (forward and backward) of ``batch``, counted on a meta-device copy
    of the task's network (``pl_module.training_loss(batch, network)``). The copy computes every
    reweighting function by its reference (no kernel runs on the meta device); a fused kernel does
    the same products."""
    network = copy.deepcopy(pl_module.model).to("meta")
    for module in network.modules():
        if isinstance(module, Reweighting):
            module.backend = "reference"
    meta_batch = apply_to_collection(batch, torch.Tensor, lambda t: t.to("meta"))
    return measure_flops(network, lambda: pl_module.training_loss(meta_batch, network), loss_fn=lambda loss: loss)


class Throughput(ThroughputMonitor):
    """Samples/s, tokens/s, FLOPs per sample and MFU of every fit, to TensorBoard and the progress bar.

    The task says whether its batches have tokens (``counts_tokens``), how many samples and tokens a
    batch holds (``batch_counts(batch) -> (samples, tokens or None)``) and its training loss on a
    given network (``training_loss(batch, network)``). Rates are logged once ``window_size`` batches
    have been seen, per device (``train/device/samples_per_sec``) and, with several devices, in
    total (``train/samples_per_sec``). A task without these members (one written outside mmlight) is
    run without throughput logs, with a warning that names what it lacks.

    Args:
        window_size: batches averaged in each logged value.
    """

    def __init__(self, window_size: int = 10):
        super().__init__(batch_size_fn=self._samples_in, length_fn=self._tokens_in, window_size=window_size)
        self._module = None
        self._first: tuple[float, int, int] | None = None  # (time, samples, tokens) after the first batch
        self.flops_per_sample: float | None = None
        self.disabled = False  # set by setup: the task lacks PROTOCOL

    def _start(self, trainer) -> None:
        if not self.disabled:
            super()._start(trainer)

    def _update(self, trainer, pl_module, batch, iter_num: int) -> None:
        if not self.disabled:
            super()._update(trainer, pl_module, batch, iter_num)

    def _compute(self, trainer, iter_num: int | None = None) -> None:
        if not self.disabled:
            super()._compute(trainer, iter_num)

    def on_validation_end(self, trainer, *args) -> None:
        if not self.disabled:
            super().on_validation_end(trainer, *args)

    def _samples_in(self, batch) -> int:
        return self._module.batch_counts(batch)[0]

    def _tokens_in(self, batch) -> int:
        return self._module.batch_counts(batch)[1]

    #: what a task must offer (mmlight's tasks do: tasks/classification.py, tasks/sequence.py)
    PROTOCOL = ("counts_tokens", "batch_counts", "training_loss")

    def setup(self, trainer, pl_module, stage: str) -> None:
        missing = [name for name in self.PROTOCOL if not hasattr(pl_module, name)]
        self.disabled = bool(missing)
        if missing:
            rank_zero_warn(
                f"Throughput: {type(pl_module).__name__} has no {', '.join(missing)} "
                "(mmlight/callbacks/throughput.py), so this run logs no samples/s, tokens/s or MFU"
            )
            return
        super().setup(trainer, pl_module, stage)
        self._module = pl_module
        if not pl_module.counts_tokens:
            self.length_fn = None
        self.available_flops = peak_flops(trainer.strategy.root_device)
        for throughput in self._throughputs.values():
            throughput.available_flops = self.available_flops

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.disabled:
            return
        samples = pl_module.batch_counts(batch)[0]
        if self.flops_per_sample is None:
            self.flops_per_sample = training_step_flops(pl_module, batch) / samples
            if trainer.logger is not None:
                trainer.logger.log_metrics({"train/flops_per_sample": self.flops_per_sample}, step=0)
        # read by ThroughputMonitor for this batch (a batch's size may vary: token budgets, the last batch)
        pl_module.flops_per_batch = self.flops_per_sample * samples

    def on_validation_batch_start(self, trainer, pl_module, batch, *args) -> None:
        if self.disabled:
            return
        # validation logs its samples/s, but no FLOPs: the count is of a training step (with backward)
        pl_module.flops_per_batch = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, *args) -> None:
        if self.disabled:
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
        stage = RunningStage.TRAINING
        throughput = self._throughputs[stage]
        if not throughput._time:  # ranks other than 0 measure nothing
            return
        now = (throughput._time[-1], self._samples[stage], self._lengths[stage])
        if self._first is None:
            self._first = now
        rates = throughput.compute()
        sep = throughput.separator
        for name in ("samples", "items"):
            rate = rates.get(f"{name}_per_sec", rates.get(f"device{sep}{name}_per_sec"))
            if rate is not None and (name == "samples" or self.length_fn is not None):
                shown = "samples/s" if name == "samples" else "tokens/s"
                pl_module.log(shown, rate, prog_bar=True, logger=False, rank_zero_only=True)
        self._last = now

    def on_train_end(self, trainer, pl_module) -> None:
        if self.disabled:
            return
        if self._first is None or self._last[0] <= self._first[0]:
            return
        # the mean after the first batch (compilation and the loader's start excluded), all devices
        seconds = self._last[0] - self._first[0]
        samples = (self._last[1] - self._first[1]) * trainer.world_size
        line = f"mean throughput: {samples / seconds:.1f} samples/s on {trainer.world_size} device(s)"
        if self.length_fn is not None:
            line += f", {(self._last[2] - self._first[2]) * trainer.world_size / seconds:.1f} tokens/s"
        line += f", {self.flops_per_sample:.4g} FLOPs per sample"
        if self.available_flops:
            mfu = samples * self.flops_per_sample / seconds / trainer.world_size / self.available_flops
            line += f", MFU {mfu:.1%}"
        else:
            line += f" (no MFU: no bf16 peak known for {trainer.strategy.root_device})"
        rank_zero_info(line)
