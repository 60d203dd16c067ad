"""FinalMetrics: the final metrics name the step they come from (a stale validation is not passed
off as the final weights'), and validate/test record the checkpoint they evaluated; values are
checked against the mean squared error recomputed from the saved weights in float64."""

import json

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from mmlight.callbacks import FinalMetrics

torch.manual_seed(0)
X_TRAIN, X_VAL = torch.randn(64, 4), torch.randn(32, 4)
W_TRUE = torch.tensor([1.0, -2.0, 0.5, 3.0])
Y_TRAIN, Y_VAL = X_TRAIN @ W_TRUE, X_VAL @ W_TRUE


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)

    def validation_step(self, batch, _):
        x, y = batch  # one batch: the whole validation set
        self.log("val/loss", torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y))

    def test_step(self, batch, _):
        x, y = batch
        self.log("test/loss", torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(X_TRAIN, Y_TRAIN), batch_size=16)  # 4 steps per epoch

    def val_dataloader(self):
        return DataLoader(TensorDataset(X_VAL, Y_VAL), batch_size=32)

    test_dataloader = val_dataloader


def mse_of(checkpoint_path) -> float:
    """The validation MSE of a checkpoint's weights, in float64, without Lightning."""
    state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)["state_dict"]
    pred = X_VAL.double() @ state["linear.weight"].double().squeeze(0) + state["linear.bias"].double()
    return float(((pred - Y_VAL.double()) ** 2).mean())


def trainer(tmp_path, version, **kwargs):
    return L.Trainer(accelerator="cpu", logger=TensorBoardLogger(tmp_path, name="r", version=version),
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_stale_validation_keeps_its_step_and_validate_gives_the_final_weights(tmp_path, capsys):
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}-{step}", save_top_k=-1, save_last=True,
                                  save_on_train_epoch_end=True)
    fit = trainer(tmp_path, "fit", max_epochs=3, check_val_every_n_epoch=2, num_sanity_val_steps=0,
                  callbacks=[FinalMetrics(), every_epoch])
    fit.fit(Regression())  # validates after epoch 1 (step 8) only; training ends at step 12

    record = json.loads((tmp_path / "r" / "fit" / "final_metrics.json").read_text())
    assert record["stage"] == "fit" and record["global_step"] == 12 and record["checkpoint"] is None
    entry = record["metrics"]["val/loss"]
    assert (entry["step"], entry["epoch"]) == (8, 1)
    assert abs(entry["value"] - mse_of(tmp_path / "ckpt" / "epoch=1-step=8.ckpt")) < 1e-5
    assert record["checkpoints"]["last"] == str((tmp_path / "ckpt" / "last.ckpt").resolve())
    out = capsys.readouterr().out
    assert "Final validation metrics (training ended at step 12" in out
    assert "from step 8 (epoch 1)   <- not the final weights" in out
    assert "evaluates the final weights" in out

    final = mse_of(tmp_path / "ckpt" / "last.ckpt")
    assert abs(final - entry["value"]) > 1e-3  # the stale value really is another model's
    validate = trainer(tmp_path, "validate", callbacks=[FinalMetrics()])
    validate.validate(Regression(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    record = json.loads((tmp_path / "r" / "validate" / "final_metrics.json").read_text())
    assert record["stage"] == "validate" and record["global_step"] == 12  # the checkpoint's step
    assert record["checkpoint"] == str(tmp_path / "ckpt" / "last.ckpt")
    assert record["metrics"]["val/loss"]["step"] == 12
    assert abs(record["metrics"]["val/loss"]["value"] - final) < 1e-5
    assert "not the final weights" not in capsys.readouterr().out

    test = trainer(tmp_path, "test", callbacks=[FinalMetrics()])
    test.test(Regression(), ckpt_path=str(tmp_path / "ckpt" / "epoch=1-step=8.ckpt"))
    record = json.loads((tmp_path / "r" / "test" / "final_metrics.json").read_text())
    assert record["stage"] == "test" and record["global_step"] == 8 and list(record["metrics"]) == ["test/loss"]
    assert abs(record["metrics"]["test/loss"]["value"] - mse_of(tmp_path / "ckpt" / "epoch=1-step=8.ckpt")) < 1e-5
    assert "Final test metrics (checkpoint" in capsys.readouterr().out


def test_a_run_without_validation_says_so(tmp_path, capsys):
    fit = trainer(tmp_path, "fit", max_epochs=1, limit_val_batches=0, callbacks=[FinalMetrics()], enable_checkpointing=False)
    fit.fit(Regression())
    record = json.loads((tmp_path / "r" / "fit" / "final_metrics.json").read_text())
    assert record["metrics"] == {} and record["global_step"] == 4
    assert "Final validation metrics: none were logged (step 4)." in capsys.readouterr().out
