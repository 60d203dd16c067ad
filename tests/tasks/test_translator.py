"""Translator: BLEU against sacreBLEU and a BLEU written from its definition, the hypotheses files of
`test`, `predict` on a raw text file in line order, and validation perplexity from summed NLL."""

import collections
import json
import math
from pathlib import Path

import lightning as L
import pytest
import sacrebleu
import torch

from mmlight.data import ToyTranslationDataModule
from mmlight.models import ReweightingSpec, TransformerConfig
from mmlight.models.beam_search import BeamSearchConfig, beam_search
from mmlight.tasks import Translator
from mmlight.tasks.bleu import corpus_bleu


def bleu_by_definition(hypotheses: list[str], references: list[str]) -> float:
    """Papineni et al. (2002) corpus BLEU-4 on whitespace tokens, lowercased: clipped n-gram
    precisions summed over the corpus, their geometric mean, and the brevity penalty."""
    matches, totals = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hypotheses, references):
        h, r = hyp.lower().split(), ref.lower().split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            h_ngrams = collections.Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            r_ngrams = collections.Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(c, r_ngrams[g]) for g, c in h_ngrams.items())
            totals[n - 1] += max(0, len(h) - n + 1)
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity = min(0.0, 1 - ref_len / hyp_len)
    return 100 * math.exp(log_precision + brevity)


HYPS = ["The cat sat on the mat .", "a dog barks loudly at the moon tonight", "he reads the old book ."]
REFS = ["the cat sat on a mat .", "A dog barks at the moon tonight", "he reads an old red book ."]


def test_bleu_matches_sacrebleu_and_the_definition():
    scores = corpus_bleu(HYPS, REFS, HYPS, REFS)
    assert scores.bleu == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score)
    assert scores.bleu_tok == pytest.approx(bleu_by_definition(HYPS, REFS), abs=1e-9)
    assert scores.bleu != scores.bleu_tok  # case matters for the detokenised score
    assert "tok:13a" in scores.signature and "tok:none" in scores.signature_tok and "lc" in scores.signature_tok
    assert scores.sentences == 3
    with pytest.raises(ValueError, match="differ in length"):
        corpus_bleu(HYPS, REFS[:2], HYPS, REFS)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    data = ToyTranslationDataModule(cache_dir=str(tmp_path_factory.mktemp("toy")), train_size=200, valid_size=12,
                                    test_size=10, max_tokens=96)
    data.prepare_data()
    return data


def tiny_translator(vocab_size: int, attention: str = "multimax", **task) -> Translator:
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=vocab_size, d_model=16, n_heads=2, ffn_dim=32, n_layers=1,
                               n_encoder_layers=1, dropout=0.0, max_positions=64, share_embeddings=True,
                               attention=ReweightingSpec(attention))
    return Translator(config, beam=BeamSearchConfig(beam_size=3, max_len_a=1.0, max_len_b=3), **task)


def trainer(tmp_path) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))


def test_test_writes_hypotheses_and_bleu_of_the_whole_split(toy, tmp_path):
    model = tiny_translator(toy.vocab_size, output_dir=str(tmp_path / "out"))
    metrics = trainer(tmp_path).test(model, toy, verbose=False)[0]
    out = tmp_path / "out"
    hyps = (out / "test.hyp").read_text().splitlines()
    refs = (out / "test.ref").read_text().splitlines()
    assert len(hyps) == len(refs) == 10
    # references are the raw test targets, in split order
    raw = (toy_raw_dir(toy) / "test.en").read_text().splitlines()
    assert refs == [toy.decode(toy.encode(line, lang="en")) for line in raw]
    # the logged and written BLEU are sacreBLEU's on the written files
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    written = json.loads((out / "test.bleu.json").read_text())
    assert metrics["test/bleu"] == pytest.approx(expected) == pytest.approx(written["bleu"])
    tok = sacrebleu.corpus_bleu((out / "test.hyp.tok").read_text().splitlines(),
                                [(out / "test.ref.tok").read_text().splitlines()], tokenize="none", lowercase=True)
    assert metrics["test/bleu_tok"] == pytest.approx(tok.score)
    # each hypothesis is the beam search of its own sentence, decoded
    batch = next(iter(toy.test_dataloader()))
    found, _ = beam_search(model.model, batch["src"], batch["src_mask"], model.beam, start_id=toy.eos_id,
                           eos_id=toy.eos_id, pad_id=toy.pad_id, banned_ids=(toy.bos_id,))
    for sample_id, ids in zip(batch["ids"].tolist(), found):
        assert hyps[sample_id] == toy.decode(ids)
    assert math.isfinite(metrics["test/ppl"]) and metrics["test/tokens"] == sum(
        len(toy.encode(line, lang="en")) + 1 for line in raw)


def toy_raw_dir(toy) -> Path:
    """Where ToyTranslationDataModule keeps the generated raw corpus."""
    return Path(toy.root) / "raw"


def test_predict_translates_a_text_file_in_line_order(toy, tmp_path):
    lines = (toy_raw_dir(toy) / "valid.de").read_text().splitlines()[:7]
    src_file = tmp_path / "input.de"
    src_file.write_text("\n".join(lines) + "\n")
    toy.src_file = str(src_file)
    try:
        model = tiny_translator(toy.vocab_size, output_dir=str(tmp_path))
        trainer(tmp_path).predict(model, toy)
    finally:
        toy.src_file = None
    written = (tmp_path / "predict.hyp").read_text().splitlines()
    assert len(written) == 7
    for line, hyp in zip(lines, written):  # each alone gives the same translation as in the batch
        src = torch.tensor([toy.encode(line) + [toy.eos_id]])
        alone, _ = beam_search(model.model, src, None, model.beam, start_id=toy.eos_id, eos_id=toy.eos_id,
                               pad_id=toy.pad_id, banned_ids=(toy.bos_id,))
        assert hyp == toy.decode(alone[0])


def test_validation_perplexity_is_exp_mean_nll(toy, tmp_path):
    model = tiny_translator(toy.vocab_size, "softmax").eval()
    metrics = trainer(tmp_path).validate(model, toy, verbose=False)[0]
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in toy.val_dataloader():
            for b in range(len(batch["ids"])):  # one sentence at a time, no padding
                n_src, n_tgt = int(batch["src_mask"][b].sum()), int(batch["tgt_mask"][b].sum())
                logits = model(batch["src"][b:b + 1, :n_src], batch["tgt_in"][b:b + 1, :n_tgt])[0]
                logp = torch.log_softmax(logits.double(), dim=-1)
                total -= logp[torch.arange(n_tgt), batch["tgt_out"][b, :n_tgt]].sum().item()
                count += n_tgt
    assert metrics["val/tokens"] == count
    assert metrics["val/ppl"] == pytest.approx(math.exp(total / count), rel=1e-4)
    assert "val/bleu" not in metrics  # bleu_in_validation is off


def test_vocabulary_mismatch_is_named(toy, tmp_path):
    with pytest.raises(ValueError, match=f"vocab_size: {toy.vocab_size}"):
        trainer(tmp_path).validate(tiny_translator(toy.vocab_size + 3), toy, verbose=False)
