"""Translator: BLEU against sacreBLEU and a BLEU written from its definition, the hypotheses files of
`test`, `predict` on a raw text file in line order, and validation perplexity from summed NLL."""

import collections
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import sacrebleu
import torch

from mmlight.data import ToyTranslationDataModule
from mmlight.models import TransformerConfig
from mmlight.models.beam_search import BeamSearchConfig, beam_search
from mmlight.tasks import Translator
from mmlight.tasks.bleu import corpus_bleu
from tests.helpers.models import tiny_translator
from tests.helpers.trainer import quiet_trainer


def bleu_by_definition(hypotheses: list[str], references: list[str]) -> float:
    """Papineni et al. (2002) corpus BLEU-4 on whitespace tokens, lowercased: clipped n-gram
    precisions summed over the corpus, their geometric mean, and the brevity penalty."""
    matches, totals = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hypotheses, references):
        h, r = hyp.lower().split(), ref.lower().split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            h_ngrams = collections.Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_ngrams = collections.Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
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


def test_tokenised_bleu_does_not_warn_about_tokenised_text(caplog):
    """fairseq's tokenised BLEU scores Moses-tokenised text on purpose: sacreBLEU's "forgot to
    detokenize" warning (given when 100 or more lines end in " .") must not fill the log at every
    validation. The detokenised score still warns on such text, as sacreBLEU does."""
    hyps, refs = ["the cat sat on the mat ."] * 120, ["the cat sat on a mat ."] * 120
    with caplog.at_level("WARNING", logger="sacrebleu"):
        scores = corpus_bleu(["The cat sat on the mat."] * 120, ["The cat sat on a mat."] * 120, hyps, refs)
    assert not [r for r in caplog.records if "detokenize" in r.getMessage()]
    assert scores.bleu_tok == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", force=True).score)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    data = ToyTranslationDataModule(
        cache_dir=str(tmp_path_factory.mktemp("toy")), train_size=200, valid_size=12, test_size=10, max_tokens=96
    )
    data.prepare_data()
    return data


def trainer(tmp_path) -> L.Trainer:
    return quiet_trainer(default_root_dir=str(tmp_path))


def test_test_writes_hypotheses_and_bleu_of_the_whole_split(toy, tmp_path):
    model = tiny_translator(toy.vocab_size, output_dir=str(tmp_path / "out"))
    metrics = trainer(tmp_path).test(model, toy, verbose=False)[0]
    out = tmp_path / "out"
    hyps = (out / "test.hyp").read_text().splitlines()
    refs = (out / "test.ref").read_text().splitlines()
    assert len(hyps) == len(refs) == 10
    # references are the raw test targets, in split order: the raw text is tokenised and lowercased
    # already, so the tokenised reference is the raw line and the detokenised one joins the punctuation
    raw = (toy_raw_dir(toy) / "test.en").read_text().splitlines()
    assert (out / "test.ref.tok").read_text().splitlines() == raw
    assert refs == [re.sub(r" ([.,!?])", r"\1", line) for line in raw]
    # the logged and written BLEU are sacreBLEU's on the written files
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    written = json.loads((out / "test.bleu.json").read_text())
    assert metrics["test/bleu"] == pytest.approx(expected) == pytest.approx(written["bleu"])
    tok = sacrebleu.corpus_bleu(
        (out / "test.hyp.tok").read_text().splitlines(),
        [(out / "test.ref.tok").read_text().splitlines()],
        tokenize="none",
        lowercase=True,
    )
    assert metrics["test/bleu_tok"] == pytest.approx(tok.score)
    # each hypothesis is the beam search of its own sentence, decoded
    batch = next(iter(toy.test_dataloader()))
    found, _ = beam_search(
        model.model,
        batch["src"],
        batch["src_mask"],
        model.beam,
        start_id=toy.eos_id,
        eos_id=toy.eos_id,
        pad_id=toy.pad_id,
        banned_ids=(toy.bos_id,),
    )
    hyps_tok = (out / "test.hyp.tok").read_text().splitlines()
    for sample_id, ids in zip(batch["ids"].tolist(), found):
        assert hyps[sample_id] == toy.decode(ids)
        assert hyps_tok[sample_id] == toy.decode(ids, detokenize=False)
    assert math.isfinite(metrics["test/ppl"]) and metrics["test/tokens"] == sum(
        len(toy.encode(line, lang="en")) + 1 for line in raw
    )


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
        alone, _ = beam_search(
            model.model,
            src,
            None,
            model.beam,
            start_id=toy.eos_id,
            eos_id=toy.eos_id,
            pad_id=toy.pad_id,
            banned_ids=(toy.bos_id,),
        )
        assert hyp == toy.decode(alone[0])


