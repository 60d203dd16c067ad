"""Softmax with a temperature, optionally learnable."""

from __future__ import annotations

import torch
from torch import nn

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.fused import SigmaKernels
from mmlight.reweighting.registry import register

#: the largest |log temperature| a learnable temperature takes effect with (e^60 * 1e12 < fp32's maximum)
LOG_TEMPERATURE_BOUND = 60.0


@register("softmax")
class Softmax(Reweighting):
    """``softmax(x / temperature)`` over the last dimension.

    Args:
        temperature: the divisor of the scores (the paper's 1/t); 1 is plain softmax.
        learnable: make the temperature a trained parameter (stored as its logarithm, so it stays
            positive). A fixed temperature lets attention use fused SDPA kernels.
        backend: ``auto``, ``reference``, ``compile`` or ``triton`` (the Triton kernel needs a fixed
            temperature).
    """

    def __init__(self, temperature: float = 1.0, learnable: bool = False, backend: Backend = "auto"):
        super().__init__(backend)
        if temperature <= 0:
            raise ValueError(f"softmax temperature must be positive, got {temperature}")
        self.learnable = learnable
        if learnable:
            self.log_temperature = nn.Parameter(torch.tensor(float(temperature)).log())
        else:
            # A Python float, not a buffer: DDP broadcasts buffers before every forward, also in
            # evaluation, which deadlocks when ranks run different numbers of evaluation batches.
            self.fixed_temperature = float(temperature)
            self.sdpa_scale = 1.0 / temperature

    @property
    def temperature(self) -> torch.Tensor:
        return self.log_temperature.exp() if self.learnable else torch.tensor(self.fixed_temperature)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        if not self.learnable:
            return x / self.fixed_temperature
        # x * exp(-log T): at a temperature of e^100 the division x / exp(100) is x / inf in fp32, whose
        # gradient in log T is 0 * inf = NaN. log T is held to +-LOG_TEMPERATURE_BOUND, where the weights
        # are uniform or one-hot to fp32 precision anyway, so that scores up to 1e12 stay finite.
        bound = LOG_TEMPERATURE_BOUND
        return x * torch.exp(-self.log_temperature.clamp(-bound, bound)).to(x.dtype)

    def fused(self) -> SigmaKernels | None:
        return None if self.learnable else SigmaKernels(self.sdpa_scale, None, None)

    def monitored(self) -> dict[str, torch.Tensor]:
        return {"temperature": self.temperature} if self.learnable else {}

    def extra_repr(self) -> str:
        return f"temperature={float(self.temperature):.4g}, learnable={self.learnable}"
