"""The ``compile`` option of every task: the network's training and evaluation forward (and so its
backward) under ``torch.compile``.

The task keeps the compiled callables beside its network and never replaces a registered
submodule, so checkpoints are the same with and without the option (no ``_orig_mod.`` keys): a run
trained compiled loads, resumes and evaluates uncompiled, and the other way round. Lightning's hooks,
beam search and attention analysis (any call while :func:`~mmlight.nn.attention.observe_attention`
is active) run uncompiled.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Union

import torch

from mmlight.nn.attention import attention_observed

#: ``false``, ``true``, or keyword arguments of :func:`torch.compile` (e.g. ``{mode: max-autotune}``).
CompileOption = Union[bool, dict[str, Any]]  # noqa: UP007 - jsonargparse reads this alias


def compile_kwargs(option: CompileOption) -> dict[str, Any] | None:
    """The keyword arguments of :func:`torch.compile` for a task's ``compile`` option, or None when off.

    ``fullgraph`` is True unless the option says otherwise: a graph break is an error that names the
    function and line, never a silent split into eager pieces.
    """
    if option is False or option is None:
        return None
    if option is True:
        return {"fullgraph": True}
    if not isinstance(option, dict):
        raise TypeError(f"compile must be true, false or a dict of torch.compile options, got {option!r}")
    known = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(option) - known)
    if unknown:
        raise ValueError(f"compile: unknown torch.compile option(s) {unknown}; it accepts {sorted(known)}")
    return {"fullgraph": True, **option}


class CompiledCalls:
    """Calls methods of a task's network compiled with the task's ``compile`` option.

    Args:
        option: the task's ``compile`` option (see :func:`compile_kwargs`).
        network: the task's network, whose reweighting functions errors name.
    """

    def __init__(self, option: CompileOption, network: torch.nn.Module):
        self.kwargs = compile_kwargs(option)
        self.network = network
        self._compiled: dict[tuple[int, str], Callable] = {}

    def describe(self) -> str:
        """The network's reweighting functions by site kind, e.g. ``MultiMax (backend auto)``."""
        sites = self.network.reweighting_sites()
        names = sorted({f"{type(m).__name__} (backend {m.backend})" for m in sites.values()})
        return f"reweighting: {', '.join(names)}"

    def __call__(self, method: Callable, *args, **kwargs):
        """``method(*args, **kwargs)``, compiled when the option is on and no attention observer is
        active. A failure to compile raises a ``RuntimeError`` naming the method and the network,
        with Dynamo's or Inductor's error (which names the function and line) as its cause."""
        if self.kwargs is None or attention_observed():
            return method(*args, **kwargs)
        key = (id(method.__self__), method.__name__)
        try:
            if key not in self._compiled:
                self._compiled[key] = torch.compile(method, **self.kwargs)
            return self._compiled[key](*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            first = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
            raise RuntimeError(
                f"torch.compile of {type(method.__self__).__name__}.{method.__name__} ({self.describe()}) failed: "
                f"{first}. The cause below names the function and line; set compile: false to run uncompiled."
            ) from error

    def __getstate__(self) -> dict:
        # compiled callables are rebuilt on first use after a copy
        return {**self.__dict__, "_compiled": {}}
