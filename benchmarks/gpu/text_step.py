"""Section ``text_step``: a training step of each text recipe's network, eager and compiled, at the shape its
config trains with on one GPU, so that the config's ``compile`` option can follow a measurement.

The networks are the configs' own (``model.init_args.model``, read from the YAML), with the vocabulary
that the recipe's data gives: the paper's WikiText-103 LM (MultiMax in attention and on the output),
the IWSLT14 translator (MultiMax) and the Llama-style 124M decoder (softmax). Each step is one AdamW
step under bf16 autocast on fixed random tokens, the loss the task trains with (``loss``, summed and
divided by the scored-token count); the compiled step compiles ``loss`` as the task does (its
:class:`~mmlight.tasks.compiling.CompiledCalls`, ``fullgraph=True``). Under ``--smoke`` the networks
are narrowed to one small layer and run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu.record import Run
from benchmarks.gpu.step import COMPILED_LIMIT_S, EAGER_LIMIT_S, time_step

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TextRecipe:
    """One text recipe's step on one GPU.

    Args:
        config: the config, relative to ``configs/``.
        vocab: tokens in the vocabulary its data gives.
        batch: sequences per step (per GPU).
        length: tokens per sequence (the target's and the source's for a translator).
    """

    config: str
    vocab: int
    batch: int
    length: int


RECIPES = [
    # 267,744 words; 4 x 512 tokens per GPU (fairseq --tokens-per-sample 512, --max-tokens 2048)
    TextRecipe("lm_wikitext103_multimax.yaml", 267_744, 4, 512),
    # one joint 10k BPE; --max-tokens 4096 as 128 pairs of 32 tokens (IWSLT14's sentences are ~25 tokens)
    TextRecipe("nmt_iwslt14_multimax.yaml", 10_000, 128, 32),
    # the 32,768-token BPE of its header; 16 x 1,024 tokens per GPU
    TextRecipe("llm/llama_124m_softmax.yaml", 32_768, 16, 1024),
]
#: Under --smoke: the recipes' blocks narrowed to this (the options that make them what they are stay).
SMOKE_FIELDS = {"d_model": 32, "n_heads": 2, "ffn_dim": 64, "n_layers": 1, "n_encoder_layers": 1, "max_positions": 64}
SMOKE_SHAPE = {"vocab": 64, "batch": 2, "length": 16}


def network_config(recipe: TextRecipe, smoke: bool):
    """The config's ``TransformerConfig`` with the recipe's vocabulary (narrowed under ``--smoke``)."""
    import yaml

    from mmlight.models.transformer import TransformerConfig
    from mmlight.reweighting import ReweightingSpec

    fields = dict(yaml.safe_load((ROOT / "configs" / recipe.config).read_text())["model"]["init_args"]["model"])
    fields["attention"] = ReweightingSpec(**fields.get("attention", {}))
    fields["vocab_size"] = SMOKE_SHAPE["vocab"] if smoke else recipe.vocab
    if smoke:
        encoder = fields.get("n_encoder_layers", 0) > 0
        fields.update({k: v for k, v in SMOKE_FIELDS.items() if k != "n_encoder_layers" or encoder})
        fields.pop("n_kv_heads", None)
    return TransformerConfig(**fields)


def shape(recipe: TextRecipe, smoke: bool) -> tuple[int, int]:
    return (SMOKE_SHAPE["batch"], SMOKE_SHAPE["length"]) if smoke else (recipe.batch, recipe.length)


def build_step(recipe: TextRecipe, smoke: bool, compiled: bool):
    """One AdamW step (fused on a GPU) under bf16 autocast of the recipe's network on fixed random tokens."""
    import torch

    from mmlight.models.transformer import TransformerLM, TransformerSeq2Seq

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = network_config(recipe, smoke)
    torch.manual_seed(0)
    translator = config.n_encoder_layers > 0
    model = (TransformerSeq2Seq if translator else TransformerLM)(config).to(device)
    batch, length = shape(recipe, smoke)
    gen = torch.Generator(device).manual_seed(0)
    # ids 4 and up: no padding or special token, so every target is scored
    tokens = torch.randint(4, config.vocab_size, (batch, length + 1), device=device, generator=gen)
    source = torch.randint(4, config.vocab_size, (batch, length), device=device, generator=gen)
    inputs = (source, tokens[:, :-1]) if translator else (tokens[:, :-1],)
    loss_of = model.loss
    if compiled:
        from mmlight.tasks.compiling import CompiledCalls

        calls = CompiledCalls(True, model)
        loss_of = lambda *args: calls(model.loss, *args)  # noqa: E731 - the compiled method, as the task calls it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss_sum, count = loss_of(*inputs, tokens[:, 1:])
            loss = loss_sum / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in model.parameters())


def measure(recipe: TextRecipe, smoke: bool, compiled: bool) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    if compiled:
        torch._dynamo.reset()  # each compiled network compiles from scratch
    step, parameters = build_step(recipe, smoke, compiled)
    try:
        timing = time_step(step, cuda)
    finally:
        del step
        if cuda:
            torch.cuda.empty_cache()
    batch, length = shape(recipe, smoke)
    return {**timing, "parameters": parameters, "tokens_per_s": round(batch * length / timing["step_ms"] * 1e3)}


def section(run: Run) -> None:
    """Each recipe eager, then compiled (a CUDA GPU only); the compiled record carries its ratio to eager."""
    import torch

    for recipe in RECIPES:
        eager = None
        for compiled in (False, True):
            record = {
                "kind": "text_step",
                "config": recipe.config,
                "compiled": compiled,
                "shape": list(shape(recipe, run.smoke)),
                "vocab": SMOKE_SHAPE["vocab"] if run.smoke else recipe.vocab,
                "dtype": "bfloat16",
            }
            if compiled and not torch.cuda.is_available():
                what = f"{recipe.config}, compiled"
                run.emit(kind="skipped", section="text_step", what=what, reason="needs a CUDA GPU")
                continue
            limit = COMPILED_LIMIT_S if compiled else EAGER_LIMIT_S
            timing = run.attempt(f"text step {recipe.config}", limit, lambda: measure(recipe, run.smoke, compiled))
            if compiled and eager and eager.get("step_ms") and timing.get("step_ms"):
                timing["compiled_over_eager"] = round(timing["step_ms"] / eager["step_ms"], 3)
            run.emit(**record, **timing)
            eager = eager or timing
