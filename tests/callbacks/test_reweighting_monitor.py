"""ReweightingMonitor through stand-in trainers: which modules it finds and their short names, the
parameter scalars every ``log_every_n_steps``, and when the sigma figure goes to TensorBoard."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from mmlight.callbacks import ReweightingMonitor, reweighting_sites
from mmlight.models import ReweightingSpec
from mmlight.tasks import ImageClassifier
from tests.helpers.models import micro_vit


def classifier(attention="multimax", output_multimax=True) -> ImageClassifier:
    return ImageClassifier(
        micro_vit(num_classes=3, attention=ReweightingSpec(attention), output_multimax=output_multimax)
    )


def test_reweighting_sites_are_named_by_layer():
    module = classifier()
    found = reweighting_sites(module)
    assert list(found) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "output"]
    assert found["blocks.2"] is module.model.vit.blocks[2].attn.reweight and found["output"] is module.model.output
    assert list(reweighting_sites(classifier("softmax", False))) == [f"blocks.{i}" for i in range(4)]
    assert reweighting_sites(torch.nn.Linear(2, 2)) == {}


def logged_scalars(module, global_step, every):
    calls = []
    module.log_dict = lambda values, **options: calls.append((values, options))
    trainer = SimpleNamespace(global_step=global_step, log_every_n_steps=every)
    ReweightingMonitor().on_train_batch_end(trainer, module, None, None, 0)
    return calls


def test_parameters_are_logged_every_n_steps():
    module = classifier()
    with torch.no_grad():
        module.model.output.ts.copy_(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    ((values, options),) = logged_scalars(module, 6, 3)
    assert options == {"on_step": True, "on_epoch": False}
    assert len(values) == 5 * 2 * 4  # 5 modules x (ranges, ts) x 4 entries at order 2
    assert [values[f"reweighting/output/ts_{i}"] for i in range(4)] == torch.tensor([0.1, 0.2, 0.3, 0.4]).tolist()
    assert values["reweighting/blocks.1/ranges_3"] == module.model.vit.blocks[1].attn.reweight.ranges[3].item()
    assert logged_scalars(module, 7, 3) == []
    assert logged_scalars(classifier("softmax", False), 6, 3) == []


class RecordingLogger(TensorBoardLogger):
    def __init__(self, save_dir):
        super().__init__(save_dir)
        self.figures = []

    @property
    def experiment(self):
        return SimpleNamespace(add_figure=lambda tag, figure, global_step: self.figures.append((tag, global_step)))


def test_figure_after_validation_but_not_in_the_sanity_check(tmp_path):
    tb = RecordingLogger(tmp_path)
    monitor = ReweightingMonitor()
    for sanity, module, loggers in [
        (True, classifier(), [tb]),
        (False, classifier("softmax", False), [tb]),
        (False, classifier(), []),
        (False, classifier(), [tb]),
    ]:
        trainer = SimpleNamespace(sanity_checking=sanity, loggers=loggers, global_step=12)
        monitor.on_validation_epoch_end(trainer, module)
    assert tb.figures == [("multimax/sigma_curves", 12)]


def test_sigma_figure_layout_and_style():
    from mmlight.reweighting import MultiMax

    monitor = ReweightingMonitor(curve_range=(-2.0, 3.0))
    figure = monitor.figure({f"blocks.{i}": MultiMax() for i in range(5)})
    assert len(figure.axes) == 8 and tuple(figure.get_size_inches()) == pytest.approx((12.0, 5.2))  # 2 x 4
    assert [ax.axison for ax in figure.axes] == [True] * 5 + [False] * 3  # spare panels hidden
    first = figure.axes[0]
    identity, sigma = first.lines
    x, y = identity.get_data()
    assert len(x) == 241 and (x[0], x[-1]) == pytest.approx((-2.0, 3.0)) and list(y) == list(x)
    assert (identity.get_linestyle(), identity.get_color(), identity.get_linewidth()) == ("--", "k", 1.0)
    assert sigma.get_linewidth() == 1.5 and first.title.get_fontsize() == 9
    legend = first.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["identity", "sigma"] and legend.get_texts()[
        0
    ].get_fontsize() == 7
    assert all(ax.get_legend() is None for ax in figure.axes[1:])
    single = monitor.figure({"output": MultiMax()})  # one panel: still a grid, not a bare Axes
    assert [ax.get_title() for ax in single.axes] == ["output"]


def test_sigma_curves_are_computed_on_the_parameters_device():
    """The curve's x values go to the device of the module's parameters (a GPU in training; here the
    meta device stands in), and come back to the CPU to be drawn."""
    seen = []

    class OnMeta(torch.nn.Module):
        ts = torch.empty(4, device="meta")

        def modulate(self, x):
            seen.append(x.device.type)
            return torch.zeros(x.shape)  # what a GPU module's output is after .cpu()

    figure = ReweightingMonitor(curve_range=(-1.0, 1.0)).figure({"blocks.0": OnMeta()})
    assert seen == ["meta"] and len(figure.axes[0].lines) == 2