def test_validation_perplexity_is_exp_mean_nll(toy, tmp_path):
    model = tiny_translator(toy.vocab_size, "softmax").eval()
    metrics = trainer(tmp_path).validate(model, toy, verbose=False)[0]
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in toy.val_dataloader():
            for b in range(len(batch["ids"])):  # one sentence at a time, no padding
                n_src, n_tgt = int(batch["src_mask"][b].sum()), int(batch["tgt_mask"][b].sum())
                logits = model(batch["src"][b : b + 1, :n_src], batch["tgt_in"][b : b + 1, :n_tgt])[0]
                logp = torch.log_softmax(logits.double(), dim=-1)
                total -= logp[torch.arange(n_tgt), batch["tgt_out"][b, :n_tgt]].sum().item()
                count += n_tgt
    assert metrics["val/tokens"] == count
    assert metrics["val/ppl"] == pytest.approx(math.exp(total / count), rel=1e-4)
    assert "val/bleu" not in metrics  # bleu_in_validation is off


def test_vocabulary_mismatch_is_named(toy, tmp_path):
    with pytest.raises(ValueError, match=f"vocab_size: {toy.vocab_size}"):
        trainer(tmp_path).validate(tiny_translator(toy.vocab_size + 3), toy, verbose=False)


# ---------------------------------------------------------------- the hypotheses files, fast
# Hand-written (hyp, hyp_tok, ref, ref_tok), partly right; the detokenised score is case-sensitive, the
# tokenised one is not, so the two BLEUs differ.
ROWS = {
    0: ("The cat sat on the mat.", "the cat sat on the mat .", "The cat sat on a mat.", "the cat sat on a mat ."),
    1: (
        "A dog barks at the moon.",
        "a dog barks at the moon .",
        "A dog barks at the moon tonight.",
        "a dog barks at the moon tonight .",
    ),
    2: ("he reads the book.", "he reads the book .", "He reads an old book.", "he reads an old book ."),
    3: ("Rain again today.", "rain again today .", "It rains again today.", "it rains again today ."),
    4: ("we sing loud songs.", "we sing loud songs .", "We sing loud songs.", "we sing loud songs ."),
}


def row(i: int, predict: bool = False) -> dict:
    hyp, hyp_tok, ref, ref_tok = ROWS[i]
    return (
        {"id": i, "hyp": hyp, "hyp_tok": hyp_tok}
        if predict
        else {"id": i, "hyp": hyp, "hyp_tok": hyp_tok, "ref": ref, "ref_tok": ref_tok}
    )


class TwoRanks:
    """A single-process stand-in for ``torch.distributed`` with two ranks: ``all_gather_object`` puts
    this process's rows at ``rank`` and ``other_rows`` at the other place."""

    def __init__(self, rank: int, other_rows: list):
        self.rank, self.other_rows = rank, other_rows

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_world_size(self):
        return 2

    def all_gather_object(self, parts, rows):
        parts[self.rank], parts[1 - self.rank] = rows, self.other_rows


def finished(
    tmp_path, monkeypatch, stage: str, mine: list, others: list | None, rank: int = 0, output_dir: str | None = None
):
    """Run ``Translator._finish_generation`` on ``mine`` (this rank's rows) with a stand-in trainer;
    ``others`` (None = not distributed) are the other rank's. Returns (module, logged, rows)."""
    import mmlight.tasks.translator as translator

    if others is not None:
        monkeypatch.setattr(translator, "dist", TwoRanks(rank, others))
    config = TransformerConfig(vocab_size=8, d_model=8, n_heads=2, ffn_dim=8, n_layers=1, n_encoder_layers=1)
    module = Translator(config, output_dir=output_dir)
    module._trainer = SimpleNamespace(is_global_zero=rank == 0, log_dir=str(tmp_path / "logs"))
    logged = {}
    module.log = lambda name, value, **options: logged.__setitem__(name, (value, options))
    module.translations[stage] = list(mine)
    return module, logged, module._finish_generation(stage)


