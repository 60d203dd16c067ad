"""The Llama-style network against Hugging Face transformers (an independent implementation): with the
same weights copied across, mmlight's logits equal ``LlamaForCausalLM``'s (``Qwen3ForCausalLM``'s with
QK-norm) in float32 on the CPU; ``mmlight export hf`` writes a folder that ``from_pretrained`` loads with
equal logits, for softmax and, through the registered ``mmlight`` attention, for other functions."""

import json
from pathlib import Path

import lightning
import pytest
import torch

from mmlight.cli import main as mmlight
from mmlight.commands.export import parse_args
from mmlight.export import hf as hf_export
from mmlight.export.hf import (
    NotExportable,
    export,
    hf_config,
    hf_state_dict,
    to_hf,
    unsupported,
    uses_plain_softmax,
)
from mmlight.models.transformer import LLAMA_STYLE, TransformerConfig, TransformerLM
from mmlight.reweighting import MultiMax, ReweightingSpec
from mmlight.tasks import LanguageModel

transformers = pytest.importorskip("transformers")
from mmlight.export import hf_attention  # noqa: E402  (needs transformers)

V = 61


def llama(name="softmax", options: dict | None = None, **fields) -> TransformerLM:
    """A random 2-layer Llama-style LM, d 32, 4 heads (2 key/value heads), FFN 48, float32, evaluation mode;
    MultiMax and sink parameters moved off their initial values."""
    torch.manual_seed(0)
    base = {"vocab_size": V, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48, "n_layers": 2}
    config = TransformerConfig(**{**base, **LLAMA_STYLE, **fields, "attention": ReweightingSpec(name, options or {})})
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MultiMax):
                m.ts.uniform_(-0.5, 0.5)
                m.ranges.uniform_(-1.0, 1.0)
            elif hasattr(m, "sink_logit"):
                m.sink_logit.uniform_(-1.0, 1.0)
            elif isinstance(m, torch.nn.RMSNorm):  # learned scales off 1, so that a misplaced one shows
                m.weight.uniform_(0.5, 1.5)
    return model


def transformers_model(model: TransformerLM):
    """transformers' own Llama (Qwen3 with qk_norm), eager attention, from a config written here by hand,
    with mmlight's weights loaded under transformers' names."""
    c = model.config
    fields = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=c.kv_heads,
        head_dim=8,  # Qwen3Config's default is 128, not hidden_size / heads
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.share_output_embedding,
        attention_bias=c.bias,
    )
    if c.qk_norm:
        reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields, attn_implementation="eager"))
    else:
        config = transformers.LlamaConfig(**fields, mlp_bias=c.bias, attn_implementation="eager")
        reference = transformers.LlamaForCausalLM(config)
    missing, unexpected = reference.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return reference.eval()


def tokens(B=2, T=11, seed=1):
    return torch.randint(2, V, (B, T), generator=torch.Generator().manual_seed(seed))


def mmlight_logits(model, x):
    with torch.no_grad():
        return model.logits(model(x))


@pytest.mark.parametrize(
    "fields",
    [
        {},  # tied embeddings, grouped-query attention
        {"share_output_embedding": False, "n_kv_heads": 1, "rope_theta": 500_000.0, "norm_eps": 1e-6},
        {"bias": True, "n_kv_heads": None},
        {"qk_norm": True},  # Qwen3
    ],
    ids=["gqa_tied", "mqa_untied_theta5e5", "bias_mha", "qwen3_qk_norm"],
)
def test_softmax_network_equals_transformers_with_the_same_weights(fields):
    model = llama(**fields)
    reference = transformers_model(model)
    assert type(reference).__name__ == ("Qwen3ForCausalLM" if fields.get("qk_norm") else "LlamaForCausalLM")
    x = tokens()
    with torch.no_grad():
        want = reference(x).logits  # (B, T, V)
    torch.testing.assert_close(mmlight_logits(model, x), want, rtol=1e-5, atol=1e-5)


def test_right_padding_is_masked_as_transformers_masks_it():
    model = llama()
    x = tokens()
    x[1, 7:] = model.config.pad_id
    with torch.no_grad():
        want = transformers_model(model)(x, attention_mask=(x != model.config.pad_id).long()).logits
    torch.testing.assert_close(mmlight_logits(model, x)[1, :7], want[1, :7], rtol=1e-5, atol=1e-5)


