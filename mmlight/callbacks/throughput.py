"""Training speed in the logs: samples/s (and tokens/s for the sequence tasks), per device and in
total, the model FLOPs per sample and the model FLOP utilisation (MFU) against the device's peak.

The rates are Lightning's public :class:`~lightning.fabric.utilities.throughput.Throughput` over a
window of batches, one per stage, logged under the stage's name as Lightning's ``ThroughputMonitor``
logs them (TensorBoard tags ``train/device/samples_per_sec``, ``train/samples_per_sec`` (all devices,
with several), ``train/device/items_per_sec`` (tokens), ``train/device/flops_per_sec``,
``train/device/mfu``, and ``validate/...``, ``test/...``, ``predict/...`` without FLOPs). The FLOPs of
one training step (forward and backward) are counted once, by torch's FLOP counter
(:func:`lightning.fabric.utilities.throughput.measure_flops`) on a copy of the network on the meta
device: matmuls and attention only, as MFU is usually defined. The end of fit prints the mean.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from time import perf_counter

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.throughput import Throughput as Rates
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import Callback
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


def clock(device: torch.device) -> float:
    """Seconds (``time.perf_counter``) once the work queued on ``device`` is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # else the clock reads the time the kernels were queued at
    return perf_counter()


@dataclass
class Meter:
    """The running counts of one stage's batches since the stage started, fed to ``rates``.

    Args:
        rates: Lightning's windowed throughput of the stage.
        start: the clock when the stage started (training's moves on by the time spent in validation).
        elapsed: seconds from the start to the end of the latest batch.
        batches, samples, tokens: counted since the start.
        seen: batches over every run of the stage in this trainer call (the log step of an evaluation).
    """

    rates: Rates
    start: float = 0.0
    elapsed: float = 0.0
    batches: int = 0
    samples: int = 0
    tokens: int = 0
    seen: int = 0

    def restart(self, now: float) -> None:
        self.rates.reset()
        self.start, self.elapsed, self.batches, self.samples, self.tokens = now, 0.0, 0, 0, 0

    def add(self, now: float, samples: int, tokens: int | None, flops: float | None) -> None:
        """One batch of ``samples`` (and ``tokens``, None when not counted) that took ``flops`` per device."""
        self.batches, self.samples, self.seen = self.batches + 1, self.samples + samples, self.seen + 1
        self.tokens += tokens or 0
        self.elapsed = now - self.start
        lengths = None if tokens is None else self.tokens
        self.rates.update(time=self.elapsed, batches=self.batches, samples=self.samples, lengths=lengths, flops=flops)