def test_test_files_and_bleu_cover_both_ranks_in_split_order(tmp_path, monkeypatch, capsys):
    out = tmp_path / "not" / "yet" / "there"  # made with its parents
    module, logged, rows = finished(
        tmp_path, monkeypatch, "test", [row(3), row(0), row(4)], [row(2), row(1)], output_dir=str(out)
    )
    order = [0, 1, 2, 3, 4]
    assert [r["id"] for r in rows] == order and "test" not in module.translations
    hyps, refs = [ROWS[i][0] for i in order], [ROWS[i][2] for i in order]
    hyps_tok, refs_tok = [ROWS[i][1] for i in order], [ROWS[i][3] for i in order]
    for suffix, lines in {"hyp": hyps, "hyp.tok": hyps_tok, "ref": refs, "ref.tok": refs_tok}.items():
        assert (out / f"test.{suffix}").read_text(encoding="utf-8") == "".join(line + "\n" for line in lines)
    bleu = sacrebleu.corpus_bleu(hyps, [refs])
    bleu_tok = sacrebleu.corpus_bleu(hyps_tok, [refs_tok], tokenize="none", lowercase=True)
    assert 10 < bleu.score < 90 and 10 < bleu_tok.score < 90 and bleu.score != pytest.approx(bleu_tok.score)
    assert logged["test/bleu"][0] == pytest.approx(bleu.score) and logged["test/bleu"][1]["sync_dist"] is False
    assert logged["test/bleu_tok"][0] == pytest.approx(bleu_tok.score)
    assert logged["test/bleu_tok"][1] == {"sync_dist": False}  # every rank scored every sentence already
    assert logged["test/bleu"][1]["prog_bar"] is True
    text = (out / "test.bleu.json").read_text()
    written = json.loads(text)
    assert text == json.dumps(written, indent=2) + "\n"
    assert written["bleu"] == pytest.approx(bleu.score) and written["bleu_tok"] == pytest.approx(bleu_tok.score)
    assert written["sentences"] == 5 and "tok:none" in written["signature_tok"]
    assert f"mmlight: 5 test translations written to {out / 'test.hyp'}" in capsys.readouterr().out
    module.translations["test"] = [row(4)]  # a second test epoch writes into the existing folder
    module._finish_generation("test")
    assert (out / "test.hyp").read_text() == "".join(ROWS[i][0] + "\n" for i in (1, 2, 4))  # with the other rank's


def test_other_ranks_score_the_same_and_write_nothing(tmp_path, monkeypatch):
    _, logged, rows = finished(
        tmp_path,
        monkeypatch,
        "test",
        [row(2), row(1)],
        [row(3), row(0), row(4)],
        rank=1,
        output_dir=str(tmp_path / "out"),
    )
    order = [0, 1, 2, 3, 4]
    assert [r["id"] for r in rows] == order
    assert logged["test/bleu"][0] == pytest.approx(
        sacrebleu.corpus_bleu([ROWS[i][0] for i in order], [[ROWS[i][2] for i in order]]).score
    )
    assert not (tmp_path / "out").exists()


def test_a_rank_that_translated_nothing_still_scores_and_writes_the_others_rows(tmp_path, monkeypatch):
    """Under DDP a rank may get no test batch and so never records a row: it must still take part in
    the gather, and rank 0 writes every other rank's sentences."""
    module, logged, rows = finished(tmp_path, monkeypatch, "test", [], [row(1), row(0)], output_dir=str(tmp_path / "o"))
    module.translations.clear()  # as on a rank whose _generate never ran
    module._finish_generation("test")
    assert [r["id"] for r in rows] == [0, 1]
    assert (tmp_path / "o" / "test.hyp").read_text() == ROWS[0][0] + "\n" + ROWS[1][0] + "\n"
    assert logged["test/bleu"][0] == pytest.approx(
        sacrebleu.corpus_bleu([ROWS[0][0], ROWS[1][0]], [[ROWS[0][2], ROWS[1][2]]]).score
    )


def test_validation_logs_bleu_but_writes_no_files(tmp_path, monkeypatch):
    _, logged, _ = finished(tmp_path, monkeypatch, "val", [row(1), row(0)], None)
    assert logged["val/bleu"][0] == pytest.approx(
        sacrebleu.corpus_bleu([ROWS[0][0], ROWS[1][0]], [[ROWS[0][2], ROWS[1][2]]]).score
    )
    assert not (tmp_path / "logs").exists()


