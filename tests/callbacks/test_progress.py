"""The progress bar's training description: epochs out of max_epochs, or steps out of max_steps."""

from types import SimpleNamespace

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