def test_an_exported_softmax_folder_loads_with_from_pretrained(tmp_path):
    model = llama(share_output_embedding=False)
    export(model, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "model.safetensors"}
    assert "mmlight_attention" not in json.loads((tmp_path / "config.json").read_text())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    # mmlight's loader too: a folder without the entry loads with transformers' own attention
    ours = hf_attention.from_pretrained(tmp_path).eval()
    assert ours.config._attn_implementation != hf_attention.IMPLEMENTATION
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, mmlight_logits(model, x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours(x).logits, loaded(x).logits, rtol=0, atol=0)


def greedy(model: TransformerLM, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """mmlight's greedy continuation, one full forward per token (no cache)."""
    seq = prompt
    for _ in range(steps):
        seq = torch.cat([seq, mmlight_logits(model, seq)[:, -1:].argmax(-1)], dim=1)
    return seq


@pytest.mark.parametrize("name", ["multimax", "softmax1", "sink", "stickbreaking", "ssmax", "sigmoid", "softpick"])
def test_an_exported_function_runs_as_itself_in_transformers(name, tmp_path):
    """Loaded with the registered ``mmlight`` implementation: equal logits, and greedy generation through
    transformers' KV cache (its mask function at work on every step), dynamic and static (every slot of
    ``max_cache_len`` there from the first step, the unfilled ones masked), equals mmlight's tokens."""
    model = llama(name)
    export(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["attn_implementation"] == "mmlight" and config["mmlight_attention"]["name"] == name
    loaded = hf_attention.from_pretrained(tmp_path).eval()
    x = tokens()
    with torch.no_grad():
        got = loaded(x).logits
        generated = loaded.generate(x[:, :4], max_new_tokens=6, do_sample=False)
        static = loaded.generate(x[:, :4], max_new_tokens=6, do_sample=False, cache_implementation="static")
    torch.testing.assert_close(got, mmlight_logits(model, x), rtol=1e-5, atol=1e-5)
    assert torch.equal(generated, greedy(model, x[:, :4], 6)) and torch.equal(static, generated)
    # the function matters: transformers' own softmax on the same weights gives other logits
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (plain(x).logits - got).abs().max() > 1e-3


def test_register_puts_the_implementation_and_its_mask_function_under_one_name(monkeypatch):
    """``register`` (run on import) maps ``mmlight`` to the attention function in transformers' attention
    interface and to the mask function in its mask interface; checked from interfaces without it."""
    for interface in (transformers.AttentionInterface, transformers.AttentionMaskInterface):
        without = {k: v for k, v in interface._global_mapping.items() if k != hf_attention.IMPLEMENTATION}
        monkeypatch.setattr(interface, "_global_mapping", without)
    hf_attention.register()
    assert transformers.AttentionInterface()["mmlight"] is hf_attention.mmlight_attention
    assert transformers.AttentionMaskInterface()["mmlight"] is hf_attention.mmlight_mask
    assert None not in transformers.AttentionInterface._global_mapping


def test_an_exported_functions_options_and_attention_dropout_reach_transformers(tmp_path):
    """The function is rebuilt with its exported options (first-order MultiMax, whose parameters have
    another shape than the default's); transformers' attention dropout applies in training only."""
    model = llama("multimax", {"order": 1})
    export(model, tmp_path)
    loaded = hf_attention.from_pretrained(tmp_path, attention_dropout=0.5).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, mmlight_logits(model, x), rtol=1e-5, atol=1e-5)
        loaded.train()
        torch.manual_seed(0)
        first = loaded(x).logits
        torch.manual_seed(1)
        assert (loaded(x).logits - first).abs().max() > 1e-3  # dropped weights differ between the draws


def test_the_mmlight_implementation_without_its_config_entry_is_named():
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    config._attn_implementation = hf_attention.IMPLEMENTATION
    with pytest.raises(ValueError) as error, torch.no_grad():
        transformers.LlamaForCausalLM(config)(tokens())
    assert str(error.value) == (
        "attn_implementation='mmlight' needs the config entry 'mmlight_attention' that `mmlight export hf` "
        "writes; this model has none"
    )


def test_causal_masking_is_not_dropped():
    """Changing the last token leaves every earlier position's logits as they were."""
    loaded = to_hf(llama("multimax"))
    x = tokens()
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % V
    with torch.no_grad():
        a, b = loaded(x).logits, loaded(y).logits
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


@pytest.mark.parametrize(
    "fields, reasons",
    [
        (
            {"gate": "headwise"},
            ["gate='headwise': the gate reads the layer's input, which transformers' attention functions do not get"],
        ),
        ({"output_multimax": True}, ["output_multimax=True: a transformers LM head has no output modulation"]),
        ({"positions": "sinusoidal"}, ["positions='sinusoidal': a Llama has 'rope'"]),
        (
            {"embed_scale": None, "norm": "layernorm"},
            ["norm='layernorm': a Llama has 'rmsnorm'", "embed_scale=None: a Llama has 1.0"],
        ),
        ({"qk_norm": True, "bias": True}, ["qk_norm with bias=True: Qwen3's feed-forward has no biases"]),
        ({"bias": True}, []),  # a Llama's projections may have biases; Qwen3's (qk_norm) may not
        ({"qk_norm": True}, []),
    ],
)
def test_what_transformers_cannot_express_is_refused_with_the_reasons(fields, reasons):
    model = llama(**fields)
    assert unsupported(model) == reasons
    if reasons:
        with pytest.raises(NotExportable) as refused:
            to_hf(model)
        assert str(refused.value) == "this network cannot be a transformers Llama: " + "; ".join(reasons)


def test_a_network_other_than_a_language_model_is_named_by_its_class():
    assert unsupported(torch.nn.Linear(2, 2)) == ["only a decoder-only TransformerLM exports, not a Linear"]


def write_checkpoint(task, path):
    """The parts of a Lightning checkpoint that ``load_from_checkpoint`` reads."""
    state = {"state_dict": task.state_dict(), "hyper_parameters": dict(task.hparams)}
    torch.save({**state, "pytorch-lightning_version": lightning.__version__}, path)


def test_the_export_command_writes_a_folder_transformers_loads(tmp_path, capsys):
    model = llama("multimax")
    task = LanguageModel(model.config)
    task.model.load_state_dict(model.state_dict())
    write_checkpoint(task, tmp_path / "llm.ckpt")
    mmlight(["export", "hf", "--ckpt_path", str(tmp_path / "llm.ckpt"), "--out", str(tmp_path / "hf")])
    written = f"wrote {tmp_path / 'hf' / 'config.json'} and {tmp_path / 'hf' / 'model.safetensors'}"
    assert capsys.readouterr().out.splitlines()[-1] == written
    loaded = hf_attention.from_pretrained(tmp_path / "hf").eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, mmlight_logits(model, x), rtol=1e-5, atol=1e-5)


