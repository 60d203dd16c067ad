"""The Python API of trained models: a checkpoint written by ``mmlight fit`` carries its vocabulary (or
class names and evaluation transform), and ``translate``, ``score`` and ``classify`` on the loaded
checkpoint alone give what the CLI's own ``predict``, ``test`` and ``validate`` give. A checkpoint
written without them gets a message that says how to attach the data."""

import io
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mmlight.cli import build_cli, main
from mmlight.data import DigitsDataModule, ToyTranslationDataModule, WikiTextDataModule, read_info
from mmlight.data.images import ImageAugment
from mmlight.data.shards import group_samples, iter_tar, split_urls
from mmlight.data.vocab import SPECIALS, ClassMap, Vocab
from mmlight.models import TransformerConfig
from mmlight.models.beam_search import BeamSearchConfig
from mmlight.tasks import ImageClassifier, LanguageModel, Translator
from mmlight.tasks.inference import CHECKPOINT_KEY
from tests.helpers.text_fixtures import FIXTURE_BATCHES

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart"


def run(args: list[str], build: bool = False):
    """``mmlight <args>`` in this process (``build``: return the CLI object, to read its metrics).
    LightningCLI warns when it gets args while sys.argv holds pytest's own arguments."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["mmlight"])
        return build_cli(args) if build else main(args)


def last_checkpoint(runs: Path, name: str) -> Path:
    return runs / name / "version_0" / "checkpoints" / "last.ckpt"


def without_data(checkpoint: Path, out: Path) -> Path:
    """A copy of ``checkpoint`` as mmlight wrote it before checkpoints kept the data's vocabulary."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    del state[CHECKPOINT_KEY]
    torch.save(state, out)
    return out


# ----------------------------------------------------------------------------- translation


@pytest.fixture(scope="module")
def nmt(tmp_path_factory):
    """A translation quick-start checkpoint (a small corpus: the config's 3 epochs of 2 steps) and the options
    that ran it. The fit validates nothing: beam search of a barely trained model over the validation batch
    (sanity check and each epoch) cost more than the fit, and no test here reads a metric of it."""
    tmp = tmp_path_factory.mktemp("nmt")
    common = [
        "--config",
        str(QUICKSTART / "nmt_multimax.yaml"),
        "--data.init_args.cache_dir",
        str(tmp / "toy"),
        "--data.init_args.train_size",
        "400",
        "--data.init_args.valid_size",
        "8",
        "--data.init_args.test_size",
        "8",
        "--trainer.logger.init_args.save_dir",
        str(tmp / "runs"),
    ]
    run(["fit", *common, "--trainer.max_steps", "10", "--trainer.limit_val_batches", "0"])
    return tmp, common, last_checkpoint(tmp / "runs", "nmt_multimax")


SENTENCES = [
    "Heute sieht der alte Hund den Fisch.",
    "der koch , weil er den arzt fragt .",
    "",
    "Mein roter Vogel findet einen blauen Fisch, obwohl es morgen den König ruft.",
]


def cli_predict(nmt, *options: str) -> list[str]:
    tmp, common, checkpoint = nmt
    src_file, out = tmp / "input.de", tmp / f"hyps{len(options)}"
    src_file.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    run(
        [
            "predict",
            *common,
            "--ckpt_path",
            str(checkpoint),
            "--data.init_args.src_file",
            str(src_file),
            "--model.init_args.output_dir",
            str(out),
            *options,
        ]
    )
    return (out / "predict.hyp").read_text(encoding="utf-8").splitlines()


@pytest.mark.slow
def test_translate_gives_what_mmlight_predict_writes(nmt):
    translator = Translator.load_from_checkpoint(nmt[2], map_location="cpu")
    assert translator.translate(SENTENCES) == cli_predict(nmt)
    assert translator.beam.beam_size == 5  # the config's; another one for this call only
    greedy = translator.translate(SENTENCES, beam=BeamSearchConfig(beam_size=1, max_len_a=1.2, max_len_b=10))
    assert greedy == cli_predict(nmt, "--model.init_args.beam.beam_size", "1")
    assert translator.translate([]) == []


