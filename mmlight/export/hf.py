"""A Llama-style :class:`~mmlight.models.TransformerLM` as a Hugging Face ``transformers`` model:
``LlamaForCausalLM``, or ``Qwen3ForCausalLM`` with ``qk_norm``, with the same weights.

The mmlight network is a transformers Llama when it is a decoder-only LM with pre-norm RMSNorm, rotary
positions, SwiGLU and no embedding scale (``LLAMA_STYLE``); biases are kept (``attention_bias`` and
``mlp_bias``), except with ``qk_norm`` (Qwen3's feed-forward has none). Both use the rotate-half layout
of the rotary positions, so the query and key rows copy across unpermuted, and query head ``h`` reads
key/value head ``h // (nh / nkv)`` in both. The output gate and the output MultiMax have no place in a
transformers Llama: a model with either is refused, as is any other architecture, with the reasons.

Softmax attention needs nothing else; any other function is exported with ``attn_implementation``
``mmlight`` and its learned values in the config (:mod:`mmlight.export.hf_attention`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mmlight.models.transformer import TransformerConfig, TransformerLM


class NotExportable(ValueError):
    """The network has a part that a transformers Llama or Qwen3 cannot express."""


def unsupported(model: torch.nn.Module) -> list[str]:
    """What keeps ``model`` from being a transformers Llama/Qwen3, one reason a line (empty: exportable)."""
    if not isinstance(model, TransformerLM):
        return [f"only a decoder-only TransformerLM exports, not a {type(model).__name__}"]
    c: TransformerConfig = model.config
    wanted = {"pre_norm": True, "positions": "rope", "norm": "rmsnorm", "ffn": "swiglu", "embed_scale": 1.0}
    reasons = [
        f"{key}={getattr(c, key)!r}: a Llama has {want!r}" for key, want in wanted.items() if getattr(c, key) != want
    ]
    if c.gate != "none":
        reasons.append(
            f"gate={c.gate!r}: the gate reads the layer's input, which transformers' attention functions do not get"
        )
    if c.output_multimax:
        reasons.append("output_multimax=True: a transformers LM head has no output modulation")
    if c.qk_norm and c.bias:
        reasons.append("qk_norm with bias=True: Qwen3's feed-forward has no biases")
    return reasons


def uses_plain_softmax(model: TransformerLM) -> bool:
    """Whether every layer's function is softmax at temperature 1 (transformers' own attention)."""
    spec = model.config.attention
    return spec.name == "softmax" and spec.options.get("temperature", 1.0) == 1.0 and not spec.options.get("learnable")


def hf_config(model: TransformerLM):
    """The ``LlamaConfig`` (``Qwen3Config`` with ``qk_norm``) of ``model``, with the description of each
    layer's function (:mod:`mmlight.export.hf_attention`) unless it is plain softmax."""
    from transformers import LlamaConfig, Qwen3Config

    c = model.config
    fields = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_positions,
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        attention_bias=c.bias,
        tie_word_embeddings=c.share_output_embedding,
        pad_token_id=c.pad_id,
        bos_token_id=None,  # transformers' defaults (1, 2) are not the ids of mmlight's vocabularies
        eos_token_id=None,
        attention_dropout=c.attention_dropout,
        dtype="float32",
    )
    if not uses_plain_softmax(model):
        from mmlight.export import hf_attention

        modules = [layer.self_attn.reweight for layer in model.decoder.layers]
        fields[hf_attention.CONFIG_KEY] = hf_attention.describe(modules, c.attention)
    if c.qk_norm:
        return Qwen3Config(**fields)
    return LlamaConfig(**fields, mlp_bias=c.bias)


#: mmlight's module names in a decoder layer -> transformers' (the others, q/k/v_proj and q/k_norm, are equal)
LAYER_NAMES = {
    "attn_block.norm": "input_layernorm",
    "self_attn.out_proj": "self_attn.o_proj",
    "ffn_block.norm": "post_attention_layernorm",
    "ffn.fc2": "mlp.down_proj",
}


def hf_state_dict(model: TransformerLM) -> dict[str, torch.Tensor]:
    """``model``'s weights under transformers' Llama/Qwen3 names (the SwiGLU ``fc1`` split into gate and up;
    the reweighting parameters travel in the config)."""
    hf = {
        "model.embed_tokens.weight": model.decoder.embed.tokens.weight,
        "model.norm.weight": model.decoder.norm.weight,
    }
    for i, layer in enumerate(model.decoder.layers):
        for name, p in layer.named_parameters():
            module, kind = name.rsplit(".", 1)  # e.g. ("self_attn.q_proj", "weight")
            if module.startswith("self_attn.reweight"):
                continue
            if module == "ffn.fc1":  # (2 ffn, d): the gate rows, then the up rows
                gate, up = p.chunk(2, dim=0)
                hf[f"model.layers.{i}.mlp.gate_proj.{kind}"], hf[f"model.layers.{i}.mlp.up_proj.{kind}"] = gate, up
                continue
            hf[f"model.layers.{i}.{LAYER_NAMES.get(module, module)}.{kind}"] = p
    if not model.config.share_output_embedding:
        hf["lm_head.weight"] = model.output_projection.weight
    return {name: p.detach().clone().float() for name, p in hf.items()}


def to_hf(model: TransformerLM):
    """A transformers ``LlamaForCausalLM`` (``Qwen3ForCausalLM``) with ``model``'s weights, float32, in
    evaluation mode; :class:`NotExportable` with every reason when it cannot be one."""
    reasons = unsupported(model)
    if reasons:
        raise NotExportable("this network cannot be a transformers Llama: " + "; ".join(reasons))
    from transformers import AutoModelForCausalLM

    config = hf_config(model)
    implementation = None  # transformers' default (SDPA) for plain softmax
    if not uses_plain_softmax(model):
        from mmlight.export import hf_attention  # registers the implementation

        implementation = hf_attention.IMPLEMENTATION
    hf = AutoModelForCausalLM.from_config(config, attn_implementation=implementation)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [name for name in missing if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:  # a mapping out of step with transformers' modules: never a silent partial copy
        raise RuntimeError(f"weights that did not map: missing {missing}, unexpected {unexpected}")
    return hf.float().eval()


def export(model: TransformerLM, out: str | Path) -> Path:
    """Write ``model`` as a transformers model folder (``config.json``, ``model.safetensors``) to ``out``.

    A function other than plain softmax is named in ``config.json`` as ``"attn_implementation": "mmlight"``.
    transformers does not read that key when it loads a model: pass ``attn_implementation="mmlight"`` to
    ``from_pretrained`` after importing :mod:`mmlight.export.hf_attention`, or load with its
    :func:`~mmlight.export.hf_attention.from_pretrained`, which does both."""
    out = Path(out)
    to_hf(model).save_pretrained(out)  # transformers 5 writes safetensors only
    if not uses_plain_softmax(model):
        from mmlight.export.hf_attention import IMPLEMENTATION

        path = out / "config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "attn_implementation": IMPLEMENTATION}, indent=2, sort_keys=True) + "\n")
    return out
