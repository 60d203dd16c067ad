"""Files from elsewhere read as data: no pickle in a checkpoint, a weights file or a downloaded archive can
run code when mmlight loads it.

* mmlight checkpoints (``.ckpt``: pretrained weights, the tasks' ``load_from_checkpoint``) are read by
  ``torch.load(..., weights_only=True)`` with :data:`CHECKPOINT_TYPES` allowed besides torch's own
  (tensors, containers, numbers, strings): :func:`load_checkpoint`, or Lightning's reader inside
  :func:`reading_checkpoint`.
* timm's ``.pth``/``.bin`` files go through timm's reader (``weights_only=True``), inside
  :func:`refusing_code` so that a refusal names the file.
* CIFAR's pickles are read by :class:`PlainUnpickler`, which builds only what the official files hold.

A refusal is a :class:`RefusedFile` naming the file and what it holds; nothing falls back to a full
unpickling (docs/finetuning.md, "Files from elsewhere").
"""

from __future__ import annotations

import codecs
import contextlib
import io
import pathlib
import pickle
import re
import shlex
from pathlib import Path

import numpy as np
import torch

#: the command (docs/finetuning.md) that converts a trusted file holding other objects to plain weights
#: (followed by the file and the new file's name): it keeps the weights (under Lightning's or timm's keys),
#: the data's vocabulary or classes and Lightning's version, and drops the rest (the hyperparameters)
KEPT_ENTRIES = ("state_dict", "mmlight_data", "pytorch-lightning_version", "model", "model_ema", "state_dict_ema")
CONVERT_COMMAND = (
    "python -c \"import sys, torch; c = torch.load(sys.argv[1], map_location='cpu', weights_only=False); "
    f'torch.save({{k: c[k] for k in {KEPT_ENTRIES} if k in c}}, sys.argv[2])"'
)


class RefusedFile(pickle.UnpicklingError, ValueError):
    """A file whose pickle holds objects (classes, functions) that mmlight does not load: an unpickling
    error, and a ``ValueError`` of the input (so that commands report it as bad input)."""


#: what an mmlight checkpoint may hold besides torch's own types: paths (a hyperparameter given as a path)
#: and the config records that :func:`checkpoint_record` adds where they are defined (``mmlight.models``
#: imports them all)
CHECKPOINT_TYPES: list = [pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath]


def checkpoint_record(cls: type, *former_names: str) -> type:
    """Admit ``cls`` to checkpoints (:data:`CHECKPOINT_TYPES`): a config dataclass of numbers, strings and
    tuples that a task's hyperparameters hold when it is built in Python. Returns ``cls`` (a decorator).

    Args:
        cls: the record's class.
        former_names: ``module.Class`` names under which an earlier mmlight defined it (its old checkpoints
            name it so).
    """
    CHECKPOINT_TYPES.extend([cls, *((cls, name) for name in former_names)])
    return cls


def _refusal(path: str | Path, held: str) -> RefusedFile:
    path = Path(path)
    converted = path.with_name(f"{path.stem}-weights{path.suffix}")
    return RefusedFile(
        f"{path} holds objects mmlight does not load: {held}. mmlight reads weights and checkpoints as data "
        "only, so that no file can run code when it is loaded. Only if you trust the file (a checkpoint of "
        "your own, from an earlier mmlight or with other objects in its hyperparameters), convert it once to "
        f"plain weights (docs/finetuning.md): {CONVERT_COMMAND} {shlex.quote(str(path))} "
        f"{shlex.quote(str(converted))}"
    )