@pytest.mark.slow
def test_the_checkpoint_alone_encodes_like_the_data(nmt):
    tmp, _, checkpoint = nmt
    data = ToyTranslationDataModule(cache_dir=str(tmp / "toy"), train_size=400, valid_size=8, test_size=8)
    vocab = Translator.load_from_checkpoint(checkpoint, map_location="cpu").vocab
    assert vocab == data.vocab  # tokens, special ids, Moses and the BPE codes themselves
    for line in SENTENCES:
        assert vocab.encode(line) == data.encode(line)


@pytest.mark.slow
def test_a_checkpoint_without_the_vocabulary_says_how_to_attach_it(nmt, tmp_path):
    tmp, _, checkpoint = nmt
    old = Translator.load_from_checkpoint(without_data(checkpoint, tmp_path / "old.ckpt"), map_location="cpu")
    with pytest.raises(RuntimeError, match=r"no vocabulary: its checkpoint was written before .*use_data\("):
        old.translate(SENTENCES)
    old.use_data(ToyTranslationDataModule(cache_dir=str(tmp / "toy"), train_size=400, valid_size=8, test_size=8))
    new = Translator.load_from_checkpoint(checkpoint, map_location="cpu")
    assert old.translate(SENTENCES) == new.translate(SENTENCES)


def tiny_translator() -> Translator:
    """An untrained translator with a whitespace vocabulary of ten words."""
    vocab = Vocab(SPECIALS + tuple(f"w{i}" for i in range(10)))
    config = TransformerConfig(
        vocab_size=len(vocab), d_model=8, n_heads=2, ffn_dim=8, n_layers=1, n_encoder_layers=1, max_positions=16
    )
    translator = Translator(config)
    translator.use_data(SimpleNamespace(vocab=vocab))
    return translator


def test_translate_decodes_each_sentence_as_beam_search_does_alone():
    """The fast twin of the checkpoint test below: sentences of different lengths, padded together two at a
    time, translate as each does alone through ``generate`` on its own ids (no padding), in order."""
    torch.manual_seed(0)
    translator = tiny_translator().eval()  # (translate evaluates in eval mode: no dropout)
    vocab = translator.vocab
    sentences = ["w1 w2 w3", "w9", "w4 w4 w5 w6 w7", "w8 w0"]
    alone = []
    for sentence in sentences:
        src = torch.tensor([vocab.encode(sentence) + [vocab.eos_id]])  # (1, S)
        alone.append(vocab.decode(translator.generate(src)[0]))
    assert len(set(alone)) > 1  # the untrained model's outputs differ, so the order is checked
    assert translator.translate(sentences, batch_size=2) == alone
    assert translator.translate(sentences[::-1]) == alone[::-1]
    greedy = BeamSearchConfig(beam_size=1, max_len_a=0.0, max_len_b=3)  # this call's settings, not the task's
    src = torch.tensor([vocab.encode(sentences[2]) + [vocab.eos_id]])
    assert translator.translate(sentences[2:3], beam=greedy) == [vocab.decode(translator.generate(src, beam=greedy)[0])]
    assert len(translator.translate(sentences[2:3], beam=greedy)[0].split()) <= 3 < len(alone[2].split())


def test_bad_input_to_translate_is_named():
    translator = tiny_translator()
    with pytest.raises(TypeError) as refused:
        translator.translate("w1 w2")
    assert str(refused.value) == "translate takes a list of sentences; wrap a single one in a list"
    assert len(translator.translate([" ".join(["w3"] * 15)])) == 1  # 15 words and </s>: max_positions exactly
    with pytest.raises(ValueError) as refused:
        translator.translate([" ".join(["w3"] * 16)])
    assert str(refused.value).startswith("sentence 0 has 17 tokens with </s>, over the model's max_positions=16")
    with pytest.raises(ValueError, match="sentence 1 has 21 tokens .* max_positions=16"):
        translator.translate(["w1 w2", " ".join(["w3"] * 20)])
    with pytest.raises(ValueError, match="the data's vocabulary has 4 tokens but model.vocab_size is 14"):
        translator.use_data(SimpleNamespace(vocab=Vocab(SPECIALS)))