def test_the_export_command_names_what_stops_it(tmp_path):
    with pytest.raises(SystemExit, match="checkpoint .*missing.ckpt does not exist"):
        mmlight(["export", "hf", "--ckpt_path", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "hf")])
    task = LanguageModel(TransformerConfig(vocab_size=V, d_model=32, n_heads=4, ffn_dim=48, n_layers=1))
    write_checkpoint(task, tmp_path / "fairseq.ckpt")
    with pytest.raises(SystemExit, match="fairseq.ckpt: this network cannot be a transformers Llama: pre_norm=False"):
        mmlight(["export", "hf", "--ckpt_path", str(tmp_path / "fairseq.ckpt"), "--out", str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()


def test_the_export_command_reads_the_checkpoint_onto_the_cpu(tmp_path, monkeypatch):
    """A checkpoint saved on a GPU node exports on a machine without one: its tensors are mapped to the CPU."""
    task = LanguageModel(llama().config)
    write_checkpoint(task, tmp_path / "llm.ckpt")
    load, asked = LanguageModel.load_from_checkpoint, []

    def recording_load(path, **kwargs):
        asked.append(kwargs)
        return load(path, **kwargs)

    monkeypatch.setattr(LanguageModel, "load_from_checkpoint", recording_load)
    mmlight(["export", "hf", "--ckpt_path", str(tmp_path / "llm.ckpt"), "--out", str(tmp_path / "hf")])
    assert asked == [{"map_location": "cpu"}]


def test_another_tasks_checkpoint_is_named_with_the_reason(tmp_path):
    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"classes": 10}, "pytorch-lightning_version": "2.6.0"}, path)
    with pytest.raises(SystemExit) as stop:
        mmlight(["export", "hf", "--ckpt_path", str(path), "--out", str(tmp_path / "hf")])
    assert str(stop.value).startswith(f"mmlight export: error: {path} is not a LanguageModel checkpoint: ")
    # the reason: a classifier's hyperparameters have no language-model network
    assert str(stop.value).endswith("missing 1 required positional argument: 'model'")
    assert not (tmp_path / "hf").exists()