def _what_it_holds(path: str | Path, err: pickle.UnpicklingError) -> str:
    """What torch refused in ``path``: the pickle globals that the active allow-list lacks (all of them, listed
    by torch, in a zip checkpoint; the one torch's refusal ``err`` names in a legacy file), else its reason."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # a legacy (non-zip) file, or a bare pickle
        names = re.findall(r"GLOBAL ([\w.]+)", str(err))[:1]
    if names:
        return ", ".join(sorted(names))
    reason = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
    return "objects other than tensors, numbers, strings and containers" + (f" ({reason[1]})" if reason else "")


@contextlib.contextmanager
def refusing_code(path: str | Path):
    """Turn a ``weights_only`` refusal of ``torch.load`` inside the block into a :class:`RefusedFile`
    that names ``path`` and the objects it holds.

    Args:
        path: the file read inside the block.
    """
    try:
        yield
    except Exception as err:
        refusal = raised_from(err, pickle.UnpicklingError)  # timm re-raises torch's refusal as a RuntimeError
        if isinstance(err, RefusedFile) or refusal is None:
            raise
        raise _refusal(path, _what_it_holds(path, refusal)) from err


def raised_from(err: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """``err`` if it is a ``kind``, else the first exception of that kind it was raised from, else None."""
    while err is not None and not isinstance(err, kind):
        err = err.__cause__
    return err


@contextlib.contextmanager
def reading_checkpoint(path: str | Path):
    """The block reads the mmlight checkpoint ``path`` with ``torch.load(..., weights_only=True)`` (as
    Lightning's ``load_from_checkpoint`` does when told so): :data:`CHECKPOINT_TYPES` are allowed, and a
    refusal is a :class:`RefusedFile`.

    Args:
        path: the checkpoint read inside the block.
    """
    # torch's context removes on exit every type it was given, also those registered for good before it
    # (tasks/inference.py's add_safe_globals for Lightning's own reads): give it only the others
    registered = torch.serialization.get_safe_globals()
    missing = [entry for entry in CHECKPOINT_TYPES if entry not in registered]
    with torch.serialization.safe_globals(missing), refusing_code(path):
        yield


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """The mmlight checkpoint ``path`` as data (tensors, containers, numbers, strings, config records).

    Args:
        path: a ``.ckpt`` written by Lightning's ``save_checkpoint`` (``mmlight fit``, a task in Python).
        map_location: where the tensors go (``torch.load``'s argument).
    """
    with reading_checkpoint(path):
        return torch.load(path, map_location=map_location, weights_only=True)


#: what the official CIFAR pickles reference (NumPy arrays, by the module NumPy 1 or 2 names), what a
#: Python 3 re-pickle at protocol 5 references for an array (built from its bytes), and the
#: ``_codecs.encode`` that Python 3 writes for bytes at protocol 2
_ARRAY_REBUILD = np.empty(0).__reduce__()[0]
_ARRAY_FROM_BUFFER = np.empty(0).__reduce_ex__(5)[0]
PLAIN_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _ARRAY_REBUILD,
    ("numpy._core.multiarray", "_reconstruct"): _ARRAY_REBUILD,
    ("numpy.core.numeric", "_frombuffer"): _ARRAY_FROM_BUFFER,
    ("numpy._core.numeric", "_frombuffer"): _ARRAY_FROM_BUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class PlainUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, strings, bytes, numbers and NumPy arrays, and no
    other object: every global it is asked for must be one of :data:`PLAIN_GLOBALS`.

    Args:
        data: the pickle.
        name: the file it came from, for the error.
        encoding: how Python 2 strings are read (``bytes`` keeps them as bytes).
    """

    def __init__(self, data: bytes, name: str, encoding: str = "bytes"):
        super().__init__(io.BytesIO(data), encoding=encoding)
        self.name = name

    def find_class(self, module: str, name: str):
        try:
            return PLAIN_GLOBALS[(module, name)]
        except KeyError:
            raise RefusedFile(
                f"{self.name} holds objects mmlight does not load: {module}.{name}. The file should hold only "
                "dicts, lists, strings, bytes, numbers and NumPy arrays; it may have been altered: get it again "
                "from its official source"
            ) from None

    def persistent_load(self, pid):
        raise RefusedFile(f"{self.name} holds objects mmlight does not load: a persistent id {pid!r}")
