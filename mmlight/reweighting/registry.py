"""Registry of named reweighting functions: ``register`` (decorator) and ``build``."""

from __future__ import annotations

import inspect
from collections.abc import Callable

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


def registered(name: str) -> type[Reweighting]:
    """The class registered as ``name``; a ``ValueError`` listing the names when there is none."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reweighting {name!r}; choose one of {available()}")
    return _REGISTRY[name]


def options_of(cls: type[Reweighting]) -> list[str]:
    """The keyword arguments a reweighting class accepts (its ``__init__``'s parameters)."""
    return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]


def build(name: str, **kwargs) -> Reweighting:
    """Instantiate the reweighting function ``name`` with keyword arguments ``kwargs``.

    Raises a ``ValueError`` naming the offending key when ``name`` or an argument is unknown, so a
    typo in a config fails before any work starts.
    """
    cls = registered(name)
    accepted = options_of(cls)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"reweighting {name!r} got unknown option(s) {unknown}; it accepts {accepted}")
    return cls(**kwargs)
