"""FinalMetrics: the final metrics name the step they come from (a stale validation is not passed
off as the final weights'), and validate/test record the checkpoint they evaluated; values are
checked against the mean squared error recomputed from the saved weights in float64."""

import json
from types import SimpleNamespace

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, TensorDataset

from mmlight.callbacks import FinalMetrics
from mmlight.callbacks.final_metrics import checkpoint_files

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
    return L.Trainer(
        accelerator="cpu",
        logger=TensorBoardLogger(tmp_path, name="r", version=version),
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_stale_validation_keeps_its_step_and_validate_gives_the_final_weights(tmp_path, capsys):
    every_epoch = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        filename="{epoch}-{step}",
        save_top_k=-1,
        save_last=True,
        save_on_train_epoch_end=True,
    )
    fit = trainer(
        tmp_path,
        "fit",
        max_epochs=3,
        check_val_every_n_epoch=2,
        num_sanity_val_steps=0,
        callbacks=[FinalMetrics(), every_epoch],
    )
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
    fit = trainer(
        tmp_path, "fit", max_epochs=1, limit_val_batches=0, callbacks=[FinalMetrics()], enable_checkpointing=False
    )
    fit.fit(Regression())
    record = json.loads((tmp_path / "r" / "fit" / "final_metrics.json").read_text())
    assert record["metrics"] == {} and record["global_step"] == 4
    assert "Final validation metrics: none were logged (step 4)." in capsys.readouterr().out


def test_checkpoint_files_name_the_monitored_best_and_the_last(tmp_path):
    """Only a ModelCheckpoint with a monitor has a best file; other callbacks in the list are passed over."""
    monitored = ModelCheckpoint(dirpath=tmp_path / "b", monitor="val/top1")
    monitored.best_model_path, monitored.best_model_score = str(tmp_path / "b" / "best-1-10.ckpt"), torch.tensor(95.5)
    unmonitored = ModelCheckpoint(dirpath=tmp_path / "l", save_last=True)
    unmonitored.best_model_path = str(tmp_path / "l" / "epoch=3.ckpt")  # its newest file, not a best one
    unmonitored.last_model_path = str(tmp_path / "l" / "last.ckpt")
    trainer = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(), monitored, unmonitored])
    assert checkpoint_files(trainer) == {
        "best": str((tmp_path / "b" / "best-1-10.ckpt").resolve()),
        "best_score": 95.5,
        "last": str((tmp_path / "l" / "last.ckpt").resolve()),
    }
    monitored.best_model_score = None  # a best file whose score is unknown
    assert checkpoint_files(trainer)["best_score"] is None