class Throughput(Callback):
    """Samples/s, tokens/s, FLOPs per sample and MFU of every fit, to TensorBoard and the progress bar.

    The task says whether its batches have tokens (``counts_tokens``), how many samples and tokens a
    batch holds (``batch_counts(batch) -> (samples, tokens or None)``) and its training loss on a
    given network (``training_loss(batch, network)``). Rates are logged once ``window_size`` batches
    have been seen, per device (``train/device/samples_per_sec``) and, with several devices, in
    total (``train/samples_per_sec``), at the trainer's ``log_every_n_steps`` and the steps its
    training loss is logged at. A task without these members (one written outside mmlight) is run
    without throughput logs, with a warning that names what it lacks.

    Args:
        window_size: batches averaged in each logged value (at least 2).
    """

    #: what a task must offer (mmlight's tasks do: tasks/classification.py, tasks/sequence.py)
    PROTOCOL = ("counts_tokens", "batch_counts", "training_loss")

    def __init__(self, window_size: int = 10):
        if window_size < 2:
            raise ValueError(f"Throughput: window_size must be at least 2 (a rate needs two times), got {window_size}")
        self.window_size = window_size
        self.flops_per_sample: float | None = None
        self.available_flops: float | None = None
        self.disabled = False  # set by setup: the task lacks PROTOCOL
        self.meters: dict[str, Meter] = {}
        self.first: tuple[float, int, int] | None = None  # training's (time, samples, tokens) after its first batch
        self.last: tuple[float, int, int] | None = None  # ... after its latest batch
        self._counts_tokens = False
        self._device = torch.device("cpu")
        self._step: int | None = None  # the global step after the previous training batch

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.meters, self.first, self.last = {}, None, None  # each fit, validate, test or predict counts anew
        missing = [name for name in self.PROTOCOL if not hasattr(pl_module, name)]
        self.disabled = bool(missing)
        if missing:
            rank_zero_warn(
                f"Throughput: {type(pl_module).__name__} has no {', '.join(missing)} "
                "(mmlight/callbacks/throughput.py), so this run logs no samples/s, tokens/s or MFU"
            )
            return
        self._counts_tokens = bool(pl_module.counts_tokens)
        self._device = trainer.strategy.root_device
        self.available_flops = peak_flops(self._device)

    def _start(self, trainer, stage: str) -> None:
        """Starts ``stage``'s count (its meter made at its first start in this trainer call)."""
        if self.disabled or trainer.sanity_checking:
            return
        if stage not in self.meters:
            rates = Rates(self.available_flops, world_size=trainer.world_size, window_size=self.window_size)
            self.meters[stage] = Meter(rates)
        self.meters[stage].restart(clock(self._device))

    def _add(self, trainer, pl_module, batch, stage: str) -> Meter | None:
        """Counts ``batch`` into ``stage``'s meter (FLOPs for training only: the count is of a training step)."""
        if self.disabled or trainer.sanity_checking:
            return None
        samples, tokens = pl_module.batch_counts(batch)
        flops = self.flops_per_sample * samples if stage == "train" else None
        meter = self.meters[stage]  # made by the stage's start, which Lightning calls before its batches
        meter.add(clock(self._device), samples, tokens if self._counts_tokens else None, flops)
        return meter

    def _log(self, trainer, meter: Meter, stage: str, step: int) -> dict[str, float]:
        metrics = meter.rates.compute()
        sep = meter.rates.separator
        for logger in trainer.loggers:
            logger.log_metrics({f"{stage}{sep}{name}": value for name, value in metrics.items()}, step=step)
        return metrics

    # ------------------------------------------------------------------ training
    def on_train_start(self, trainer, pl_module) -> None:
        self._start(trainer, "train")
        self._step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.disabled or self.flops_per_sample is not None:
            return
        self.flops_per_sample = training_step_flops(pl_module, batch) / pl_module.batch_counts(batch)[0]
        for logger in trainer.loggers:
            logger.log_metrics({"train/flops_per_sample": self.flops_per_sample}, step=0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        meter = self._add(trainer, pl_module, batch, "train")
        if meter is None:
            return
        self.last = (meter.elapsed, meter.samples, meter.tokens)
        self.first = self.first or self.last
        # logged after an optimiser step only (the step's time included), when Lightning logs the
        # training loss: at every log_every_n_steps-th step, under the count of steps taken before it
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        every = trainer.log_every_n_steps
        if not stepped or not every or (trainer.global_step % every and not trainer.should_stop):
            return
        rates = self._log(trainer, meter, "train", trainer.global_step - 1)
        sep = meter.rates.separator
        for name, shown in (("samples", "samples/s"), ("items", "tokens/s")):
            rate = rates.get(f"{name}_per_sec", rates.get(f"device{sep}{name}_per_sec"))
            if rate is not None:
                pl_module.log(shown, rate, prog_bar=True, logger=False)  # every rank holds the same totals

    def on_train_end(self, trainer, pl_module) -> None:
        if self.disabled or self.first is None or self.last[0] <= self.first[0]:
            return
        # the mean after the first batch (compilation and the loader's start excluded), all devices
        seconds = self.last[0] - self.first[0]
        samples = (self.last[1] - self.first[1]) * trainer.world_size
        line = f"mean throughput: {samples / seconds:.1f} samples/s on {trainer.world_size} device(s)"
        if self._counts_tokens:
            line += f", {(self.last[2] - self.first[2]) * trainer.world_size / seconds:.1f} tokens/s"
        line += f", {self.flops_per_sample:.4g} FLOPs per sample"
        if self.available_flops:
            mfu = samples * self.flops_per_sample / seconds / trainer.world_size / self.available_flops
            line += f", MFU {mfu:.1%}"
        else:
            line += f" (no MFU: no bf16 peak known for {self._device})"
        rank_zero_info(line)

    # ------------------------------------------------------------------ evaluation
    def _eval_batch_end(self, trainer, pl_module, batch, stage: str) -> None:
        meter = self._add(trainer, pl_module, batch, stage)
        every = trainer.log_every_n_steps
        if meter is not None and every and meter.batches % every == 0:
            self._log(trainer, meter, stage, meter.seen)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._start(trainer, "validate")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, *args) -> None:
        self._eval_batch_end(trainer, pl_module, batch, "validate")

    def on_validation_end(self, trainer, pl_module) -> None:
        # both exist in a fit only (setup starts each trainer call without meters), after the sanity check
        train, val = self.meters.get("train"), self.meters.get("validate")
        if train is None or val is None:
            return
        # the training rates leave out the time from training's latest batch to validation's last one
        train.start += (val.start + val.elapsed) - (train.start + train.elapsed)

    def on_test_start(self, trainer, pl_module) -> None:
        self._start(trainer, "test")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, *args) -> None:
        self._eval_batch_end(trainer, pl_module, batch, "test")

    def on_predict_start(self, trainer, pl_module) -> None:
        self._start(trainer, "predict")

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, *args) -> None:
        self._eval_batch_end(trainer, pl_module, batch, "predict")