def test_a_task_without_its_data_says_how_to_attach_it():
    """The fast twin of the checkpoint tests below: a translator never given its vocabulary names itself,
    what it lacks and the call that attaches it, whole."""
    config = TransformerConfig(vocab_size=14, d_model=8, n_heads=2, ffn_dim=8, n_layers=1, n_encoder_layers=1)
    with pytest.raises(RuntimeError) as refused:
        Translator(config).translate(["w1 w2"])
    assert str(refused.value) == (
        "this Translator has no vocabulary: its checkpoint was written before mmlight kept them in checkpoints "
        "(or the model was never attached to data). Attach the data it was trained on once: "
        "`model.use_data(TranslationDataModule(...))` with the data section of the run's config.yaml; "
        "checkpoints written afterwards carry it"
    )


def test_a_checkpoint_of_other_data_is_refused():
    translator = tiny_translator()
    state = translator.data_state()
    tokens = state["vocab"]["tokens"]
    tokens[5], tokens[6] = tokens[6], tokens[5]
    with pytest.raises(ValueError, match=f"id 5 is {tokens[5]!r} there, {tokens[6]!r} here"):
        translator.load_data_state(state)
    tokens[5], tokens[6] = tokens[6], tokens[5]
    tokens.append("w10")  # the data's tokens and one more: no id differs, the sizes do
    with pytest.raises(ValueError) as refused:
        translator.load_data_state(state)
    assert str(refused.value) == (
        "the checkpoint's vocabulary is not the data's (15 vs 14 tokens): the model was trained on other data"
    )


# ----------------------------------------------------------------------------- language model


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A tiny WikiText-103 language model (the paper's config at toy size, 2 steps on the fixture
    shards) and its ``mmlight test`` metrics."""
    from mmlight.data.prepare.wikitext import prepare
    from tests.helpers.wikitext import write_raw

    tmp = tmp_path_factory.mktemp("lm")
    raw = write_raw(tmp / "raw")
    prepare(raw, tmp / "shards", workers=1)
    common = [
        "--config",
        str(ROOT / "configs" / "lm_wikitext103_multimax.yaml"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        "--trainer.strategy",
        "auto",
        "--trainer.precision",
        "32",
        "--trainer.logger.init_args.save_dir",
        str(tmp / "runs"),
        "--data.init_args.root",
        str(tmp / "shards"),
        "--data.init_args.num_workers",
        "0",
        *FIXTURE_BATCHES["wikitext103"],
        "--model.init_args.model.d_model",
        "16",
        "--model.init_args.model.n_heads",
        "2",
        "--model.init_args.model.ffn_dim",
        "32",
        "--model.init_args.model.n_layers",
        "1",
        "--model.init_args.model.max_positions",
        "16",
        "--model.init_args.warmup_steps",
        "1",
    ]
    run(["fit", *common, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1"])
    checkpoint = last_checkpoint(tmp / "runs", "lm_wikitext103_multimax")
    metrics = run(["test", *common, "--ckpt_path", str(checkpoint)], build=True).trainer.callback_metrics
    return raw, checkpoint, {k: v.item() for k, v in metrics.items()}


def test_scores_of_a_split_give_mmlight_test_s_perplexity(lm):
    raw, checkpoint, metrics = lm
    lines = (raw / "wiki.test.tokens").read_text(encoding="utf-8").splitlines()
    model = LanguageModel.load_from_checkpoint(checkpoint, map_location="cpu")
    # the data config's windows: 8 tokens, 4 of context (FIXTURE_BATCHES)
    scores = model.score(lines, block_size=8, context=4, joined=True)
    tokens = sum(s.tokens for s in scores)
    split = read_info(checkpoint.parents[4] / "shards")["splits"]["test"]
    assert tokens == metrics["test/tokens"] == split["num_tokens"]
    assert math.exp(-sum(s.log_prob for s in scores) / tokens) == pytest.approx(metrics["test/ppl"], rel=1e-5)


def test_a_text_scored_alone_is_its_tokens_predicted_from_end_of_line(lm):
    """Reference: one forward pass over ``</s>`` + the text, in float64, without windows."""
    _, checkpoint, _ = lm
    model = LanguageModel.load_from_checkpoint(checkpoint, map_location="cpu").eval()
    texts = ["the game is a game of the series", "zebra <unk> game", ""]
    for text, score in zip(texts, model.score(texts)):
        ids = model.vocab.encode(text) + [model.vocab.eos_id]
        with torch.no_grad():
            logits = model(torch.tensor([[model.vocab.eos_id] + ids[:-1]]))[0].double()  # (T, V)
        expected = logits.log_softmax(-1)[torch.arange(len(ids)), torch.tensor(ids)].sum().item()
        assert score.tokens == len(ids) and score.log_prob == pytest.approx(expected, rel=1e-5)
    # a text longer than the window is scored in windows, every token once
    long = " ".join(["game"] * 30)
    assert model.score([long], block_size=8, context=4)[0].tokens == 31


def test_a_long_text_is_scored_by_default_in_windows_without_context(lm):
    """``context=0`` by default: a text longer than ``block_size`` is cut into windows that do not overlap, each
    scored on its own. Reference: each window of ``</s>`` + the text's ids forwarded alone, in float64."""
    model = LanguageModel.load_from_checkpoint(lm[1], map_location="cpu").eval()
    ids = model.vocab.encode(" ".join(["game", "the", "series"] * 10)) + [model.vocab.eos_id]  # 31 tokens
    inputs = [model.vocab.eos_id] + ids[:-1]
    expected = 0.0
    for start in range(0, len(ids), 8):  # windows of 8, 8, 8 and 7 tokens
        with torch.no_grad():
            logits = model(torch.tensor([inputs[start : start + 8]]))[0].double()  # (T, V)
        targets = torch.tensor(ids[start : start + 8])
        expected += logits.log_softmax(-1)[torch.arange(len(targets)), targets].sum().item()
    (score,) = model.score([" ".join(["game", "the", "series"] * 10)], block_size=8)
    assert score.tokens == 31 and score.log_prob == pytest.approx(expected, rel=1e-5)


