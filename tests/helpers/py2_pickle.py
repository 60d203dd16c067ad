"""Pickles as Python 2's ``cPickle.dump(obj, f, 2)`` wrote them (the official CIFAR archives): every string a
Python 2 ``str`` (``SHORT_BINSTRING``/``BINSTRING``, raw bytes that Python 3 decodes by the ``encoding`` it is
given), NumPy arrays through their ``__reduce__`` with the array's memory as one such string, and NumPy's
module named ``numpy.core`` as NumPy 1 named it. Python 3's pickler cannot write these: it pickles ``bytes``
through ``_codecs.encode`` at protocol 2.
"""

from __future__ import annotations

import struct

import numpy as np

#: opcodes of protocol 2 (pickletools names them)
PROTO, STOP, MARK, TUPLE, REDUCE, BUILD, GLOBAL = b"\x80\x02", b".", b"(", b"t", b"R", b"b", b"c"
EMPTY_DICT, SETITEMS, EMPTY_LIST, APPENDS, NONE, NEWTRUE, NEWFALSE = b"}", b"u", b"]", b"e", b"N", b"\x88", b"\x89"


def dumps(obj) -> bytes:
    """``obj`` (dicts, lists, tuples, ints, floats, None, bools, ``str``/``bytes`` as Python 2 strings, NumPy
    arrays and dtypes) as a Python 2 protocol-2 pickle."""
    return PROTO + _save(obj) + STOP


def _string(raw: bytes) -> bytes:
    if len(raw) < 256:
        return b"U" + bytes([len(raw)]) + raw  # SHORT_BINSTRING
    return b"T" + struct.pack("<i", len(raw)) + raw  # BINSTRING


def _global(function) -> bytes:
    module = function.__module__.replace("numpy._core", "numpy.core")
    return GLOBAL + module.encode() + b"\n" + function.__name__.encode() + b"\n"


def _save(obj) -> bytes:
    if obj is None:
        return NONE
    if isinstance(obj, bool):
        return NEWTRUE if obj else NEWFALSE
    if isinstance(obj, (int, np.integer)):
        return b"K" + bytes([obj]) if 0 <= obj < 256 else b"J" + struct.pack("<i", int(obj))
    if isinstance(obj, float):
        return b"G" + struct.pack(">d", obj)
    if isinstance(obj, (bytes, str)):
        return _string(obj if isinstance(obj, bytes) else obj.encode("latin1"))
    if isinstance(obj, tuple):
        return MARK + b"".join(map(_save, obj)) + TUPLE
    if isinstance(obj, list):
        return EMPTY_LIST + (MARK + b"".join(map(_save, obj)) + APPENDS if obj else b"")
    if isinstance(obj, dict):
        items = b"".join(_save(k) + _save(v) for k, v in obj.items())
        return EMPTY_DICT + (MARK + items + SETITEMS if obj else b"")
    if isinstance(obj, np.ndarray):  # state (version, shape, dtype, is_fortran, memory): NumPy 1's layout
        rebuild = obj.__reduce__()[0]  # numpy.core.multiarray._reconstruct
        state = (1, obj.shape, obj.dtype, False, np.ascontiguousarray(obj).tobytes())
        return _global(rebuild) + _save((np.ndarray, (0,), b"b")) + REDUCE + _save(state) + BUILD
    if isinstance(obj, np.dtype):
        rebuild, args, state = obj.__reduce__()
        return _global(rebuild) + _save(args) + REDUCE + _save(state) + BUILD
    if isinstance(obj, type):  # a class named as an argument (np.ndarray)
        return _global(obj)
    raise TypeError(f"py2_pickle: {type(obj).__name__} is not written by this helper")
