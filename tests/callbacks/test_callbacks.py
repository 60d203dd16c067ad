"""Monitoring callbacks: MultiMax parameters as scalars, the sigma figure, the final metrics."""

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mmlight.callbacks import FinalMetrics, ReweightingMonitor
from mmlight.data import DigitsDataModule, write_digits_shards
from mmlight.models import ReweightingSpec
from mmlight.reweighting import MultiMax
from mmlight.tasks import ImageClassifier
from tests.helpers.models import micro_vit


def test_monitor_logs_parameters_curves_and_final_metrics(tmp_path, capsys):
    write_digits_shards(tmp_path / "digits")
    model = ImageClassifier(
        micro_vit(attention=ReweightingSpec("multimax"), output_multimax=True),
        lr_reference_batch=None,
        warmup_epochs=0,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        log_every_n_steps=1,
        enable_progress_bar=False,
        logger=TensorBoardLogger(tmp_path / "runs", name="t"),
        callbacks=[ReweightingMonitor(), FinalMetrics()],
        enable_checkpointing=False,
    )
    trainer.fit(model, DigitsDataModule(cache_dir=str(tmp_path / "digits"), batch_size=16))

    events = EventAccumulator(str(tmp_path / "runs" / "t" / "version_0"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    sites = model.model.reweighting_sites()  # blocks.0 ... blocks.3 and output, each a MultiMax
    assert list(sites) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "output"]
    for layer, module in sites.items():
        for i in range(4):
            for name in ("ranges", "ts"):
                # the last logged step's value: the final weights, after the last step (fp32 to float in the event)
                logged = events.Scalars(f"reweighting/{layer}/{name}_{i}")[-1].value
                assert logged == pytest.approx(getattr(module, name)[i].item(), abs=1e-3), (layer, name, i)
    assert {t for t in scalars if t.startswith("reweighting/")} == {
        f"reweighting/{layer}/{name}_{i}" for layer in sites for name in ("ranges", "ts") for i in range(4)
    }
    assert "multimax/sigma_curves" in events.Tags()["images"]
    out = capsys.readouterr().out
    printed = {line.split()[0]: float(line.split()[1]) for line in out.splitlines() if line.strip().startswith("val/")}
    assert "Final validation metrics" in out
    # printed to 4 decimals: within half a unit of the last (0.03125 prints as 0.0312, rounded half to
    # even, 5e-5 away up to float rounding of the difference)
    assert printed["val/top1"] == pytest.approx(trainer.callback_metrics["val/top1"].item(), abs=5e-5 + 1e-9)


def test_sigma_figure_has_one_panel_per_layer():
    modules = {f"blocks.{i}": MultiMax() for i in range(5)}
    figure = ReweightingMonitor().figure(modules)
    titled = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in titled] == list(modules)
    assert all(len(ax.lines) == 2 for ax in titled)  # identity and sigma
    x, y = titled[0].lines[1].get_data()
    torch.testing.assert_close(torch.as_tensor(y), modules["blocks.0"].modulate(torch.as_tensor(x)).detach())


def test_skipped_samples_are_logged_as_a_running_count(tmp_path):
    """A corrupt sample in the validation shards reaches TensorBoard as data/skipped_samples."""
    import io

    import numpy as np
    import webdataset as wds
    from PIL import Image

    from mmlight.callbacks import SkippedSamplesMonitor

    write_digits_shards(tmp_path / "digits")
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8), mode="L").save(buf, format="PNG")
    with wds.TarWriter(str(tmp_path / "digits" / "val-000000.tar")) as writer:  # replace a val shard
        writer.write({"__key__": "fine", "png": buf.getvalue(), "cls": "0"})
        writer.write({"__key__": "corrupt", "png": b"\x89PNG truncated", "cls": "1"})
    model = ImageClassifier(
        micro_vit(),
        lr_reference_batch=None,
        warmup_epochs=0,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=2,
        log_every_n_steps=1,
        enable_progress_bar=False,
        logger=TensorBoardLogger(tmp_path / "runs", name="t"),
        callbacks=[SkippedSamplesMonitor()],
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DigitsDataModule(cache_dir=str(tmp_path / "digits"), batch_size=16))
    assert trainer.callback_metrics["data/skipped_samples"] == 1
    events = EventAccumulator(str(tmp_path / "runs" / "t" / "version_0"))
    events.Reload()
    assert events.Scalars("data/skipped_samples")[-1].value == 1


def test_monitor_reports_any_learnable_reweighting_by_site_name():
    """A learnable softmax temperature is logged as a temperature (not its logarithm), MultiMax's
    vectors element by element, and a fixed softmax not at all."""
    from mmlight.callbacks import monitored_scalars, reweighting_sites
    from mmlight.models import ReweightedViT

    model = ImageClassifier(
        micro_vit(attention=ReweightingSpec("softmax", {"temperature": 0.5, "learnable": True}), output_multimax=True),
        lr_reference_batch=None,
        warmup_epochs=0,
    )
    with torch.no_grad():
        model.model.vit.blocks[2].attn.reweight.log_temperature.fill_(0.7)
    scalars = monitored_scalars(reweighting_sites(model))
    assert scalars["reweighting/blocks.0/temperature"] == pytest.approx(0.5)
    assert scalars["reweighting/blocks.2/temperature"] == pytest.approx(2.0137527, rel=1e-6)  # e^0.7
    assert [scalars[f"reweighting/output/ts_{i}"] for i in range(4)] == pytest.approx(model.model.output.ts.tolist())
    assert len(scalars) == 4 + 2 * 4
    fixed = ReweightedViT(micro_vit())
    assert monitored_scalars(reweighting_sites(fixed)) == {}
