"""Makes sure a resumed run's training loaders get the data position saved in the checkpoint."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import CombinedLoader


class DataPosition(Callback):
    """Hands the training loaders' states, saved by Lightning's fit loop in every checkpoint
    (``loops.fit_loop.state_dict.combined_loader``), to the loaders when a resumed run starts.

    Lightning restores those states itself, except when ``configure_optimizers`` reads
    ``trainer.estimated_stepping_batches`` (the image classifier does, and the sequence tasks with a cosine
    schedule): that builds
    the loaders before the checkpoint is restored, and Lightning then never loads their states
    (Lightning-AI/pytorch-lightning#20550, open in 2.6). Loading them again in ``on_train_start``,
    before the first batch is drawn, is harmless where Lightning did.

    The position handed over is the number of batches of the epoch that Lightning counts as done
    (:func:`batches_done`), which is what the loader counted unless the checkpoint was written in
    the middle of a step (Lightning's own SLURM signal handler writes ``hpc_ckpt`` there;
    :class:`~mmlight.callbacks.SlurmRequeue` moves it to the step's end): Lightning then runs that
    step again, and the loader must hand out its batch again.
    """

    def __init__(self):
        self._states: list[dict] = []

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        self._states = list(fit_loop.get("state_dict", {}).get("combined_loader", []))
        done = batches_done(fit_loop.get("epoch_loop.batch_progress", {}).get("current"))
        if done is not None:
            self._states = [{**state, "position": done} if "position" in state else state for state in self._states]

    def on_train_start(self, trainer, pl_module) -> None:
        if not self._states:
            return
        loaders = trainer.train_dataloader
        flat = loaders.flattened if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders).flattened
        stateful = [
            loader
            for loader in flat
            if callable(getattr(loader, "load_state_dict", None)) and callable(getattr(loader, "state_dict", None))
        ]
        if len(stateful) != len(self._states):
            raise RuntimeError(
                f"the checkpoint holds {len(self._states)} training loader state(s), but this run "
                f"has {len(stateful)} stateful training loader(s)"
            )
        for loader, state in zip(stateful, self._states):
            loader.load_state_dict(state)
        self._states = []


def batches_done(progress: dict | None) -> int | None:
    """Batches of the current epoch that a run resumed from this ``batch_progress.current`` will not
    draw again: the completed ones, plus the last one if the checkpoint was written at its end
    (processed, not yet marked completed: Lightning's "restarted on train batch end")."""
    if not progress:
        return None
    at_batch_end = progress["ready"] == progress["started"] == progress["processed"] == progress["completed"] + 1
    return progress["completed"] + int(at_batch_end)
