"""Registry of named reweighting functions: ``register`` (decorator) and ``build``."""

from __future__ import annotations

import inspect
from typing import Callable

from mmlight.reweighting.base import Reweighting

_REGISTRY: dict[str, type[Reweighting]] = {}


def register(name: str) -> Callable[[type[Reweighting]], type[Reweighting]]:
    """Class decorator: make ``cls`` available as ``build(name, ...)``."""

    def wrap(cls: type[Reweighting]) -> type[Reweighting]:
        if name in _REGISTRY:
            raise ValueError(f"reweighting {name!r} is registered twice")
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    """Names accepted by :func:`build`, sorted."""
    return sorted(_REGISTRY)


def build(name: str, **kwargs) -> Reweighting:
    """Instantiate the reweighting function ``name`` with keyword arguments ``kwargs``.

    Raises a ``ValueError`` naming the offending key when ``name`` or an argument is unknown, so a
    typo in a config fails before any work starts.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown reweighting {name!r}; choose one of {available()}")
    cls = _REGISTRY[name]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"reweighting {name!r} got unknown option(s) {unknown}; it accepts {accepted}")
    return cls(**kwargs)
