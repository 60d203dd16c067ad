"""Monitoring of learned reweighting functions: their parameters as scalars, MultiMax's sigma as curves."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from mmlight.nn.attention import network_of
from mmlight.reweighting import MultiMax, Reweighting


def reweighting_sites(module: torch.nn.Module) -> dict[str, Reweighting]:
    """Every reweighting module of a task or model by the model's site names (``blocks.3``,
    ``decoder.layers.1.cross_attn``, ``output``); empty for a module that names none."""
    try:
        return network_of(module).reweighting_sites()
    except TypeError:
        return {}


def monitored_scalars(sites: dict[str, Reweighting]) -> dict[str, float]:
    """``reweighting/<site>/<name>`` (``_<i>`` per element of a vector) for every learned quantity."""
    scalars = {}
    for site, module in sites.items():
        for name, value in module.monitored().items():
            values = value.detach().float().cpu().reshape(-1).tolist()
            if len(values) == 1:
                scalars[f"reweighting/{site}/{name}"] = values[0]
            else:
                scalars.update({f"reweighting/{site}/{name}_{i}": v for i, v in enumerate(values)})
    return scalars


class ReweightingMonitor(L.Callback):
    """Logs the learned quantities of every reweighting function (MultiMax's ``ranges``/``ts``, a
    learnable softmax temperature, ...) as ``reweighting/<site>/<name>[_<i>]`` each
    ``log_every_n_steps``, and after each validation epoch a figure of the learned sigma(x) of every
    MultiMax against the identity (the paper's Figure 3) to TensorBoard.

    Args:
        curve_range: the x range of the figure, in score units.
    """

    def __init__(self, curve_range: tuple[float, float] = (-6.0, 6.0)):
        self.curve_range = curve_range

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % trainer.log_every_n_steps:
            return
        scalars = monitored_scalars(reweighting_sites(pl_module))
        if scalars:
            pl_module.log_dict(scalars, on_step=True, on_epoch=False)

    @rank_zero_only
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        modules = {site: m for site, m in reweighting_sites(pl_module).items() if isinstance(m, MultiMax)}
        if not modules or trainer.sanity_checking:
            return
        loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not loggers:
            return
        figure = self.figure(modules)
        for lg in loggers:
            lg.experiment.add_figure("multimax/sigma_curves", figure, global_step=trainer.global_step)

    def figure(self, modules: dict[str, MultiMax]):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        x = torch.linspace(*self.curve_range, 241)
        cols = min(4, len(modules))
        rows = -(-len(modules) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.6 * rows), squeeze=False)
        for ax, (name, m) in zip(axes.flat, modules.items()):
            with torch.no_grad():
                y = m.modulate(x.to(m.ts.device)).cpu()
            ax.plot(x, x, "k--", lw=1, label="identity")
            ax.plot(x, y, lw=1.5, label="sigma")
            ax.set_title(name, fontsize=9)
        for ax in list(axes.flat)[len(modules) :]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        return fig
