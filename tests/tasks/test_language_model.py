"""LanguageModel: perplexity over a whole split equals exp(mean NLL) computed independently, the vocab
check, the optimiser recipe and the inverse-sqrt schedule."""

import math

import pytest
import torch

from mmlight.data.prepare.wikitext import prepare
from mmlight.data.text import WikiTextDataModule
from mmlight.data.vocab import load_vocab
from mmlight.models import ReweightingSpec
from mmlight.models.transformer import LLAMA_STYLE
from mmlight.tasks import LanguageModel
from tests.helpers.models import tiny_transformer
from tests.helpers.trainer import quiet_trainer
from tests.helpers.wikitext import VALID, tokens, write_raw


@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):
    root = tmp_path_factory.mktemp("wikitext")
    out = root / "shards"
    prepare(write_raw(root / "raw"), out, workers=1)
    return out


def tiny_lm(vocab_size: int, attention: str = "softmax", output_multimax: bool = False, **task) -> LanguageModel:
    config = tiny_transformer(
        vocab_size=vocab_size,
        dropout=0.0,
        max_positions=64,
        attention=ReweightingSpec(attention),
        output_multimax=output_multimax,
    )
    return LanguageModel(config, **task)


def reference_ppl(model: LanguageModel, ids: list[int], eos: int, window: int, context: int = 0) -> float:
    """exp(mean NLL), written from the definition: the stream after a leading </s>; windows of
    ``window`` inputs start every ``window - context`` tokens; the first scores all its targets, each
    later one only the targets after its first ``context``."""
    stream = torch.tensor([eos] + ids)
    nll = []
    with torch.no_grad():
        for start in range(0, len(ids), window - context):
            skip = 0 if start == 0 else context
            if start + skip >= len(ids):
                break
            inp = stream[start : min(start + window, len(ids))]
            tgt = stream[start + 1 : start + 1 + len(inp)]
            logp = torch.log_softmax(model(inp[None])[0].double(), dim=-1)  # (T, V)
            nll += (-logp[torch.arange(len(tgt)), tgt])[skip:].tolist()
    assert len(nll) == len(ids)
    return math.exp(sum(nll) / len(nll))


@pytest.mark.parametrize(
    "attention, output_multimax, window",
    [("softmax", False, 4), ("softmax", False, 64), ("multimax", True, 5), ("entmax15", False, 3)],
)
def test_perplexity_is_exp_mean_nll(wikitext, attention, output_multimax, window):
    vocab = load_vocab(wikitext / "vocab.txt")
    ids = [vocab.index(t) if t in vocab else vocab.index("<unk>") for t in tokens(VALID)]
    torch.manual_seed(1)
    model = tiny_lm(len(vocab), attention, output_multimax).eval()
    data = WikiTextDataModule(
        str(wikitext), block_size=8, batch_size=2, num_workers=0, eval_block_size=window, eval_context=0
    )
    metrics = quiet_trainer().validate(model, data, verbose=False)[0]
    expected = reference_ppl(model, ids, vocab.index("</s>"), window)
    assert metrics["val/ppl"] == pytest.approx(expected, rel=1e-4)
    assert metrics["val/loss"] == pytest.approx(math.log(expected), rel=1e-4)
    assert metrics["val/tokens"] == len(ids)


@pytest.mark.parametrize("window, context", [(6, 3), (5, 4), (8, 1)])
def test_sliding_window_perplexity(wikitext, window, context):
    """With context, every token is scored once, each from the window the definition gives it."""
    vocab = load_vocab(wikitext / "vocab.txt")
    ids = [vocab.index(t) if t in vocab else vocab.index("<unk>") for t in tokens(VALID)]
    model = tiny_lm(len(vocab), "multimax").eval()
    data = WikiTextDataModule(str(wikitext), num_workers=0, batch_size=3, eval_block_size=window, eval_context=context)
    metrics = quiet_trainer().validate(model, data, verbose=False)[0]
    assert metrics["val/tokens"] == len(ids)
    assert metrics["val/ppl"] == pytest.approx(
        reference_ppl(model, ids, vocab.index("</s>"), window, context), rel=1e-4
    )


def test_vocabulary_mismatch_stops_before_any_step(wikitext):
    model = tiny_lm(7)
    with pytest.raises(ValueError, match="vocab_size: 16"):
        quiet_trainer().validate(model, WikiTextDataModule(str(wikitext), num_workers=0), verbose=False)


