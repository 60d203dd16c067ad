"""DataPosition: the loader states Lightning saved reach the loaders of a resumed run, at the batch
Lightning will run next."""

from types import SimpleNamespace

import pytest

from mmlight.callbacks import DataPosition
from mmlight.callbacks.data_position import batches_done


def progress(ready, started, processed, completed):
    return {"ready": ready, "started": started, "processed": processed, "completed": completed}


def test_batches_done_follows_lightnings_restart_rule():
    assert batches_done(progress(5, 5, 5, 4)) == 5  # written at the end of batch 5 (on_train_batch_end)
    assert batches_done(progress(5, 5, 4, 4)) == 4  # written inside batch 5 (hpc_ckpt): batch 5 runs again
    assert batches_done(progress(5, 4, 4, 4)) == 4
    assert batches_done(progress(44, 44, 44, 44)) == 44  # the epoch's end
    assert batches_done(None) is None


class Loader:
    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.loaded = state


def test_states_reach_the_loaders_with_lightnings_position():
    saved = {
        "loops": {
            "fit_loop": {
                "state_dict": {"combined_loader": [{"epoch": 2, "position": 5}]},
                "epoch_loop.batch_progress": {"current": progress(5, 5, 4, 4)},
            }
        }
    }
    loader = Loader()
    callback = DataPosition()
    callback.on_load_checkpoint(None, None, saved)
    callback.on_train_start(SimpleNamespace(train_dataloader=loader), None)
    assert loader.loaded == {"epoch": 2, "position": 4}
    callback.on_load_checkpoint(None, None, saved)
    with pytest.raises(RuntimeError, match="1 training loader state\\(s\\), but this run has 2"):
        callback.on_train_start(SimpleNamespace(train_dataloader=[Loader(), Loader()]), None)


@pytest.mark.parametrize(
    "saved", [{}, {"loops": {}}, {"loops": {"fit_loop": {}}}, {"loops": {"fit_loop": {"state_dict": {}}}}]
)
def test_a_checkpoint_without_loader_states_hands_nothing_over(saved):
    """Checkpoints from before the resumable loaders (or without a fit loop) leave the loaders alone."""
    callback = DataPosition()
    callback.on_load_checkpoint(None, None, saved)
    loader = Loader()
    callback.on_train_start(SimpleNamespace(train_dataloader=loader), None)
    assert loader.loaded is None


def test_only_states_with_a_position_get_lightnings_and_without_progress_they_stay_as_saved():
    states = [{"epoch": 0, "position": 9}, {"kind": "another stateful loader"}]
    callback = DataPosition()
    callback.on_load_checkpoint(
        None,
        None,
        {
            "loops": {
                "fit_loop": {
                    "state_dict": {"combined_loader": states},
                    "epoch_loop.batch_progress": {"current": progress(3, 3, 3, 3)},
                }
            }
        },
    )
    loaders = [Loader(), Loader()]
    callback.on_train_start(SimpleNamespace(train_dataloader=loaders), None)
    assert [loader.loaded for loader in loaders] == [{"epoch": 0, "position": 3}, {"kind": "another stateful loader"}]
    callback.on_load_checkpoint(None, None, {"loops": {"fit_loop": {"state_dict": {"combined_loader": states}}}})
    callback.on_train_start(SimpleNamespace(train_dataloader=loaders), None)
    assert [loader.loaded for loader in loaders] == states


class LoadOnly:
    """Has ``load_state_dict`` but no ``state_dict``: Lightning saves no state for it."""

    def __init__(self):
        self.loaded = None

    def load_state_dict(self, state):
        self.loaded = state


def test_only_fully_stateful_loaders_of_a_combined_loader_get_states_and_only_once():
    """Lightning saves states for loaders with both ``state_dict`` and ``load_state_dict``; a
    CombinedLoader's loaders are matched in its flattened order; the states are handed over once."""
    from lightning.pytorch.utilities import CombinedLoader

    first, load_only, plain, second = Loader(), LoadOnly(), [1, 2, 3], Loader()
    combined = CombinedLoader({"a": first, "b": load_only, "c": plain, "d": second}, mode="max_size_cycle")
    callback = DataPosition()
    callback.on_load_checkpoint(
        None, None, {"loops": {"fit_loop": {"state_dict": {"combined_loader": [{"position": 1}, {"position": 2}]}}}}
    )
    callback.on_train_start(SimpleNamespace(train_dataloader=combined), None)
    assert (first.loaded, second.loaded, load_only.loaded) == ({"position": 1}, {"position": 2}, None)
    first.loaded = second.loaded = None
    callback.on_train_start(SimpleNamespace(train_dataloader=combined), None)  # e.g. a second fit() call
    assert (first.loaded, second.loaded) == (None, None)
