"""mmlight's reweighting functions inside Hugging Face ``transformers`` models.

Importing this module registers the attention implementation ``mmlight`` with transformers'
``AttentionInterface``, and a mask function of the same name with its ``AttentionMaskInterface`` (a custom
implementation without one would get no causal mask). A model exported by ``mmlight export hf`` with a
function other than plain softmax names it in its ``config.json``; load it with::

    import mmlight.export.hf_attention  # registers "mmlight"
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="mmlight")

(or ``mmlight.export.hf_attention.from_pretrained(folder)``, which does both). transformers does not read
the ``attn_implementation`` that the exported ``config.json`` names: a model loaded without it runs softmax.

Each layer's function is described by the config's ``mmlight_attention`` entry: the function's name,
its options and the learned values of its parameters per layer (MultiMax's ranges and slopes, the sink
logits, ...), which hold a few numbers per layer. The layer's reweighting module is built from it on
first use and computes the attention through :func:`mmlight.nn.attention` (the fused kernels where they
apply), so the exported model runs the same function as the mmlight network.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from mmlight.nn.attention import attention
from mmlight.reweighting import ReweightingSpec
from mmlight.reweighting.base import Reweighting

#: the name of the implementation in transformers' interfaces and in an exported config
IMPLEMENTATION = "mmlight"
#: the config entry that describes each layer's reweighting
CONFIG_KEY = "mmlight_attention"

# the reweighting module of each transformers attention layer, built on its first call
_MODULES: weakref.WeakKeyDictionary[torch.nn.Module, Reweighting] = weakref.WeakKeyDictionary()


def describe(modules: list[Reweighting], spec: ReweightingSpec) -> dict:
    """The config entry for the reweighting ``modules`` of a model's layers (in depth order), built by ``spec``."""
    state = [{k: v.detach().cpu().float().tolist() for k, v in m.state_dict().items()} for m in modules]
    return {"name": spec.name, "options": dict(spec.options), "layers": state}


def reweighting_of(layer: torch.nn.Module) -> Reweighting:
    """The reweighting module of a transformers attention layer (with ``config`` and ``layer_idx``)."""
    module = _MODULES.get(layer)
    if module is None:
        entry = getattr(layer.config, CONFIG_KEY, None)
        if entry is None:
            raise ValueError(
                f"attn_implementation={IMPLEMENTATION!r} needs the config entry {CONFIG_KEY!r} that "
                "`mmlight export hf` writes; this model has none"
            )
        spec = ReweightingSpec(entry["name"], entry["options"])
        module = spec.build("auto", layer.config.num_attention_heads, causal=True)
        state = entry["layers"][layer.layer_idx]
        module.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
        _MODULES[layer] = module
    return module


def mmlight_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: ``query`` ``(B, nh, Tq, hs)``, ``key``/``value``
    ``(B, nkv, Tk, hs)`` (grouped heads are mmlight's too), ``attention_mask`` the bool mask of
    :func:`mmlight_mask` (True = attend). Returns ``(output (B, Tq, nh, hs), None)``: the weights are not
    materialised for the caller."""
    reweight = reweighting_of(module).to(query.device)
    if reweight.causal_only:
        key, value, attention_mask = _without_unfilled_slots(key, value, attention_mask)
    y = attention(
        query,
        key,
        value,
        reweight,
        mask=attention_mask,
        # the mask holds causality already; bottom-right causality adds nothing to it and is what the
        # causal-only functions (stick-breaking) require
        is_causal=True,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
    )  # (B, nh, Tq, hs)
    return y.transpose(1, 2).contiguous(), None


def _without_unfilled_slots(key, value, mask):
    """``key``, ``value`` and ``mask`` without the trailing keys that no query attends to: the unfilled
    slots of a static cache, which holds ``max_cache_len`` keys from the first step. A causal-only function
    (stick-breaking) places query ``i`` at key ``Tk - Tq + i``, which holds once they are gone (the last
    query attends to its own key, the last one kept). Other functions are left as they are: the slots are
    masked, and a data-dependent length would break a compiled static-cache graph."""
    attended = mask.reshape(-1, mask.shape[-1]).any(0)  # (Tk,)
    if not attended.any():
        return key, value, mask
    n = int(attended.nonzero().max()) + 1
    return key[..., :n, :], value[..., :n, :], mask[..., :n]


def mmlight_mask(*args, **kwargs) -> torch.Tensor:
    """transformers' boolean SDPA mask ``(B, 1, Tq, Tk)`` (True = attend), never skipped: the SDPA mask
    may be None where SDPA's own ``is_causal`` would stand in, which mmlight's functions do not read."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def from_pretrained(folder, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(folder)`` with the ``mmlight`` implementation when the folder's
    config describes an mmlight function (transformers would otherwise run softmax in its place)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if getattr(AutoConfig.from_pretrained(folder), CONFIG_KEY, None) is not None:
        kwargs.setdefault("attn_implementation", IMPLEMENTATION)
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def register() -> None:
    """Register ``mmlight`` with transformers' attention and mask interfaces (done on import)."""
    AttentionInterface.register(IMPLEMENTATION, mmlight_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, mmlight_mask)


register()
