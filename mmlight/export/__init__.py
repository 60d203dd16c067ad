"""Export of mmlight networks to other ecosystems: Hugging Face ``transformers``
(:mod:`mmlight.export.hf`, with :mod:`mmlight.export.hf_attention` for the reweighting functions)."""
