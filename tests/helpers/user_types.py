"""Types of a user's own, pickled into checkpoints by the tests. A module of its own that imports nothing:
a process that unpickles one (the converter command of docs/finetuning.md) then imports torch alone, not a
test module and Lightning with it (about 8 s of CPU on 2 cores)."""


class Unlisted:
    """A type of the user's that no allow-list names."""