def help_text(argv: list[str], capsys) -> str:
    """``mmlight <argv>`` (a ``--help``), its standard output with whitespace runs as one space (argparse
    wraps at the terminal's width)."""
    with pytest.raises(SystemExit) as stop:
        mmlight(argv)
    assert stop.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_the_export_commands_help_says_what_each_part_is(capsys):
    top = help_text(["export", "--help"], capsys)
    assert top.startswith("usage: mmlight export [-h] FORMAT ... export a checkpoint to another ecosystem ")
    assert " FORMAT hf a transformers model folder (LlamaForCausalLM, or Qwen3ForCausalLM with qk_norm) " in top
    hf = help_text(["export", "hf", "--help"], capsys)
    assert hf.startswith(
        "usage: mmlight export hf [-h] --ckpt_path CKPT_PATH --out OUT "
        "Write a Llama-style LanguageModel checkpoint as a transformers model folder. "
    )
    assert " --ckpt_path CKPT_PATH the LanguageModel checkpoint (.ckpt) " in hf
    assert hf.endswith(" --out OUT the folder to write (created; files in it are replaced)")


@pytest.mark.parametrize(
    "argv, missing",
    [
        (["export"], "FORMAT"),
        (["export", "hf", "--out", "x"], "--ckpt_path"),
        (["export", "hf", "--ckpt_path", "y"], "--out"),
    ],
)
def test_the_export_command_names_what_is_missing(argv, missing, capsys):
    with pytest.raises(SystemExit) as stop:
        mmlight(argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err.endswith(f"error: the following arguments are required: {missing}\n")


def test_the_export_commands_arguments_are_paths_under_their_names():
    args = parse_args(["hf", "--ckpt_path", "runs/best.ckpt", "--out", "exported"])
    assert vars(args) == {"format": "hf", "ckpt_path": Path("runs/best.ckpt"), "out": Path("exported")}


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_exported_config_states_each_field_of_the_network(qk_norm):
    """Values away from transformers' defaults (Qwen3's head_dim is 128, Llama's BOS/EOS ids 1 and 2, its
    rope_theta 10 000), so that each field shows that it was passed."""
    model = llama(rope_theta=5e5, bias=not qk_norm, attention_dropout=0.25, max_positions=77, pad_id=3, qk_norm=qk_norm)
    config = hf_config(model)
    assert type(config).__name__ == ("Qwen3Config" if qk_norm else "LlamaConfig")
    assert (config.head_dim, config.max_position_embeddings, config.rope_parameters) == (
        8,
        77,
        {"rope_type": "default", "rope_theta": 5e5},
    )
    assert (config.attention_bias, config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        not qk_norm,
        3,
        None,
        None,
    )
    assert config.attention_dropout == 0.25 and config.dtype == torch.float32
    assert qk_norm or config.mlp_bias  # Qwen3's feed-forward has no biases to state


def test_only_softmax_at_temperature_one_and_fixed_is_transformers_own_attention():
    assert uses_plain_softmax(llama("softmax")) and uses_plain_softmax(llama("softmax", {"temperature": 1.0}))
    assert not uses_plain_softmax(llama("softmax", {"temperature": 2.0}))
    assert not uses_plain_softmax(llama("softmax", {"learnable": True}))
    assert not uses_plain_softmax(llama("multimax"))


def test_the_in_memory_model_runs_the_function_it_was_given():
    """``to_hf`` without a save: a function other than softmax runs as the ``mmlight`` implementation,
    plain softmax as transformers' own (SDPA), each with mmlight's logits."""
    x = tokens()
    for name, implementation in (("multimax", "mmlight"), ("softmax", "sdpa")):
        model = llama(name)
        hf = to_hf(model)
        assert hf.config._attn_implementation == implementation
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, mmlight_logits(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda state: state.pop("model.norm.weight"), "missing ['model.norm.weight'], unexpected []"),
        (lambda state: state.update(extra=torch.zeros(1)), "missing [], unexpected ['extra']"),
    ],
)
def test_a_weight_that_does_not_map_stops_the_export_naming_it(monkeypatch, edit, message):
    """A name mapping out of step with transformers' modules is never a silent partial copy, with tied
    embeddings too (whose ``lm_head.weight`` transformers reports missing and ties after loading)."""
    model = llama(share_output_embedding=True)

    def edited(m):
        state = hf_state_dict(m)
        edit(state)
        return state

    monkeypatch.setattr(hf_export, "hf_state_dict", edited)
    with pytest.raises(RuntimeError) as err:
        to_hf(model)
    assert str(err.value) == f"weights that did not map: {message}"


def test_an_exported_folder_holds_safetensors_and_a_config_laid_out_as_transformers_writes_it(tmp_path):
    """``model.safetensors`` (no pickle to trust when loading), and ``config.json`` with the ``mmlight``
    entries added, still indented by two and sorted, as transformers writes its configs."""
    export(llama("multimax"), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".safetensors", ".bin")) == ["model.safetensors"]
    text = (tmp_path / "config.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
