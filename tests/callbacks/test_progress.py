"""The progress bar's training description: epochs out of max_epochs, or steps out of max_steps."""

from types import SimpleNamespace

from lightning.pytorch.callbacks import RichProgressBar

from mmlight.callbacks import StepProgressBar


def description(max_epochs, max_steps, epoch=7, step=5200) -> str:
    bar = StepProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=max_epochs, max_steps=max_steps, global_step=step)
    return bar._get_train_description(epoch).strip()


def test_step_limited_runs_show_steps_out_of_max_steps():
    assert description(-1, 50000) == "Epoch 7, step 5200/50000"  # was "Epoch 7/-2"
    assert description(None, 50000) == "Epoch 7, step 5200/50000"
    assert description(-1, -1) == "Epoch 7, step 5200"  # neither limit: no denominator
    assert description(40, -1) == "Epoch 7/39"  # epoch-limited runs unchanged
    assert description(0, 100) == "Epoch 7/-1"  # max_epochs 0 limits by epochs too: Lightning's description
    assert description(-1, 0) == "Epoch 7, step 5200/0"  # max_steps 0 is a limit (-1 is none)


class Progress:
    """Records rich's ``progress.update`` calls."""

    def __init__(self):
        self.updates = []

    def update(self, task_id, **fields):
        self.updates.append((task_id, fields))


def test_step_limited_runs_renew_the_description_after_every_batch(monkeypatch):
    renewed_by_lightning = []  # Lightning's own update, with every argument passed on as given
    monkeypatch.setattr(RichProgressBar, "on_train_batch_end", lambda self, *args: renewed_by_lightning.append(args))
    for max_epochs, renewed in ((-1, True), (None, True), (40, False)):
        bar = StepProgressBar()
        bar._trainer = SimpleNamespace(max_epochs=max_epochs, max_steps=100, global_step=42, current_epoch=3)
        bar.progress, bar.train_progress_bar_id = Progress(), 7
        module, outputs, batch = object(), {"loss": 1.0}, ("x", "y")
        bar.on_train_batch_end(bar._trainer, module, outputs, batch, 5)
        want = [(7, {"description": "Epoch 3, step 42/100".ljust(len("Validation"))})] if renewed else []
        assert bar.progress.updates == want
        assert renewed_by_lightning[-1] == (bar._trainer, module, outputs, batch, 5)
    bar.progress = None  # no bar shown (e.g. not on rank 0): nothing to renew
    bar._trainer.max_epochs = -1
    bar.on_train_batch_end(bar._trainer, None, None, None, 0)
    bar.progress, bar.train_progress_bar_id = Progress(), None
    bar.on_train_batch_end(bar._trainer, None, None, None, 0)
    assert bar.progress.updates == []
