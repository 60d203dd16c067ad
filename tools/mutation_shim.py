"""A pytest plugin loaded by tools/mutation.py in mutmut's runs (``-p tools.mutation_shim``).

mutmut renames every mutated method (``__init__`` becomes ``xǁClassǁ__init____mutmut_orig`` behind a
trampoline), and Lightning's ``save_hyperparameters`` finds the constructor's arguments by looking
for a frame *named* ``__init__``: under mutmut every task would lose its ``hparams``. This accepts the
renamed constructors too; otherwise it is Lightning's ``_get_init_args``.
"""

from __future__ import annotations

import inspect

from lightning.pytorch.utilities import parsing


def _is_init(name: str) -> bool:
    return name == "__init__" or "ǁ__init____mutmut_" in name


def _get_init_args(frame):
    _, _, _, local_vars = inspect.getargvalues(frame)
    if "__class__" not in local_vars or not _is_init(frame.f_code.co_name):
        return None, {}
    cls = local_vars["__class__"]
    self_var, args_var, kwargs_var = parsing.parse_class_init_keys(cls)
    excluded = (*(n for n in (self_var, args_var, kwargs_var) if n), "__class__", "frame", "frame_args")
    local_args = {k: local_vars[k] for k in inspect.signature(cls.__init__).parameters}
    if kwargs_var:
        local_args.update(local_args.get(kwargs_var, {}))
    return local_vars.get(self_var), {k: v for k, v in local_args.items() if k not in excluded}


parsing._get_init_args = _get_init_args