def test_predict_writes_hypotheses_only_to_the_log_dir(tmp_path, monkeypatch):
    _, logged, rows = finished(tmp_path, monkeypatch, "predict", [row(4, True), row(2, True)], [row(0, True)])
    logs = tmp_path / "logs"
    assert logged == {} and [r["id"] for r in rows] == [0, 2, 4]
    assert (logs / "predict.hyp").read_text() == "".join(ROWS[i][0] + "\n" for i in (0, 2, 4))
    assert (logs / "predict.hyp.tok").read_text() == "".join(ROWS[i][1] + "\n" for i in (0, 2, 4))
    assert sorted(p.name for p in logs.iterdir()) == ["predict.hyp", "predict.hyp.tok"]


def test_without_an_output_dir_or_a_log_dir_the_files_go_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = TransformerConfig(vocab_size=8, d_model=8, n_heads=2, ffn_dim=8, n_layers=1, n_encoder_layers=1)
    module = Translator(config)
    module._trainer = SimpleNamespace(is_global_zero=True, log_dir=None)  # a trainer with logger=False
    module.translations["predict"] = [row(1, True), row(0, True)]
    module._finish_generation("predict")
    assert (tmp_path / "predict.hyp").read_text() == ROWS[0][0] + "\n" + ROWS[1][0] + "\n"


def test_gather_to_all_is_the_identity_without_a_process_group(monkeypatch):
    from mmlight.tasks.translator import gather_to_all

    rows = [row(1), row(0)]
    assert gather_to_all(rows) is rows
    import mmlight.tasks.translator as translator

    one_rank = TwoRanks(0, [])
    one_rank.get_world_size = lambda: 1
    monkeypatch.setattr(translator, "dist", one_rank)
    assert gather_to_all(rows) is rows
    monkeypatch.setattr(translator, "dist", TwoRanks(1, [row(4)]))
    assert gather_to_all(rows) == [row(4), row(1), row(0)]  # rank order, then each rank's own order


def test_generate_decodes_hypotheses_and_references_of_each_sentence(monkeypatch):
    config = TransformerConfig(vocab_size=8, d_model=8, n_heads=2, ffn_dim=8, n_layers=1, n_encoder_layers=1)
    module = Translator(config)
    module.vocab = SimpleNamespace(
        decode=lambda ids, detokenize=True: ("D" if detokenize else "T") + str(torch.as_tensor(ids).tolist())
    )
    found = [torch.tensor([5, 6]), torch.tensor([7])]
    masks = []
    monkeypatch.setattr(module, "generate", lambda src, src_mask: masks.append(src_mask) or found)
    batch = {
        "ids": torch.tensor([9, 4]),
        "src": torch.zeros(2, 3),
        "src_mask": torch.ones(2, 3, dtype=torch.bool),
        "tgt_out": torch.tensor([[3, 4], [5, 2]]),
    }
    rows = module._generate("test", batch)
    assert len(masks) == 1 and masks[0] is batch["src_mask"]  # beam search sees the batch's padding
    assert rows == [
        {"id": 9, "hyp": "D[5, 6]", "hyp_tok": "T[5, 6]", "ref": "D[3, 4]", "ref_tok": "T[3, 4]"},
        {"id": 4, "hyp": "D[7]", "hyp_tok": "T[7]", "ref": "D[5, 2]", "ref_tok": "T[5, 2]"},
    ]
    assert module.predict_step(batch, 0) == [{k: r[k] for k in ("id", "hyp", "hyp_tok")} for r in rows]
    assert module.translations == {"test": rows, "predict": module.translations["predict"]}
    assert len(module.translations["predict"]) == 2


def test_beam_settings_given_as_a_mapping_become_a_config():
    """A checkpoint's hyperparameters and the CLI hand ``beam`` over as a plain mapping."""
    config = TransformerConfig(vocab_size=8, d_model=8, n_heads=2, ffn_dim=8, n_layers=1, n_encoder_layers=1)
    module = Translator(config, beam={"beam_size": 7, "max_len_b": 11})
    assert module.beam == BeamSearchConfig(beam_size=7, max_len_b=11)
    given = BeamSearchConfig(beam_size=2)
    assert Translator(config, beam=given).beam is given


def test_only_test_generates_unless_bleu_in_validation():
    config = TransformerConfig(vocab_size=8, d_model=8, n_heads=2, ffn_dim=8, n_layers=1, n_encoder_layers=1)
    assert Translator(config)._generates("test") and not Translator(config)._generates("val")
    assert Translator(config, bleu_in_validation=True)._generates("val")
