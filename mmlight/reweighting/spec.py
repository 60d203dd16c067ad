"""``ReweightingSpec``: the config entry that names a reweighting function and its options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmlight.reweighting.backend import Backend
from mmlight.reweighting.base import Reweighting
from mmlight.reweighting.registry import available, build, options_of, registered
from mmlight.safe_load import checkpoint_record


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

    def build(
        self, backend: Backend = "auto", num_heads: int | None = None, causal: bool = True, site: str = "attention"
    ) -> Reweighting:
        """The module for one attention layer of a model.

        Args:
            backend: how it is computed (the model config's key; not an entry of ``options``).
            num_heads: the layer's head count, passed to functions that learn a value per head
                (those with a ``num_heads`` argument) unless ``options`` sets it.
            causal: whether the layer's attention is causal; a causal-only function (stick-breaking)
                refuses a non-causal layer here, when the model is built from its config.
            site: what to call the layer in that error (``encoder self-attention``).
        """
        if "backend" in self.options:
            raise ValueError("set the backend with the model's `backend` key, not in the reweighting options")
        cls = registered(self.name)
        if cls.causal_only and not causal:
            raise ValueError(
                f"reweighting {self.name!r} attends only to earlier keys and needs causal attention; "
                f"the {site} is not causal (use it in decoder self-attention only)"
            )
        options = dict(self.options)
        if num_heads is not None and "num_heads" in options_of(cls):
            options.setdefault("num_heads", num_heads)
        return build(self.name, backend=backend, **options)


# defined in mmlight/models/vit.py before it moved here: checkpoints of the first mmlight name it so
checkpoint_record(ReweightingSpec, "mmlight.models.vit.ReweightingSpec")