def test_joined_texts_each_get_the_log_probs_of_their_own_tokens(lm):
    """Reference: one float64 forward pass over ``</s>`` + the texts' ids one after the other (the stream fits
    one window), each token's log-probability added to the text it belongs to."""
    model = LanguageModel.load_from_checkpoint(lm[1], map_location="cpu").eval()
    texts = ["the game is", "zebra game", "a game of the series"]
    ids = [model.vocab.encode(text) + [model.vocab.eos_id] for text in texts]
    stream = [i for text_ids in ids for i in text_ids]
    with torch.no_grad():
        logits = model(torch.tensor([[model.vocab.eos_id] + stream[:-1]]))[0].double()  # (T, V)
    per_token = logits.log_softmax(-1)[torch.arange(len(stream)), torch.tensor(stream)]
    ends = np.cumsum([len(text_ids) for text_ids in ids]).tolist()
    scores = model.score(texts, joined=True)
    for score, text_ids, start, end in zip(scores, ids, [0, *ends[:-1]], ends):
        assert score.tokens == len(text_ids)
        assert score.log_prob == pytest.approx(per_token[start:end].sum().item(), rel=1e-5)


def test_score_stops_on_a_window_over_the_model_s_positions(lm):
    model = LanguageModel.load_from_checkpoint(lm[1], map_location="cpu")
    with pytest.raises(ValueError, match="block_size=32 is over the model's max_positions=16"):
        model.score(["game"], block_size=32)
    with pytest.raises(TypeError) as refused:
        model.score("game")
    assert str(refused.value) == "score takes a list of texts; wrap a single one in a list"


def test_an_lm_checkpoint_without_the_vocabulary_says_so(lm, tmp_path):
    old = LanguageModel.load_from_checkpoint(without_data(lm[1], tmp_path / "old.ckpt"), map_location="cpu")
    with pytest.raises(RuntimeError, match=r"no vocabulary: .*use_data\(WikiTextDataModule"):
        old.score(["game"])
    old.use_data(WikiTextDataModule(str(lm[1].parents[4] / "shards")))
    assert old.score(["game"]) == LanguageModel.load_from_checkpoint(lm[1], map_location="cpu").score(["game"])