def test_fit_steps_and_inverse_sqrt_schedule(wikitext):
    """A few steps of training lower the training-set NLL and follow fairseq's inverse-sqrt rate."""
    model = tiny_lm(16, lr=1e-2, warmup_steps=3)
    data = WikiTextDataModule(str(wikitext), block_size=4, batch_size=2, num_workers=0, shuffle_buffer=0)
    fit = quiet_trainer(max_steps=6, num_sanity_val_steps=0, limit_val_batches=0)
    train_split = WikiTextDataModule(
        str(wikitext), num_workers=0, batch_size=2, eval_block_size=4, eval_context=0, val_split="train"
    )
    before = quiet_trainer().validate(model.eval(), train_split, verbose=False)[0]["val/loss"]
    fit.fit(model.train(), data)
    after = quiet_trainer().validate(model.eval(), train_split, verbose=False)[0]["val/loss"]
    assert after < before - 0.05, (before, after)  # nats per training token
    optimizer = fit.optimizers[0]
    assert fit.global_step == 6
    # after 6 steps the scheduler sets step 7's factor: sqrt(3 / 7)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * math.sqrt(3 / 7))
    assert optimizer.defaults["betas"] == (0.9, 0.98)
    decayed = [g for g in optimizer.param_groups if g["weight_decay"] > 0]
    assert decayed and decayed[0]["weight_decay"] == 0.01


def test_predict_scores_each_window_and_they_sum_to_the_test_perplexity(wikitext):
    """`predict` returns per-window NLL sums and counts; over the test split they give test/ppl."""
    model = tiny_lm(16, "multimax", output_multimax=True).eval()
    data = WikiTextDataModule(str(wikitext), num_workers=0, batch_size=2, eval_block_size=5, eval_context=2)
    tested = quiet_trainer().test(model, data, verbose=False)[0]
    batches = quiet_trainer().predict(model, data)
    nll = torch.cat([b["nll"] for b in batches]).double()
    tokens = torch.cat([b["tokens"] for b in batches])
    assert len(nll) == len(data.eval_dataset("test").windows)
    assert tokens.sum().item() == tested["test/tokens"]
    assert math.exp(nll.sum().item() / tokens.sum().item()) == pytest.approx(tested["test/ppl"], rel=1e-5)


def test_robustness_metric_is_accuracy_when_the_task_reports_it():
    """The recall quick start's headline metric is accuracy, so its robustness runs report it; a
    WikiText model (no accuracy) reports perplexity."""
    from mmlight.tasks.protocol import TaskMetric

    assert tiny_lm(32, accuracy=True).task_metric == TaskMetric("acc", higher_is_better=True)
    assert tiny_lm(32).task_metric == TaskMetric("ppl", higher_is_better=False)


# -- generate ------------------------------------------------------------------------------------
GENERATE_DOCS = [
    "The cache keeps the keys and values of every earlier token.",
    "A decoder predicts the next token from the tokens before it.",
    "Rotary positions turn each query and key by its position.",
] * 4


@pytest.fixture(scope="module")
def bpe_text(tmp_path_factory):
    """A byte-level BPE shard set (``mmlight prepare text``) of a few English sentences."""
    from mmlight.data.prepare.text import prepare as prepare_text

    root = tmp_path_factory.mktemp("bpe")
    for i, doc in enumerate(GENERATE_DOCS):
        (root / "raw").mkdir(exist_ok=True)
        (root / "raw" / f"{i:02d}.txt").write_text(f"{doc} ({i})", encoding="utf-8")
    prepare_text([root / "raw"], root / "shards", vocab_size=300, valid_fraction=0.2)
    return root / "shards"


def llama_lm(vocab_size: int) -> LanguageModel:
    config = tiny_transformer(
        vocab_size=vocab_size, max_positions=8, n_heads=4, n_kv_heads=2, qk_norm=True, **LLAMA_STYLE
    )
    return LanguageModel(config)


def greedy_by_full_forward(model: LanguageModel, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding written from its definition: the whole sequence through the network at every
    step, no cache; the argmax of the last position's logits (``<pad>`` excluded), stopping at ``</s>``."""
    vocab = model.vocab
    seq = [vocab.eos_id, *vocab.encode(prompt)]
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([seq]))[0, -1]  # (V,)
            logits[vocab.pad_id] = -math.inf
            token = int(logits.argmax())
            if token == vocab.eos_id:
                break
            seq.append(token)
            new.append(token)
    assert len(new) >= 3, "the reference stopped too early to compare anything"
    return vocab.decode(new)