def test_a_forgotten_last_path_falls_back_to_the_last_file_on_disk(tmp_path):
    """A run resumed at its end (or moved) has no ``last_model_path``: the ``last.ckpt`` file in the
    callback's folder is named when it exists and the callback saves a last file, and only then."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    callback = ModelCheckpoint(dirpath=folder, save_last=True)
    trainer = SimpleNamespace(checkpoint_callbacks=[callback])
    assert callback.last_model_path == "" and checkpoint_files(trainer) == {}  # no file yet
    (folder / "last.ckpt").write_bytes(b"x")
    (folder / "last").write_bytes(b"x")  # not the name Lightning gives it
    assert checkpoint_files(trainer) == {"last": str((folder / "last.ckpt").resolve())}
    callback.save_last = False  # a callback that never saves a last file does not own one found there
    assert checkpoint_files(trainer) == {}
    callback.save_last, callback.dirpath = True, None  # no folder to look in (Lightning sets one at setup)
    assert checkpoint_files(trainer) == {}
    (folder / "last.ckpt").unlink()
    (folder / "last.ckpt").mkdir()  # a folder of that name is not a checkpoint file
    callback.dirpath = str(folder)
    assert checkpoint_files(trainer) == {}


def stand_in(fn, global_step=80, current_epoch=3, ckpt_path="/runs/last.ckpt"):
    return SimpleNamespace(
        state=SimpleNamespace(fn=fn), global_step=global_step, current_epoch=current_epoch, ckpt_path=ckpt_path
    )


def test_the_weights_step_is_the_trainers_in_fit_and_the_checkpoints_otherwise():
    metrics = FinalMetrics()
    assert metrics._weights_step(stand_in(TrainerFn.VALIDATING, 0, 0)) == (0, 0)  # no checkpoint loaded
    metrics.on_load_checkpoint(None, None, {"global_step": 50, "epoch": 2})
    assert metrics._weights_step(stand_in(TrainerFn.FITTING)) == (80, 3)  # a resumed fit: where training is
    assert metrics._weights_step(stand_in(TrainerFn.VALIDATING)) == (50, 2)
    metrics.on_load_checkpoint(None, None, {})  # a checkpoint without counters
    assert metrics._weights_step(stand_in(TrainerFn.TESTING)) == (0, 0)


def test_a_resumed_fit_names_no_evaluated_checkpoint(tmp_path, capsys):
    metrics = FinalMetrics()
    metrics._report(SimpleNamespace(**vars(stand_in(TrainerFn.FITTING)), checkpoint_callbacks=[]), "fit", str(tmp_path))
    record = json.loads((tmp_path / "final_metrics.json").read_text())
    assert record["checkpoint"] is None and record["checkpoints"] == {} and record["global_step"] == 80
    metrics._report(stand_in(TrainerFn.VALIDATING), "validate", str(tmp_path))
    assert json.loads((tmp_path / "final_metrics.json").read_text())["checkpoint"] == "/runs/last.ckpt"


def test_summary_text_line_by_line():
    """The printed summary, exactly: fresh values plain, stale ones marked, and the advice once."""
    from mmlight.callbacks.final_metrics import summary

    record = {
        "stage": "fit",
        "global_step": 40,
        "epoch": 3,
        "checkpoint": None,
        "metrics": {
            "val/loss": {"value": 0.123456, "step": 40, "epoch": 3},
            "val/top1": {"value": 91.5, "step": 30, "epoch": 2},
        },
    }
    assert summary(record).split("\n") == [
        "Final validation metrics (training ended at step 40, epoch 3):",
        f"  {'val/loss':<16} 0.1235   from step 40 (epoch 3)",
        f"  {'val/top1':<16} 91.5000   from step 30 (epoch 2)   <- not the final weights",
        "  The last validation ran before the final step 40; `mmlight validate --ckpt_path <last.ckpt>` "
        "evaluates the final weights.",
    ]
    fresh = dict(record, metrics={"val/loss": record["metrics"]["val/loss"]})
    assert summary(fresh).split("\n") == [
        "Final validation metrics (training ended at step 40, epoch 3):",
        f"  {'val/loss':<16} 0.1235   from step 40 (epoch 3)",
    ]
    # a validation inside the last epoch (val_check_interval < 1) that ran before its final step is
    # stale too: the step decides, not the epoch
    mid_epoch = dict(record, metrics={"val/loss": {"value": 0.5, "step": 35, "epoch": 3}})
    assert (
        summary(mid_epoch).split("\n")[1]
        == f"  {'val/loss':<16} 0.5000   from step 35 (epoch 3)   <- not the final weights"
    )
    tested = {
        "stage": "test",
        "global_step": 40,
        "epoch": 3,
        "checkpoint": "/r/last.ckpt",
        "metrics": {"test/bleu": {"value": 30.0, "step": 40, "epoch": 3}},
    }
    assert summary(tested).split("\n")[0] == "Final test metrics (checkpoint /r/last.ckpt at step 40):"


def test_write_json_makes_the_folders_and_leaves_no_temporary_file(tmp_path):
    from mmlight.callbacks.final_metrics import write_json

    path = tmp_path / "a" / "b" / "final_metrics.json"
    write_json(path, {"stage": "fit", "metrics": {"x": 1}})
    assert path.read_text() == '{\n "stage": "fit",\n "metrics": {\n  "x": 1\n }\n}\n'  # indent 1, one newline
    assert sorted(p.name for p in path.parent.iterdir()) == ["final_metrics.json"]