# ----------------------------------------------------------------------------- image classifier


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A digits quick-start checkpoint (one short epoch) and its ``mmlight validate`` metrics."""
    tmp = tmp_path_factory.mktemp("digits")
    common = [
        "--config",
        str(QUICKSTART / "digits_softmax.yaml"),
        "--data.init_args.cache_dir",
        str(tmp / "cache"),
        "--trainer.logger.init_args.save_dir",
        str(tmp / "runs"),
    ]
    run(
        [
            "fit",
            *common,
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_train_batches",
            "8",
            "--trainer.limit_val_batches",
            "1",
        ]
    )
    checkpoint = last_checkpoint(tmp / "runs", "digits_softmax")
    metrics = run(["validate", *common, "--ckpt_path", str(checkpoint)], build=True).trainer.callback_metrics
    return tmp, checkpoint, {k: v.item() for k, v in metrics.items()}


def validation_images(cache: Path) -> tuple[list[bytes], list[int]]:
    """The PNG bytes and labels of the digits validation split, read from its shards."""
    samples = [s for url in split_urls(cache, read_info(cache), "val") for s in group_samples(iter_tar(url), url)]
    return [s["png"] for s in samples], [int(s["cls"]) for s in samples]


def test_classify_gives_mmlight_validate_s_accuracy_and_loss(digits, tmp_path):
    tmp, checkpoint, metrics = digits
    pngs, labels = validation_images(tmp / "cache")
    assert len(pngs) == 359
    # half as files, half as PIL images
    paths = []
    for i, png in enumerate(pngs[:180]):
        paths.append(tmp_path / f"{i}.png")
        paths[-1].write_bytes(png)
    images = paths + [Image.open(io.BytesIO(png)) for png in pngs[180:]]
    classifier = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu")
    ranked = classifier.classify(images, top_k=10)
    names = [str(label) for label in labels]
    top1 = np.mean([r[0][0] == name for r, name in zip(ranked, names)])
    assert top1 == pytest.approx(metrics["val/top1"], abs=1e-6)
    nll = np.mean([-math.log(dict(r)[name]) for r, name in zip(ranked, names)])
    assert nll == pytest.approx(metrics["val/loss"], rel=1e-5)
    assert all(len(r) == 10 and abs(sum(p for _, p in r) - 1) < 1e-5 for r in ranked)
    for short, full in zip(classifier.classify(images[:2], top_k=3), ranked):
        assert [name for name, _ in short] == [name for name, _ in full[:3]]
        assert [p for _, p in short] == pytest.approx([p for _, p in full[:3]], rel=1e-6)


def test_classify_names_what_it_cannot_take(digits, tmp_path):
    _, checkpoint, _ = digits
    classifier = ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu")
    with pytest.raises(TypeError, match="image 1 is a int"):
        classifier.classify([Image.new("L", (8, 8)), 3])
    with pytest.raises(TypeError, match="list of images"):
        classifier.classify("digit.png")
    with pytest.raises(FileNotFoundError, match="no_such.png"):
        classifier.classify([tmp_path / "no_such.png"])
    grey, colour = Image.new("L", (8, 8), 200), Image.new("RGB", (8, 8), (200, 200, 200))
    assert classifier.classify([grey]) == classifier.classify([colour])  # converted to the config's channels


def test_a_classifier_checkpoint_without_class_names_says_so(digits, tmp_path):
    tmp, checkpoint, _ = digits
    old = ImageClassifier.load_from_checkpoint(without_data(checkpoint, tmp_path / "old.ckpt"), map_location="cpu")
    with pytest.raises(RuntimeError, match=r"no class names and image transforms: .*use_data\("):
        old.classify([Image.new("L", (8, 8))])
    old.use_data(DigitsDataModule(cache_dir=str(tmp / "cache")))
    image = [Image.new("L", (8, 8), 90)]
    assert old.classify(image) == ImageClassifier.load_from_checkpoint(checkpoint, map_location="cpu").classify(image)


def test_a_classifier_without_its_data_names_what_it_lacks_and_the_datamodule_to_attach():
    """The fast twin of the checkpoint test above: the errors whole, the DataModule's name included."""
    from tests.helpers.models import micro_vit

    classifier = ImageClassifier(model=micro_vit(num_classes=5))
    with pytest.raises(RuntimeError) as refused:
        classifier.classify([Image.new("L", (8, 8))])
    assert str(refused.value) == (
        "this ImageClassifier has no class names and image transforms: its checkpoint was written before mmlight "
        "kept them in checkpoints (or the model was never attached to data). Attach the data it was trained on "
        "once: `model.use_data(ImageShardDataModule(...))` with the data section of the run's config.yaml; "
        "checkpoints written afterwards carry it"
    )
    classifier.use_data(SimpleNamespace(class_map=ClassMap(list("abcde")), augment=ImageAugment(image_size=8)))
    with pytest.raises(TypeError) as refused:
        classifier.classify("digit.png")
    assert str(refused.value) == "classify takes a list of images or paths; wrap a single one in a list"
    ten = ImageClassifier(model=micro_vit(num_classes=10))
    grey = ImageAugment(image_size=8, channels=1, mean=(0.5,), std=(0.5,))  # micro_vit has one channel
    ten.use_data(SimpleNamespace(class_map=ClassMap(list("abcdefghij")), augment=grey))
    (ranked,) = ten.classify([Image.new("L", (8, 8), 90)])
    assert len(ranked) == 5 and len({name for name, _ in ranked}) == 5  # top_k=5 by default, of 10 classes