def test_greedy_generation_through_the_cache_is_the_full_forward_argmax(bpe_text):
    data = WikiTextDataModule(str(bpe_text), block_size=8, batch_size=2, num_workers=0)
    torch.manual_seed(0)
    model = llama_lm(data.vocab_size).double().eval()  # float64: no near-ties decided by rounding
    model.use_data(data)
    prompts = ["The cache keeps", ""]
    # 12 new tokens: past max_positions (8), which rotary positions do not limit
    expected = [greedy_by_full_forward(model, p, 12) for p in prompts]
    assert model.generate(prompts, max_new_tokens=12) == expected
    assert model.generate(prompts, max_new_tokens=12, temperature=0.7, top_k=1, seed=3) == expected  # top-1 draw
    sampled = model.generate(prompts, max_new_tokens=12, temperature=1.0, seed=5)
    assert model.generate(prompts, max_new_tokens=12, temperature=1.0, seed=5) == sampled  # seeded: repeatable
    assert model.generate(prompts, max_new_tokens=0) == ["", ""]


def test_next_token_samples_from_the_tempered_top_k_distribution():
    from mmlight.tasks.language_model import next_token

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    generator = torch.Generator().manual_seed(0)
    drawn = next_token(logits, temperature=2.0, top_k=3, generator=generator)
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 2.0, dim=0)  # the fourth token is cut
    frequencies = torch.bincount(drawn, minlength=4).double() / len(drawn)
    assert frequencies[3] == 0
    assert torch.allclose(frequencies[:3], expected.double(), atol=0.015)  # ~4.5 standard errors at 20k draws
    # temperature 0: each row's own argmax, a batch of them
    rows = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]])
    assert next_token(rows, temperature=0.0, top_k=None, generator=generator).tolist() == [1, 0]


def test_generate_decodes_from_the_checkpoint_without_the_data(bpe_text, tmp_path):
    import shutil

    data_root = tmp_path / "data"
    shutil.copytree(bpe_text, data_root)
    data = WikiTextDataModule(str(data_root), block_size=8, batch_size=2, num_workers=0)
    torch.manual_seed(1)
    model = llama_lm(data.vocab_size)
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    expected = model.generate(["A decoder predicts"], max_new_tokens=6)
    shutil.rmtree(data_root)
    loaded = LanguageModel.load_from_checkpoint(tmp_path / "lm.ckpt", map_location="cpu")
    assert loaded.generate(["A decoder predicts"], max_new_tokens=6) == expected
    assert loaded.vocab.decode(loaded.vocab.encode("A decoder predicts")) == "A decoder predicts"


def test_bad_generate_arguments_are_named(bpe_text):
    data = WikiTextDataModule(str(bpe_text), block_size=8, batch_size=2, num_workers=0)
    model = llama_lm(data.vocab_size)
    with pytest.raises(RuntimeError, match="vocabulary"):
        model.generate(["x"], 2)
    model.use_data(data)
    with pytest.raises(TypeError, match="^generate takes a list of prompts; wrap a single one in a list$"):
        model.generate("x", 2)
    with pytest.raises(ValueError, match="temperature >= 0"):
        model.generate(["x"], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k >= 1"):
        model.generate(["x"], 2, temperature=1.0, top_k=0)
    # a prompt and its continuation take the prompt with its </s> start and every new token but the last
    # (never fed back): a position table allows exactly max_positions of them
    for positions in ("learned", "sinusoidal"):
        table = LanguageModel(tiny_transformer(vocab_size=data.vocab_size, max_positions=8, positions=positions))
        table.use_data(data)
        fits = 8 - (1 + len(table.vocab.encode("x"))) + 1
        assert len(table.generate(["x"], fits, seed=0)) == 1 and table.generate([], 9) == []
        message = (
            "^a prompt and its continuation need 9 positions, over the model's max_positions=8: "
            "shorten the prompt or lower max_new_tokens$"
        )
        with pytest.raises(ValueError, match=message):
            table.generate(["x"], fits + 1)


def test_generation_stops_before_the_end_of_sequence_token(bpe_text, monkeypatch):
    """A drawn ``</s>`` ends the continuation: the tokens before it are decoded, and nothing more is drawn."""
    from mmlight.tasks import language_model

    data = WikiTextDataModule(str(bpe_text), block_size=8, batch_size=2, num_workers=0)
    model = llama_lm(data.vocab_size)
    model.use_data(data)
    drawn = iter([5, 6, model.vocab.eos_id, 7])
    monkeypatch.setattr(language_model, "next_token", lambda *args: torch.tensor([next(drawn)]))
    assert model.generate(["x"], 4) == [model.vocab.decode([5, 6])]
    assert next(drawn) == 7
