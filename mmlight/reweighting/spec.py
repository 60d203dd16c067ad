"""``ReweightingSpec``: the config entry that names a reweighting function and its options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.registry import available, build


@dataclass
class ReweightingSpec:
    """Which reweighting function to build, and its options.

    The accepted names are those of the registry at the time the spec is made, so a function
    registered in a new file under ``mmlight/reweighting/`` is accepted with nothing else edited.

    Args:
        name: a name from :func:`mmlight.reweighting.available`.
        options: keyword arguments of that function (e.g. ``{order: 2}`` for MultiMax); an unknown
            key stops model construction with a message naming it.
    """

    name: str = "softmax"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.name not in available():
            raise ValueError(f"unknown reweighting {self.name!r}; choose one of {available()}")

    def build(self, backend: Backend = "auto") -> Reweighting:
        """The module, computed on ``backend`` (the model config's key; not an entry of ``options``)."""
        if "backend" in self.options:
            raise ValueError("set the backend with the model's `backend` key, not in the reweighting options")
        return build(self.name, backend=backend, **self.options)