def test_a_classifier_takes_class_names_at_setup_only_from_data_that_has_both_names_and_transforms():
    """A DataModule of the user's own with image transforms but no class names (or names but no transforms)
    trains as it is; only data with both is taken for ``classify``."""
    from tests.helpers.models import micro_vit

    names, augment = ClassMap(list("abcde")), ImageAugment(image_size=8)
    for data in (SimpleNamespace(augment=augment), SimpleNamespace(class_map=names), SimpleNamespace()):
        classifier = ImageClassifier(model=micro_vit(num_classes=5))
        classifier._trainer = SimpleNamespace(datamodule=data)
        classifier.setup("fit")
        assert classifier.class_map is None
    classifier._trainer = SimpleNamespace(datamodule=SimpleNamespace(class_map=names, augment=augment))
    classifier.setup("fit")
    assert classifier.class_map is names


def test_a_sequence_task_given_data_without_a_typed_vocabulary_names_the_data():
    with pytest.raises(TypeError) as refused:
        tiny_translator().use_data(SimpleNamespace(vocab=["<s>", "<pad>"]))
    assert str(refused.value) == "SimpleNamespace has no typed vocabulary (.vocab)"
    with pytest.raises(TypeError) as refused:
        tiny_translator().use_data(SimpleNamespace())
    assert str(refused.value) == "SimpleNamespace has no typed vocabulary (.vocab)"


def test_a_classifier_given_data_without_names_or_transforms_names_the_data():
    from tests.helpers.models import micro_vit

    classifier = ImageClassifier(model=micro_vit(num_classes=5))
    names, augment = ClassMap(list("abcde")), ImageAugment(image_size=8)
    for data in (SimpleNamespace(class_map=names), SimpleNamespace(augment=augment), SimpleNamespace()):
        with pytest.raises(TypeError) as refused:
            classifier.use_data(data)
        assert str(refused.value) == "SimpleNamespace has no class map and image transforms (.class_map, .augment)"
    with pytest.raises(ValueError) as refused:
        classifier.use_data(SimpleNamespace(class_map=ClassMap(list("abc")), augment=augment))
    assert str(refused.value) == "the data has 3 classes but model.num_classes is 5"
    assert classifier.class_map is None


def test_a_classifier_checkpoint_of_other_classes_is_refused_naming_the_first_of_each():
    from tests.helpers.models import micro_vit

    classifier = ImageClassifier(model=micro_vit(num_classes=5))
    data = SimpleNamespace(class_map=ClassMap(["a", "b", "c", "d", "e"]), augment=ImageAugment(image_size=8))
    classifier.use_data(data)
    state = {**ClassMap(["a", "b", "x", "d", "e"]).to_dict(), "augment": {"image_size": 8}}
    with pytest.raises(ValueError) as refused:
        classifier.load_data_state(state)
    assert str(refused.value) == (
        "the checkpoint's classes are not the data's (['a', 'b', 'x']... vs ['a', 'b', 'c']...): "
        "the model was trained on other data"
    )
    classifier.load_data_state(classifier.data_state())  # its own classes: accepted
